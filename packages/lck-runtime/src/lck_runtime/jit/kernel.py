"""``Kernel``: one compiled cubin, loaded onto each device at first use and launched with typed args.

:meth:`lck_runtime.jit.Jit.build` makes these; launching goes through the JIT's pybind11 host module
(:mod:`lck_runtime.jit.host`), which :class:`Kernel` obtains from its ``Jit`` on first load.
:meth:`Kernel.launch` checks everything on every call; :meth:`Kernel.bind` checks once and returns a
:class:`BoundLaunch` whose calls only pass a grid and the argument values on (for hot paths).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from lck_runtime.jit.args import KIND_F32, KIND_I32, KIND_I64, KIND_PTR, KIND_U64, _Arg, pack_args
from lck_runtime.jit.cache import Entry
from lck_runtime.jit.compiler import CAPABILITY_ARCH
from lck_runtime.jit.errors import JitConfigError, JitError
from lck_runtime.jit.host import HostModule, call

__all__ = ["BoundLaunch", "BuildPlan", "Kernel"]

_KIND_BYTES = {KIND_I32: 4, KIND_F32: 4, KIND_I64: 8, KIND_U64: 8, KIND_PTR: 8}
_KIND_NAMES = {KIND_I32: "I32", KIND_F32: "F32", KIND_I64: "I64", KIND_U64: "U64", KIND_PTR: "Ptr/tensor"}
# cuFuncSetAttribute / cuFuncGetAttribute ids (CUfunction_attribute).
_ATTR_MAX_THREADS = 0
_ATTR_SHARED_SIZE = 1
_ATTR_LOCAL_SIZE = 3
_ATTR_NUM_REGS = 4
_ATTR_MAX_DYNAMIC_SHARED = 8
_DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory above this needs an explicit opt-in
_MAX_GRID = (2**31 - 1, 65535, 65535)
_NO_CLUSTER = (0, 0, 0)


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


def _dims(value: Any, what: str, where: str = "launch") -> tuple[int, int, int]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)) or not 1 <= len(items) <= 3:
        raise TypeError(f"{where}: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items):
        raise ValueError(f"{where}: {what} entries must be positive ints, got {value!r}")
    x, y, z = (*items, 1, 1)[:3]
    return x, y, z


def _grid(value: Any, where: str = "launch") -> tuple[int, int, int]:
    g = _dims(value, "grid", where)
    if g[0] > _MAX_GRID[0] or g[1] > _MAX_GRID[1] or g[2] > _MAX_GRID[2]:
        raise ValueError(f"{where}: grid {g} exceeds (2**31-1, 65535, 65535)")
    return g


def _block(value: Any, where: str = "launch") -> tuple[int, int, int]:
    b = _dims(value, "block", where)
    if b[0] * b[1] * b[2] > 1024 or b[2] > 64:
        raise ValueError(f"{where}: block {b} exceeds 1024 threads (or 64 in z)")
    return b


def _check_shared_mem(shared_mem: Any, where: str = "launch") -> None:
    if isinstance(shared_mem, bool) or not isinstance(shared_mem, int) or shared_mem < 0:
        raise ValueError(f"{where}: shared_mem must be a non-negative int (bytes), got {shared_mem!r}")


class Kernel:
    """One compiled kernel: ``key``, ``cubin_path``, ``command`` (the nvcc argv that built it),
    ``from_cache`` (True when nvcc did not run for this build), ``arch``; :meth:`launch` runs it, :meth:`bind`
    prepares a :class:`BoundLaunch` that runs it with the least host work."""

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

        g = _grid(grid)
        b = _block(block)
        _check_shared_mem(shared_mem)
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
        self._check_param_sizes(kinds, sizes, "launch", "args")
        self._opt_in_shared(dev, func, shared_mem)
        call(self._host, "launch", dev, func, g, b, shared_mem, handle, kinds, values, cooperative, c)

    def _check_param_sizes(
        self, kinds: Sequence[int], sizes: list[int] | None, where: str, what: str
    ) -> None:
        """The kinds' byte sizes against the parameters' as the driver reports them (drivers >= 12.4)."""
        if sizes is None:
            return
        if len(sizes) != len(kinds):
            raise ValueError(
                f"{self.name}.{where}: {self.kernel} takes {len(sizes)} parameters (byte sizes {sizes}) but "
                f"{len(kinds)} {what} were given"
            )
        for i, (k, s) in enumerate(zip(kinds, sizes)):
            if _KIND_BYTES[k] != s:
                raise TypeError(
                    f"{self.name}.{where}: {what}[{i}] is {_KIND_NAMES[k]} ({_KIND_BYTES[k]} bytes) but parameter "
                    f"{i} of {self.kernel} is {s} bytes"
                )

    def bind(
        self,
        kinds: Sequence[type[_Arg]],
        *,
        block: int | tuple[int, ...],
        shared_mem: int = 0,
        device: int | None = None,
    ) -> BoundLaunch:
        """This kernel with its argument kinds, block size and dynamic shared memory fixed, on ``device``
        (default: the current one): a :class:`BoundLaunch` whose call takes only a grid and the values.

        :meth:`launch` validates the launch and wraps, checks and packs every argument on each call, which
        costs a launch-heavy op (several kernels per call) more host time than the GPU spends. Binding does
        all of that once: ``kinds`` is the argument classes in parameter order (``[Ptr, I32, I64, ...]``;
        ``Ptr`` for a tensor, whose ``data_ptr()`` is then passed), checked like :meth:`launch`'s args
        against the kernel's parameter byte sizes (drivers >= 12.4); ``block`` and ``shared_mem`` as in
        :meth:`launch` (above 48 KiB the kernel is opted in here). Loads the kernel onto the device (so
        call it before CUDA-graph capture) and checks its architecture. The bound launch always targets
        ``device``, whatever device is current when it is called. Cooperative and cluster launches are not
        supported by the bound path: use :meth:`launch` for them.
        """
        where = f"{self.name}.bind"
        if isinstance(kinds, (str, bytes)) or not isinstance(kinds, Sequence):
            raise TypeError(f"{where}: kinds must be a list or tuple of I32/I64/U64/F32/Ptr, got {kinds!r}")
        codes = []
        for i, k in enumerate(kinds):
            if not (isinstance(k, type) and issubclass(k, _Arg) and k is not _Arg):
                raise TypeError(
                    f"{where}: kinds[{i}] is {k!r}; expected one of the argument classes I32, I64, U64, F32, Ptr"
                )
            codes.append(k.kind)
        b = _block(block, where)
        _check_shared_mem(shared_mem, where)
        dev = self._device(device)
        func, sizes = self._load(dev)
        self._check_param_sizes(codes, sizes, "bind", "kinds")
        self._opt_in_shared(dev, func, shared_mem)
        assert self._host is not None
        return BoundLaunch(self, dev, func, self._host, tuple(codes), b, shared_mem)

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


def _current_stream_getter() -> Callable[[int], int]:
    """``device index -> raw handle of torch's current stream there``, the cheapest way torch offers."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a private, stable since torch 1.13
    if raw is not None:
        return raw
    return lambda dev: torch.cuda.current_stream(dev).cuda_stream


