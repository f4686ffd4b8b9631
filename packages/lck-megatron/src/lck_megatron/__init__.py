"""lck-megatron: one-line Megatron-Core patching with lck kernels, and the ``lck demo``.

``apply_lck_to_megatron(rms_norm=True, cross_entropy=False, swiglu=False)`` rebinds Megatron-Core's
RMSNorm, cross-entropy and SwiGLU consumers to lck's kernels (and, with ``attention=True``, the local
specs' attention to torch SDPA); ``revert_lck_from_megatron()`` undoes it.
``LckMegatronSwiGLU`` is the SwiGLU module for hand-built layer specs. Importing this package imports
neither megatron-core nor Triton: both are imported when first needed.
"""

from __future__ import annotations

from lck_runtime.packaging import distribution_version, lazy_exports

__version__ = distribution_version("lck-megatron", source_tree="0.1.0")

_EXPORTS = {
    "apply_lck_to_megatron": "patch",
    "revert_lck_from_megatron": "patch",
    "LckMegatronSwiGLU": "swiglu",
    "LckMegatronRMSNorm": "rms_norm",
    "LckWrappedTorchNorm": "rms_norm",
    "LckVocabParallelCrossEntropy": "cross_entropy",
    "LckDotProductAttention": "attention",
}

__all__ = ["__version__", *_EXPORTS]


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
