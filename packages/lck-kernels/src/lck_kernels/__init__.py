"""lck-kernels: Triton kernels with autograd, ``torch.library`` ops and ``nn.Module`` wrappers.

Public names are imported lazily (PEP 562): ``import lck_kernels`` stays cheap and does not compile or
import Triton until an op is used, which matters for ``lck`` CLI start-up and for code that must set
``TRITON_INTERPRET`` before Triton is imported.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("lck-kernels")
except PackageNotFoundError:  # running from a source tree on PYTHONPATH (GPU runners)
    __version__ = "0.1.0"

# public name -> defining module
_EXPORTS = {
    "rms_norm": "rms_norm",
    "LckRMSNorm": "rms_norm",
    "swiglu": "swiglu",
    "LckSwiGLUMLP": "swiglu",
    "swiglu_packed": "swiglu_packed",
    "cross_entropy": "cross_entropy",
    "LckCrossEntropyLoss": "cross_entropy",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy",
    "LckFusedLinearCrossEntropyLoss": "fused_linear_cross_entropy",
    "fused_linear_scaled_cross_entropy": "fused_linear_scaled_cross_entropy",
    "vocab_parallel_cross_entropy": "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_scaled_cross_entropy": "vocab_parallel_fused_linear_scaled_cross_entropy",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lck_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lck_kernels.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