class BoundLaunch:
    """A :class:`Kernel` bound by :meth:`Kernel.bind` to a device, block size, dynamic shared memory and
    argument kinds. ``bound(grid, values, stream=None)`` launches it; see :meth:`__call__`."""

    __slots__ = ("_func", "_host", "_n", "_stream_of", "block", "device", "kernel", "kinds", "shared_mem")

    def __init__(
        self,
        kernel: Kernel,
        device: int,
        func: int,
        host: HostModule,
        kinds: tuple[int, ...],
        block: tuple[int, int, int],
        shared_mem: int,
    ) -> None:
        self.kernel = kernel
        self.device = device
        self.kinds = kinds  # kind codes (lck_runtime.jit.args.KIND_*), in parameter order
        self.block = block
        self.shared_mem = shared_mem
        self._func = func
        self._host = host
        self._n = len(kinds)
        self._stream_of = _current_stream_getter()

    def __repr__(self) -> str:
        kinds = ", ".join(_KIND_NAMES[k].split("/")[0] for k in self.kinds)
        return (
            f"BoundLaunch({self.kernel.name!r}, device={self.device}, block={self.block}, "
            f"shared_mem={self.shared_mem}, kinds=({kinds}))"
        )

    def __call__(
        self, grid: int | tuple[int, ...], values: Sequence[int | float], stream: Any = None
    ) -> None:
        """Launch on the bound device, asynchronously on ``stream`` (default: torch's current stream of that
        device), with ``grid`` blocks (an int or 1 to 3 positive ints).

        ``values``: one plain int or float per bound kind, in parameter order: a tensor as its
        ``data_ptr()``, a null pointer as 0. Only their count is checked here; the host module refuses a
        value that does not fit its kind (a float for an int, an int out of range) with a ``TypeError``
        or ``RuntimeError`` from pybind11. Driver failures raise :class:`CudaError`.
        """
        if type(grid) is int and 0 < grid <= _MAX_GRID[0]:  # the common case (bool is not int here)
            g = (grid, 1, 1)
        else:
            g = _grid(grid, self.kernel.name)
        try:
            n = len(values)
        except TypeError:
            raise TypeError(
                f"{self.kernel.name}: values must be a list or tuple of ints/floats, got {type(values).__name__}"
            ) from None
        if n != self._n:
            raise ValueError(
                f"{self.kernel.name}: {self.kernel.kernel} was bound with {self._n} argument kinds but {n} "
                "values were given"
            )
        if stream is None:
            handle = self._stream_of(self.device)
        else:
            handle = self._stream_handle(stream)
        call(
            self._host,
            "launch",
            self.device,
            self._func,
            g,
            self.block,
            self.shared_mem,
            handle,
            self.kinds,
            values,
            False,
            _NO_CLUSTER,
        )

    def _stream_handle(self, stream: Any) -> int:
        import torch

        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(
                f"{self.kernel.name}: stream must be a torch.cuda.Stream or None, got {type(stream).__name__}"
            )
        if stream.device.index != self.device:
            raise ValueError(
                f"{self.kernel.name}: stream is on {stream.device} but the launch is bound to cuda:{self.device}"
            )
        return stream.cuda_stream
