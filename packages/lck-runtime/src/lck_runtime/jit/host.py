"""The host side of the JIT: one pybind11 extension (``host_module.cpp``) that loads cubins and launches
kernels through the CUDA driver API.

Compiling pybind11 headers costs ~10-20 s of host compilation, so the module is built once per
(nvcc version, Python version/ABI, pybind11 version, source, flags), stored as a cache entry like a
cubin, and imported from there by every later process. Within a process it is imported once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lck_runtime.jit.cache import Entry, compute_key, get_or_create
from lck_runtime.jit.compiler import run_compiler
from lck_runtime.jit.errors import CudaError, JitError

SOURCE = Path(__file__).with_name("host_module.cpp")
MODULE_NAME = "_lck_jit_host"
ENTRY_NAME = "_host"

_loaded: dict[str, HostModule] = {}
_load_lock = threading.Lock()


@dataclass(frozen=True)
class HostModule:
    """The imported host module and where it came from (``from_cache``: nvcc did not run for it)."""

    module: ModuleType
    key: str
    path: Path
    command: list[str]
    from_cache: bool


def host_flags() -> list[str]:
    """nvcc flags of the host-module build (without output and input paths)."""
    import pybind11

    return [
        "-shared",
        "-O2",
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "-Xcompiler",
        "-fvisibility=hidden",
        # Only the driver API is used, and it is opened with dlopen: no CUDA runtime, no -lcuda.
        "--cudart",
        "none",
        "-I",
        pybind11.get_include(),
        "-I",
        sysconfig.get_paths()["include"],
    ]


def host_key(nvcc_version: str) -> tuple[str, dict[str, Any]]:
    import pybind11

    source = SOURCE.read_bytes()
    fields = {
        "kind": "host",
        "nvcc": nvcc_version,
        "python": sys.version,
        "cache_tag": sys.implementation.cache_tag,
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "abiflags": getattr(sys, "abiflags", ""),
        "pybind11": pybind11.__version__,
        "source_sha256": hashlib.sha256(source).hexdigest(),
        "flags": [*host_flags(), "-ldl"],
    }
    return compute_key(fields), fields


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise JitError(f"cannot import the JIT host module from {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise JitError(f"cannot import the JIT host module {path}: {exc}") from exc
    return module


def load_host(
    root: Path,
    nvcc: str,
    nvcc_version: str,
    *,
    print_command: bool,
    label: str,
    lock_timeout: float,
    compile_timeout: float,
) -> HostModule:
    """Import the host module, building it into ``root`` first if no valid entry exists."""
    key, fields = host_key(nvcc_version)
    with _load_lock:
        memo = _loaded.get(key)
        if memo is not None:
            return HostModule(memo.module, key, memo.path, memo.command, from_cache=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        filename = MODULE_NAME + suffix

        def produce(tmp: Path) -> dict[str, Any]:
            src = tmp / SOURCE.name
            src.write_bytes(SOURCE.read_bytes())
            argv = [nvcc, *host_flags(), "-o", str(tmp / filename), str(src), "-ldl"]
            seconds = run_compiler(
                argv, print_command=print_command, label=label, timeout=compile_timeout, cwd=str(tmp)
            )
            return {"file": filename, "argv": argv, "compile_seconds": round(seconds, 3), "fields": fields}

        entry: Entry = get_or_create(root, ENTRY_NAME, key, produce, lock_timeout=lock_timeout)
        module = _import(entry.payload_path)
        loaded = HostModule(module, key, entry.payload_path, list(entry.meta["argv"]), entry.from_cache)
        _loaded[key] = loaded
        return loaded


_DRIVER_ERR = re.compile(r"^(\w+) failed: (CUDA_ERROR_\w+)")


def call(host: HostModule, fn: str, *args: Any) -> Any:
    """Call ``host.module.<fn>(*args)``, turning the module's driver errors into :class:`CudaError`."""
    try:
        return getattr(host.module, fn)(*args)
    except host.module.CudaDriverError as exc:
        msg = str(exc)
        m = _DRIVER_ERR.match(msg)
        raise CudaError(msg, call=m.group(1) if m else "", code_name=m.group(2) if m else "") from None
