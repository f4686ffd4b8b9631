"""lck-ep: expert-parallel dispatch and combine (DeepEP-style API), its all-to-all reference backend,
and EP kernels generated and compiled by the runtime JIT (prefix ``EP``).

Public names are imported lazily (PEP 562): ``import lck_ep`` stays cheap and does not import torch
until a name is used, so tools that only read the ``EP_*`` knobs or generate kernel source start fast.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("lck-ep")
except PackageNotFoundError:  # running from a source tree on PYTHONPATH (GPU runners)
    __version__ = "0.1.0"

# public name -> defining module
_EXPORTS = {
    "Buffer": "buffer",
    "DispatchOutput": "buffer",
    "CombineOutput": "buffer",
    "DispatchHandle": "handle",
    "DispatchLayout": "layout",
    "get_dispatch_layout": "layout",
    "layout_reference": "layout",
    "Event": "events",
    "EpKnobs": "knobs",
    "KnobError": "knobs",
    "read_knobs": "knobs",
    "MoEExperts": "moe",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lck_ep' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lck_ep.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
