"""lck-ep: expert-parallel dispatch and combine (DeepEP-style API), its all-to-all reference backend,
and EP kernels generated and compiled by the runtime JIT (prefix ``EP``).

Public names are imported lazily (PEP 562): ``import lck_ep`` stays cheap and does not import torch
until a name is used, so tools that only read the ``EP_*`` knobs or generate kernel source start fast.
"""

from __future__ import annotations

from lck_runtime.packaging import distribution_version, lazy_exports

__version__ = distribution_version("lck-ep", source_tree="0.1.0")

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


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
