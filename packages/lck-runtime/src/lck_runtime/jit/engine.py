"""``Jit`` (compile CUDA C++ to cached cubins) and ``Kernel`` (load one and launch it with typed args)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lck_runtime.jit.args import KIND_F32, KIND_I32, KIND_I64, KIND_PTR, KIND_U64, pack_args
from lck_runtime.jit.cache import Entry, compute_key, ensure_root, get_or_create
from lck_runtime.jit.compiler import (
    CAPABILITY_ARCH,
    check_arch,
    cubin_flags,
    detect_arch,
    nvcc_version,
    resolve_nvcc,
    run_compiler,
)
from lck_runtime.jit.cubin import kernel_symbols
from lck_runtime.jit.errors import JitConfigError, JitError
from lck_runtime.jit.flags import JitSettings, define_flags, read_settings
from lck_runtime.jit.host import HostModule, call, load_host

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")
_SYMBOL_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_KIND_BYTES = {KIND_I32: 4, KIND_F32: 4, KIND_I64: 8, KIND_U64: 8, KIND_PTR: 8}
_KIND_NAMES = {KIND_I32: "I32", KIND_F32: "F32", KIND_I64: "I64", KIND_U64: "U64", KIND_PTR: "Ptr/tensor"}
# cuFuncSetAttribute / cuFuncGetAttribute ids (CUfunction_attribute).
_ATTR_MAX_THREADS = 0
_ATTR_SHARED_SIZE = 1
_ATTR_LOCAL_SIZE = 3
_ATTR_NUM_REGS = 4
_ATTR_MAX_DYNAMIC_SHARED = 8
_DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory above this needs an explicit opt-in

# CUmodule per (cubin sha256, device): one load per process, whichever Kernel object asks first.
_modules: dict[tuple[str, int], int] = {}
_modules_lock = threading.Lock()


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise JitConfigError(f"Jit: {what} must be a positive number of seconds, got {value!r}")
    return float(value)


def _paths(items: Any, what: str) -> list[Path]:
    if items is None:
        return []
    if isinstance(items, (str, bytes, os.PathLike)) or not isinstance(items, Iterable):
        raise TypeError(f"build: {what} must be a sequence of paths, got {type(items).__name__} {items!r}")
    out = []
    for p in items:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"build: {what} items must be paths, got {type(p).__name__} {p!r}")
        out.append(Path(p))
    return out


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)) or not 1 <= len(items) <= 3:
        raise TypeError(f"launch: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items):
        raise ValueError(f"launch: {what} entries must be positive ints, got {value!r}")
    x, y, z = (*items, 1, 1)[:3]
    return x, y, z


@dataclasses.dataclass(frozen=True)
class _Plan:
    name: str
    kernel: str
    arch: str
    source: str
    flags: list[str]
    headers: list[list[str]]
    nvcc: str
    nvcc_version: str
    key: str


class Jit:
    """Compile CUDA C++ into cached cubins and load them for launching.

    ``prefix`` selects the environment knobs ``<prefix>_JIT_CACHE_DIR``, ``<prefix>_JIT_PRINT_COMPILER_COMMAND``
    and ``<prefix>_JIT_EXTRA_FLAGS`` (only ``-DNAME=INTEGER`` items), read and validated here, once.
    ``cache_dir`` overrides the cache root, ``nvcc`` the compiler (default: ``$LCK_NVCC``, PATH, CUDA_HOME).
    ``lock_timeout`` bounds the wait for another process building the same entry; ``compile_timeout``
    bounds one nvcc run. Not collective: every process may call it; concurrent builds of one entry
    compile once.
    """

    def __init__(
        self,
        prefix: str = "LCK",
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        nvcc: str | os.PathLike[str] | None = None,
        lock_timeout: float = 900.0,
        compile_timeout: float = 600.0,
    ):
        settings = read_settings(prefix)
        self._cache_what = f"{prefix}_JIT_CACHE_DIR"
        if cache_dir is not None:
            if not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir):
                raise JitConfigError(f"Jit: cache_dir must be a non-empty path, got {cache_dir!r}")
            settings = dataclasses.replace(settings, cache_dir=Path(cache_dir).expanduser())
            self._cache_what = "Jit(cache_dir=...)"
        if nvcc is not None and not Path(os.fspath(nvcc)).is_file():
            raise JitConfigError(f"Jit: nvcc={os.fspath(nvcc)!r} is not a file")
        self.settings: JitSettings = settings
        self.lock_timeout = _positive(lock_timeout, "lock_timeout")
        self.compile_timeout = _positive(compile_timeout, "compile_timeout")
        self._nvcc_arg = nvcc
        self._nvcc: str | None = None

    @property
    def prefix(self) -> str:
        return self.settings.prefix

    @property
    def cache_dir(self) -> Path:
        return self.settings.cache_dir

    @property
    def nvcc(self) -> str:
        if self._nvcc is None:
            self._nvcc = resolve_nvcc(self._nvcc_arg)
        return self._nvcc

    def _root(self) -> Path:
        return ensure_root(self.settings.cache_dir, self._cache_what)

    def _plan(
        self,
        name: Any,
        source: Any,
        kernel: Any,
        defines: Any,
        headers: Any,
        include_dirs: Any,
        arch: Any,
    ) -> _Plan:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise JitConfigError(
                f"build: name must be 1-100 characters of letters, digits, '_', '.', '-' starting with a letter "
                f"or '_' (it names a cache directory), got {name!r}"
            )
        if not isinstance(source, str) or not source.strip():
            raise JitConfigError(
                f"build: source must be non-empty CUDA C++ text, got {type(source).__name__}"
            )
        if not isinstance(kernel, str) or not _SYMBOL_RE.fullmatch(kernel):
            raise JitConfigError(f"build: kernel must be a C symbol name, got {kernel!r}")
        arch = check_arch(arch)
        defs = define_flags(defines, self.settings.extra_defines)
        header_hashes = []
        for h in _paths(headers, "headers"):
            try:
                data = h.read_bytes()
            except OSError as exc:
                raise JitConfigError(f"build: headers entry {str(h)!r} cannot be read: {exc}") from exc
            header_hashes.append([h.name, hashlib.sha256(data).hexdigest()])
        header_hashes.sort()
        dirs = []
        for d in _paths(include_dirs, "include_dirs"):
            if not d.is_dir():
                raise JitConfigError(f"build: include_dirs entry {str(d)!r} is not a directory")
            dirs.append(str(d.resolve()))
        flags = cubin_flags(arch, defs, dirs)
        nvcc = self.nvcc
        version = nvcc_version(nvcc)
        key = compute_key(
            {
                "kind": "cubin",
                "name": name,
                "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
                "headers": header_hashes,
                "flags": flags,
                "nvcc": version,
            }
        )
        return _Plan(name, kernel, arch, source, flags, header_hashes, nvcc, version, key)

    def _entry(self, plan: _Plan) -> Entry:
        root = self._root()

        def produce(tmp: Path) -> dict[str, Any]:
            src = tmp / f"{plan.name}.cu"
            src.write_text(plan.source)
            out = tmp / f"{plan.name}.cubin"
            argv = [plan.nvcc, *plan.flags, "-o", str(out), str(src)]
            seconds = run_compiler(
                argv,
                print_command=self.settings.print_command,
                label=f"{self.prefix} JIT {plan.name}",
                timeout=self.compile_timeout,
                cwd=str(tmp),
            )
            return {
                "file": out.name,
                "argv": argv,
                "arch": plan.arch,
                "flags": plan.flags,
                "headers": plan.headers,
                "nvcc_version": plan.nvcc_version,
                "compile_seconds": round(seconds, 3),
            }

        entry = get_or_create(root, plan.name, plan.key, produce, lock_timeout=self.lock_timeout)
        try:
            symbols = kernel_symbols(entry.payload)
        except ValueError as exc:
            raise JitError(f"{entry.payload_path}: nvcc did not produce a readable cubin: {exc}") from exc
        if plan.kernel not in symbols:
            raise JitError(
                f"build: kernel {plan.kernel!r} is not a __global__ function of {plan.name!r}; the cubin defines "
                f'{symbols}. Declare it extern "C" __global__ or pass the mangled name'
            )
        return entry

    def compile_only(
        self,
        name: str,
        source: str,
        kernel: str,
        *,
        arch: str,
        defines: Mapping[str, int | bool | str] | None = None,
        headers: Iterable[str | os.PathLike[str]] = (),
        include_dirs: Iterable[str | os.PathLike[str]] = (),
    ) -> Path:
        """Compile (or find in the cache) and return the cubin's path; needs no GPU. ``arch`` is required."""
        if arch is None:
            raise JitConfigError("compile_only: arch is required ('sm_90a', 'sm_100a' or 'sm_103a')")
        plan = self._plan(name, source, kernel, defines, headers, include_dirs, arch)
        return self._entry(plan).payload_path

    def build(
        self,
        name: str,
        source: str,
        kernel: str,
        *,
        defines: Mapping[str, int | bool | str] | None = None,
        headers: Iterable[str | os.PathLike[str]] = (),
        include_dirs: Iterable[str | os.PathLike[str]] = (),
        arch: str | None = None,
    ) -> Kernel:
        """Compile (or find in the cache) and return a launchable :class:`Kernel`.

        ``name`` names the cache entry; ``source`` is CUDA C++ defining ``extern "C" __global__ <kernel>``;
        ``defines`` become ``-DNAME=VALUE`` (then the environment's extra flags); ``headers`` are the
        files the source includes (their content hashes are part of the key); ``arch=None`` detects
        the target from the current CUDA device. Everything is validated before nvcc runs. The cubin
        is loaded onto a device at its first launch (or :meth:`Kernel.load`).
        """
        plan = self._plan(name, source, kernel, defines, headers, include_dirs, arch or detect_arch())
        return Kernel(self, plan, self._entry(plan))

    def host(self) -> HostModule:
        """The imported host module, built into this cache the first time (~10-20 s)."""
        nvcc = self.nvcc
        return load_host(
            self._root(),
            nvcc,
            nvcc_version(nvcc),
            print_command=self.settings.print_command,
            label=f"{self.prefix} JIT host module",
            lock_timeout=self.lock_timeout,
            compile_timeout=self.compile_timeout,
        )


class Kernel:
    """One compiled kernel: ``key``, ``cubin_path``, ``command`` (the nvcc argv that built it),
    ``from_cache`` (True when nvcc did not run for this build), ``arch``; :meth:`launch` runs it."""

    def __init__(self, jit: Jit, plan: _Plan, entry: Entry):
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
