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
# torch.compile backends of the compile tests: aot_eager runs the CPU variant, inductor the GPU one.
COMPILE_BACKENDS = [
    pytest.param(
        "aot_eager", marks=pytest.mark.skipif(not interpreting(), reason="CPU variant"), id="aot_eager"
    ),
    pytest.param("inductor", marks=gpu, id="gpu-inductor"),
]
