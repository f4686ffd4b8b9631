"""``Kernel``: one compiled cubin, loaded onto each device at first use and launched with typed args.

:meth:`lck_runtime.jit.Jit.build` makes these; launching goes through the JIT's pybind11 host module
(:mod:`lck_runtime.jit.host`), which :class:`Kernel` obtains from its ``Jit`` on first load.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Any, Protocol

from lck_runtime.jit.args import KIND_F32, KIND_I32, KIND_I64, KIND_PTR, KIND_U64, pack_args
from lck_runtime.jit.cache import Entry
from lck_runtime.jit.compiler import CAPABILITY_ARCH
from lck_runtime.jit.errors import JitConfigError, JitError
from lck_runtime.jit.host import HostModule, call

__all__ = ["BuildPlan", "Kernel"]

_KIND_BYTES = {KIND_I32: 4, KIND_F32: 4, KIND_I64: 8, KIND_U64: 8, KIND_PTR: 8}
_KIND_NAMES = {KIND_I32: "I32", KIND_F32: "F32", KIND_I64: "I64", KIND_U64: "U64", KIND_PTR: "Ptr/tensor"}
# cuFuncSetAttribute / cuFuncGetAttribute ids (CUfunction_attribute).
_ATTR_MAX_THREADS = 0
_ATTR_SHARED_SIZE = 1
_ATTR_LOCAL_SIZE = 3
_ATTR_NUM_REGS = 4
_ATTR_MAX_DYNAMIC_SHARED = 8
_DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory above this needs an explicit opt-in


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """A validated build request and its cache key."""

    name: str
    kernel: str
    arch: str
    source: str
    flags: list[str]
    headers: list[list[str]]
    nvcc: str
    nvcc_version: str
    key: str


class HostSource(Protocol):
    """What a :class:`Kernel` needs from the ``Jit`` that built it (a protocol, so this module does not
    import the engine, which imports it)."""

    def host(self) -> HostModule: ...


# CUmodule per (cubin sha256, device): one load per process, whichever Kernel object asks first.
_modules: dict[tuple[str, int], int] = {}
_modules_lock = threading.Lock()


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)) or not 1 <= len(items) <= 3:
        raise TypeError(f"launch: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items):
        raise ValueError(f"launch: {what} entries must be positive ints, got {value!r}")
    x, y, z = (*items, 1, 1)[:3]
    return x, y, z


class Kernel:
    """One compiled kernel: ``key``, ``cubin_path``, ``command`` (the nvcc argv that built it),
    ``from_cache`` (True when nvcc did not run for this build), ``arch``; :meth:`launch` runs it."""

    def __init__(self, jit: HostSource, plan: BuildPlan, entry: Entry):
        self._jit = jit
        self.name = plan.name
        self.kernel = plan.kernel
        self.arch = plan.arch
        self.key = plan.key
        self.flags = list(plan.flags)
        self.nvcc_version = plan.nvcc_version
        self.cubin_path = entry.payload_path
        self.command: list[str] = list(entry.meta["argv"])
        self.from_cache = entry.from_cache
        self._image = entry.payload
        self._sha = entry.meta["sha256"]
        self._host: HostModule | None = None
        self._functions: dict[int, tuple[int, list[int] | None]] = {}
        self._smem_optin: dict[int, int] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, kernel={self.kernel!r}, arch={self.arch!r}, key={self.key[:16]})"

    def _device(self, device: int | None) -> int:
        import torch

        if not torch.cuda.is_available():
            raise JitError(f"{self.name}: launching needs a CUDA device; none is visible")
        dev = torch.cuda.current_device() if device is None else device
        if isinstance(dev, bool) or not isinstance(dev, int) or not 0 <= dev < torch.cuda.device_count():
            raise ValueError(f"{self.name}: device must be a CUDA device index, got {device!r}")
        cap = torch.cuda.get_device_capability(dev)
        if CAPABILITY_ARCH.get(cap) != self.arch:
            raise JitConfigError(
                f"{self.name}: built for {self.arch} but cuda:{dev} has compute capability {cap[0]}.{cap[1]} "
                f"({CAPABILITY_ARCH.get(cap, 'unsupported')}); build with arch=None to target the current device"
            )
        return dev

    def load(self, device: int | None = None) -> int:
        """Load the cubin onto ``device`` (default: current) and return the ``CUfunction`` handle.

        Launch does this on first use; call it before CUDA-graph capture to keep module loading out of
        the captured region.
        """
        dev = self._device(device)
        return self._load(dev)[0]

    def _load(self, dev: int) -> tuple[int, list[int] | None]:
        fn = self._functions.get(dev)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(dev)
            if fn is not None:
                return fn
            if self._host is None:
                self._host = self._jit.host()
            host = self._host
            with _modules_lock:
                module = _modules.get((self._sha, dev))
                if module is None:
                    module = call(host, "load_module", dev, self._image)
                    _modules[(self._sha, dev)] = module
            func = call(host, "get_function", dev, module, self.kernel)
            sizes = call(host, "param_sizes", dev, func)
            fn = (func, None if sizes is None else list(sizes))
            self._functions[dev] = fn
            return fn

    def attributes(self, device: int | None = None) -> dict[str, int]:
        """Register count, max threads per block, static shared and local memory bytes on ``device``."""
        dev = self._device(device)
        func, _ = self._load(dev)
        host = self._host
        assert host is not None
        return {
            "num_regs": call(host, "get_attribute", dev, func, _ATTR_NUM_REGS),
            "max_threads_per_block": call(host, "get_attribute", dev, func, _ATTR_MAX_THREADS),
            "static_shared_bytes": call(host, "get_attribute", dev, func, _ATTR_SHARED_SIZE),
            "local_bytes": call(host, "get_attribute", dev, func, _ATTR_LOCAL_SIZE),
        }

    def launch(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        args: Iterable[Any],
        *,
        shared_mem: int = 0,
        stream: Any = None,
        cooperative: bool = False,
        cluster: int | tuple[int, ...] | None = None,
    ) -> None:
        """Launch on the current CUDA device, asynchronously on ``stream`` (default: torch's current stream).

        ``args``: torch CUDA tensors on the current device (passed as pointers) and typed scalars
        ``I32/I64/U64/F32/Ptr``; plain ints/floats are refused. Their count and byte sizes are checked
        against the kernel's parameters (drivers >= 12.4). ``shared_mem`` is dynamic shared memory in
        bytes (above 48 KiB the kernel is opted in first); ``cooperative`` makes a cooperative launch
        (grid-wide sync); ``cluster`` gives thread-block-cluster dimensions (each must divide the grid's).
        Driver failures raise :class:`CudaError` carrying the CUDA error name and text.
        """
        import torch

        g = _dims(grid, "grid")
        b = _dims(block, "block")
        if b[0] * b[1] * b[2] > 1024 or b[2] > 64:
            raise ValueError(f"launch: block {b} exceeds 1024 threads (or 64 in z)")
        if g[0] > 2**31 - 1 or g[1] > 65535 or g[2] > 65535:
            raise ValueError(f"launch: grid {g} exceeds (2**31-1, 65535, 65535)")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, int) or shared_mem < 0:
            raise ValueError(f"launch: shared_mem must be a non-negative int (bytes), got {shared_mem!r}")
        if not isinstance(cooperative, bool):
            raise TypeError(f"launch: cooperative must be a bool, got {cooperative!r}")
        c = (0, 0, 0)
        if cluster is not None:
            c = _dims(cluster, "cluster")
            if any(gi % ci for gi, ci in zip(g, c)):
                raise ValueError(f"launch: cluster {c} must divide grid {g} in every dimension")
            if c[0] * c[1] * c[2] > 8:
                raise ValueError(f"launch: cluster {c} has more than 8 blocks (the portable maximum)")
        # Fast path: a device this kernel is already loaded on was checked then (arch, index).
        dev = torch.cuda.current_device() if torch.cuda.is_initialized() else -1
        if dev not in self._functions:
            dev = self._device(None)
        kinds, values = pack_args(args, dev, where=f"{self.name}.launch")
        if stream is None:
            handle = torch.cuda.current_stream(dev).cuda_stream
        elif isinstance(stream, torch.cuda.Stream):
            if stream.device.index != dev:
                raise ValueError(f"launch: stream is on {stream.device} but the current device is cuda:{dev}")
            handle = stream.cuda_stream
        else:
            raise TypeError(
                f"launch: stream must be a torch.cuda.Stream or None, got {type(stream).__name__}"
            )
        func, sizes = self._load(dev)
        if sizes is not None:
            if len(sizes) != len(kinds):
                raise ValueError(
                    f"{self.name}.launch: {self.kernel} takes {len(sizes)} parameters (byte sizes {sizes}) but "
                    f"{len(kinds)} args were given"
                )
            for i, (k, s) in enumerate(zip(kinds, sizes)):
                if _KIND_BYTES[k] != s:
                    raise TypeError(
                        f"{self.name}.launch: args[{i}] is {_KIND_NAMES[k]} ({_KIND_BYTES[k]} bytes) but parameter "
                        f"{i} of {self.kernel} is {s} bytes"
                    )
        self._opt_in_shared(dev, func, shared_mem)
        call(self._host, "launch", dev, func, g, b, shared_mem, handle, kinds, values, cooperative, c)

    def _opt_in_shared(self, dev: int, func: int, shared_mem: int) -> None:
        if shared_mem > _DEFAULT_SHARED_LIMIT and shared_mem > self._smem_optin.get(dev, 0):
            call(self._host, "set_attribute", dev, func, _ATTR_MAX_DYNAMIC_SHARED, shared_mem)
            self._smem_optin[dev] = shared_mem

    def max_active_clusters(
        self,
        block: int | tuple[int, ...],
        cluster: int | tuple[int, ...],
        *,
        shared_mem: int = 0,
        device: int | None = None,
    ) -> int | None:
        """Clusters of ``cluster`` blocks that can be resident on ``device`` at once with this block size and
        dynamic shared memory (``cuOccupancyMaxActiveClusters``): a persistent grid of at most that many
        clusters never waits for an SM. ``None`` when the driver cannot tell (older than CUDA 12.0)."""
        b = _dims(block, "block")
        c = _dims(cluster, "cluster")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, int) or shared_mem < 0:
            raise ValueError(
                f"max_active_clusters: shared_mem must be a non-negative int, got {shared_mem!r}"
            )
        dev = self._device(device)
        func, _ = self._load(dev)
        self._opt_in_shared(dev, func, shared_mem)
        n = call(self._host, "max_active_clusters", dev, func, b, shared_mem, c)
        return None if n < 0 else int(n)
