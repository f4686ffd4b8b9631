"""The lck CUDA JIT: CUDA C++ → cached cubins (nvcc), loaded and launched by one cached pybind11 module.

```python
from lck_runtime.jit import Jit, I32, Ptr

jit = Jit(prefix="EP")  # EP_JIT_CACHE_DIR, EP_JIT_PRINT_COMPILER_COMMAND, EP_JIT_EXTRA_FLAGS
kernel = jit.build("scale", source, "scale_kernel", defines={"VEC": 4})
kernel.launch(grid, block, [x, I32(n)])
```

Importing this package needs neither torch nor a GPU; compiling needs nvcc; launching needs a GPU.
"""

from __future__ import annotations

from lck_runtime.jit.args import F32, I32, I64, U64, Ptr
from lck_runtime.jit.compiler import CAPABILITY_ARCH, SUPPORTED_ARCHS, detect_arch
from lck_runtime.jit.engine import Jit
from lck_runtime.jit.errors import CudaError, JitConfigError, JitError
from lck_runtime.jit.flags import JitSettings
from lck_runtime.jit.host import HostModule
from lck_runtime.jit.kernel import BoundLaunch, Kernel

__all__ = [
    "CAPABILITY_ARCH",
    "F32",
    "I32",
    "I64",
    "SUPPORTED_ARCHS",
    "U64",
    "BoundLaunch",
    "CudaError",
    "HostModule",
    "Jit",
    "JitConfigError",
    "JitError",
    "JitSettings",
    "Kernel",
    "Ptr",
    "detect_arch",
]
