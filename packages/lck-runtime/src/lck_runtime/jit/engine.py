"""``Jit``: compile CUDA C++ to cached cubins and hand them out as launchable kernels.

``Jit.build`` validates a request into a :class:`BuildPlan` (the cache key covers source, headers,
flags and nvcc version), compiles or finds it in the cache, and returns a
:class:`~lck_runtime.jit.kernel.Kernel` (re-exported here), which loads and launches it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lck_runtime.jit.cache import Entry, compute_key, ensure_root, get_or_create
from lck_runtime.jit.compiler import (
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
from lck_runtime.jit.host import HostModule, load_host
from lck_runtime.jit.kernel import BuildPlan, Kernel

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")
_QUOTED_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"\n]+)"', re.MULTILINE)
_SYMBOL_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


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


def _included_headers(source: str, dirs: list[Path], declared: list[Path]) -> list[Path]:
    """Every header the build reads through quoted includes, found the way nvcc looks for them: a header's
    own directory first (the source's is the build's scratch folder, so not for it), then ``dirs`` in
    order; recursively, each file once. Angle-bracket includes are the toolkit's, covered by the nvcc
    version in the key. An include found nowhere is left to nvcc to report."""
    found: dict[Path, None] = {p.resolve(): None for p in declared}
    todo: list[tuple[str, Path | None]] = [(source, None)]
    todo += [(p.read_text(errors="replace"), p.resolve().parent) for p in declared]
    while todo:
        text, here = todo.pop()
        for name in _QUOTED_INCLUDE_RE.findall(text):
            for d in ([here] if here is not None else []) + dirs:
                cand = (d / name).resolve()
                if cand.is_file():
                    if cand not in found:
                        found[cand] = None
                        todo.append((cand.read_text(errors="replace"), cand.parent))
                    break
    return list(found)


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
    ) -> BuildPlan:
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
        declared = _paths(headers, "headers")
        for h in declared:
            if not h.is_file():
                raise JitConfigError(f"build: headers entry {str(h)!r} is not a readable file")
        dirs = []
        for d in _paths(include_dirs, "include_dirs"):
            if not d.is_dir():
                raise JitConfigError(f"build: include_dirs entry {str(d)!r} is not a directory")
            dirs.append(d.resolve())
        header_hashes = []
        for h in _included_headers(source, dirs, declared):
            try:
                data = h.read_bytes()
            except OSError as exc:
                raise JitConfigError(f"build: header {str(h)!r} cannot be read: {exc}") from exc
            header_hashes.append([h.name, hashlib.sha256(data).hexdigest()])
        header_hashes.sort()
        flags = cubin_flags(arch, defs, [str(d) for d in dirs])
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
        return BuildPlan(name, kernel, arch, source, flags, header_hashes, nvcc, version, key)

    def _entry(self, plan: BuildPlan) -> Entry:
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
        ``defines`` become ``-DNAME=VALUE`` (then the environment's extra flags); the content hashes of
        ``headers`` and of every header reached through quoted ``#include`` lines (in ``include_dirs``,
        recursively) are part of the key; ``arch=None`` detects
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
