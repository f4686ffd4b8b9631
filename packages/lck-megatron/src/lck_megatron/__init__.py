"""lck-megatron: one-line Megatron-Core patching with lck kernels, and the ``lck demo``.

``apply_lck_to_megatron(rms_norm=True, cross_entropy=False, swiglu=False)`` rebinds Megatron-Core's
RMSNorm, cross-entropy and SwiGLU consumers to lck's kernels; ``revert_lck_from_megatron()`` undoes it.
``LckMegatronSwiGLU`` is the SwiGLU module for hand-built layer specs. Importing this package imports
neither megatron-core nor Triton: both are imported when first needed.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("lck-megatron")
except PackageNotFoundError:  # running from a source tree on PYTHONPATH (GPU runners)
    __version__ = "0.1.0"

_EXPORTS = {
    "apply_lck_to_megatron": "patch",
    "revert_lck_from_megatron": "patch",
    "LckMegatronSwiGLU": "swiglu",
    "LckMegatronRMSNorm": "rms_norm",
    "LckWrappedTorchNorm": "rms_norm",
    "LckVocabParallelCrossEntropy": "cross_entropy",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lck_megatron' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lck_megatron.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
