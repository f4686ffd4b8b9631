"""Where the kernel tests run, shared by every kernel test module.

Without a GPU the Triton kernels run under ``TRITON_INTERPRET=1`` on CPU tensors at small sizes; a module
whose tests need one or the other sets ``pytestmark = needs_triton_device``. ``gpu`` marks the parameters
that run at real sizes on a CUDA device only.
"""

from __future__ import annotations

import pytest
import torch

from lck_kernels._common import interpreting

DEVICE = "cpu" if interpreting() else "cuda"
needs_triton_device = pytest.mark.skipif(
    not interpreting() and not torch.cuda.is_available(),
    reason="Triton kernels need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors",
)
gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The compile tests' backends. Under TRITON_INTERPRET the ops are opaque custom ops and Inductor would have
# to build C++ for CPU tensors (a minute per graph on CI machines); "aot_eager" runs the same Dynamo +
# AOTAutograd tracing, functionalisation and fake-tensor shape propagation. On the GPU the ops are
# triton_ops and Inductor compiles the real graph.
COMPILE_BACKENDS = [
    pytest.param(
        "aot_eager", marks=pytest.mark.skipif(not interpreting(), reason="CPU variant"), id="aot_eager"
    ),
    pytest.param("inductor", marks=gpu, id="gpu-inductor"),
]
