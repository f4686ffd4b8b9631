"""Build and import lck-kernels' C++ host module (``module.cpp``) through the runtime's JIT cache.

The module includes torch's C++ headers, so one build takes tens of seconds; it is built once per (torch
build, Python, compiler, sources, flags) into the ``LCK`` JIT cache (``LCK_JIT_CACHE_DIR``) and imported from
there by every later process (concurrent builds of one entry compile once). The C++ compiler is ``$CXX``,
else ``g++``/``c++`` on PATH; CUDA's headers come from ``CUDA_HOME`` or next to nvcc.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
PKG = HERE.parent
SOURCES = (HERE / "module.cpp", *sorted(HERE.glob("*.h")), *sorted(PKG.glob("*/csrc/host.h")))
MODULE_NAME = "_lck_kernels_host"


class ToolchainMissing(RuntimeError):
    """No C++ compiler or no CUDA headers here: the module cannot be built on this machine."""


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise ToolchainMissing("no C++ compiler: set CXX or put g++ on PATH")


def _cuda_include() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(home) / "include"] if home else []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates += [Path("/usr/local/cuda/include")]
    for c in candidates:
        if (c / "cuda.h").is_file():
            return str(c)
    raise ToolchainMissing("CUDA headers (cuda.h) not found: set CUDA_HOME")


def flags() -> list[str]:
    """Compiler and linker flags (without the output and source paths)."""
    import torch

    root = Path(torch.__file__).resolve().parent
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    out = [
        "-shared", "-O2", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I", str(root / "include"), "-I", str(root / "include" / "torch" / "csrc" / "api" / "include"),
        "-I", sysconfig.get_paths()["include"], "-I", _cuda_include(),
        "-L", str(root / "lib"), f"-Wl,-rpath,{root / 'lib'}",
        "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl",
    ]  # fmt: skip
    # ATen's CUDA kernels called directly (the fused linear CE's GEMMs) where this torch has them.
    if (root / "lib" / "libtorch_cuda.so").is_file():
        out += ["-ltorch_cuda", "-DLCK_HOST_ATEN_CUDA=1"]
    return out


def _key_fields(cxx: str, argv_flags: list[str]) -> dict[str, Any]:
    import torch

    digest = hashlib.sha256()
    for src in SOURCES:
        digest.update(src.read_bytes())
    return {
        "kind": "kernels-host",
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "python": sys.version,
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "compiler": cxx,
        "sources_sha256": digest.hexdigest(),
        "flags": argv_flags,
    }


def load(name: str, source: Path | str, *, label: str) -> ModuleType:
    """Import the extension module ``name`` built from C++ ``source`` against torch, compiling it into the
    JIT cache first if needed. ``source`` is a file (compiled where it lies, so its relative includes
    resolve; the key covers every header in ``SOURCES``) or the text of one (for test harnesses, which
    include the headers by absolute path). Raises :class:`ToolchainMissing` without a compiler or CUDA's
    headers, ``lck_runtime.jit.JitError`` when the compile fails."""
    from lck_runtime.jit import Jit
    from lck_runtime.jit.cache import compute_key, ensure_root, get_or_create
    from lck_runtime.jit.compiler import run_compiler

    jit = Jit(prefix="LCK")
    cxx = _compiler()
    argv_flags = flags()
    text = source if isinstance(source, str) else None
    fields = {**_key_fields(cxx, argv_flags), "name": name, "text": text}
    filename = name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")

    def produce(tmp: Path) -> dict[str, Any]:
        src = Path(source) if text is None else tmp / f"{name}.cpp"
        if text is not None:
            src.write_text(text)
        argv = [cxx, str(src), "-o", str(tmp / filename), *argv_flags]
        seconds = run_compiler(argv, print_command=jit.settings.print_command, label=label, timeout=900.0)
        return {"file": filename, "argv": argv, "compile_seconds": round(seconds, 3), "fields": fields}

    root = ensure_root(jit.cache_dir, "LCK_JIT_CACHE_DIR")
    entry = get_or_create(root, name.strip("_"), compute_key(fields), produce, lock_timeout=jit.lock_timeout)
    spec = importlib.util.spec_from_file_location(name, entry.payload_path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {entry.payload_path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build() -> ModuleType:
    """Import lck-kernels' host module (``module.cpp``), compiling it first if needed. Raises on any failure."""
    return load(MODULE_NAME, HERE / "module.cpp", label="lck-kernels host")
