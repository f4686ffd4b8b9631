"""lck-kernels: Triton kernels with autograd, ``torch.library`` ops and ``nn.Module`` wrappers.

Importing this package imports Triton and defines the kernels: set ``TRITON_INTERPRET=1`` before the
import to run them on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

# One subpackage per op family (rms_norm/, swiglu/, cross_entropy/, linear_cross_entropy/, vocab_parallel/).
# Two of them share their op's name (`lck_kernels.rms_norm` holds `rms_norm`): the imports below bind the
# functions after the subpackages, so the package attribute is the function, not the subpackage.
from lck_kernels.cross_entropy import LckCrossEntropyLoss, cross_entropy
from lck_kernels.linear_cross_entropy import (
    LckFusedLinearCrossEntropyLoss,
    LckFusedLinearScaledCrossEntropy,
    fused_linear_cross_entropy,
    fused_linear_scaled_cross_entropy,
)
from lck_kernels.rms_norm import LckRMSNorm, rms_norm
from lck_kernels.swiglu import LckSwiGLUMLP, LckSwiGLUPacked, swiglu, swiglu_packed
from lck_kernels.vocab_parallel import (
    LckVocabParallelCrossEntropy,
    LckVocabParallelFusedLinearScaledCrossEntropy,
    vocab_parallel_cross_entropy,
    vocab_parallel_fused_linear_scaled_cross_entropy,
)
from lck_runtime.packaging import distribution_version

__version__ = distribution_version("lck-kernels", source_tree="0.1.0")

__all__ = [
    "LckCrossEntropyLoss",
    "LckFusedLinearCrossEntropyLoss",
    "LckFusedLinearScaledCrossEntropy",
    "LckRMSNorm",
    "LckSwiGLUMLP",
    "LckSwiGLUPacked",
    "LckVocabParallelCrossEntropy",
    "LckVocabParallelFusedLinearScaledCrossEntropy",
    "__version__",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "fused_linear_scaled_cross_entropy",
    "rms_norm",
    "swiglu",
    "swiglu_packed",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_scaled_cross_entropy",
]
