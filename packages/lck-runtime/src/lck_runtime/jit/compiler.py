"""nvcc: locating it, probing its version, choosing the target architecture, building argv, running it.

nvcc always runs as a subprocess with an argument list (never through a shell). Device code is built
as a cubin only (``nvcc -cubin``: under a second for a small kernel); the host side is the one cached
pybind11 module (see :mod:`lck_runtime.jit.host`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lck_runtime.jit.errors import JitConfigError, JitError
from lck_runtime.toolchain import find_nvcc

# Arch-specific targets ("a"): wgmma/TMA/setmaxnreg on Hopper, tcgen05 on Blackwell. An "a" cubin
# runs only on its exact compute capability, hence one entry per target.
SUPPORTED_ARCHS: dict[str, str] = {
    "sm_90a": "compute_90a",
    "sm_100a": "compute_100a",
    "sm_103a": "compute_103a",
}
CAPABILITY_ARCH: dict[tuple[int, int], str] = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}

# Fixed device-code flags; recorded in every cache key and meta.json.
BASE_CUBIN_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo")

# nvcc reads these behind the argument list; they would change the output without changing the key.
_HIDDEN_FLAG_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")

_version_memo: dict[tuple[str, int, int], str] = {}


def resolve_nvcc(explicit: str | os.PathLike[str] | None = None) -> str:
    """The nvcc to use: ``explicit`` if given, else :func:`lck_runtime.toolchain.find_nvcc`."""
    if explicit is not None:
        path = os.fspath(explicit)
        if not Path(path).is_file():
            raise JitConfigError(f"Jit: nvcc={path!r} is not a file")
        return path
    found = find_nvcc()
    if found is None:
        raise JitError(
            "Jit: nvcc not found ($LCK_NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); install the CUDA "
            "toolkit or set LCK_NVCC to the nvcc binary"
        )
    return found


def nvcc_version(nvcc: str) -> str:
    """The release and build lines of ``nvcc --version`` (memoised per binary path, mtime and size)."""
    st = os.stat(nvcc)
    memo_key = (os.path.realpath(nvcc), st.st_mtime_ns, st.st_size)
    cached = _version_memo.get(memo_key)
    if cached is not None:
        return cached
    try:
        proc = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=120, env=_child_env()
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JitError(f"could not run {nvcc} --version: {exc}") from exc
    lines = [ln.strip() for ln in proc.stdout.splitlines() if re.search(r"release \d|^Build ", ln.strip())]
    if proc.returncode != 0 or not lines:
        raise JitError(
            f"{nvcc} --version failed (exit {proc.returncode}): {(proc.stdout + proc.stderr).strip()[-2000:]}"
        )
    version = " / ".join(lines)
    _version_memo[memo_key] = version
    return version


def check_arch(arch: object) -> str:
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise JitConfigError(f"arch must be one of {sorted(SUPPORTED_ARCHS)}, got {arch!r}")
    return arch


def detect_arch(device: int | None = None) -> str:
    """The target for CUDA ``device`` (default: torch's current device)."""
    import torch

    if not torch.cuda.is_available():
        raise JitConfigError(
            "arch=None needs a CUDA device to detect the target; none is visible. Pass arch='sm_90a' or "
            "'sm_100a' (compile_only builds without a GPU)"
        )
    dev = torch.cuda.current_device() if device is None else device
    cap = torch.cuda.get_device_capability(dev)
    arch = CAPABILITY_ARCH.get(cap)
    if arch is None:
        name = torch.cuda.get_device_name(dev)
        raise JitConfigError(
            f"cuda:{dev} ({name}) has compute capability {cap[0]}.{cap[1]}; the JIT targets "
            f"{', '.join(f'{a} ({c[0]}.{c[1]})' for c, a in CAPABILITY_ARCH.items())}"
        )
    return arch


def cubin_flags(arch: str, defines: Sequence[str], include_dirs: Sequence[str]) -> list[str]:
    """Every nvcc flag of a device-code build except the input and output paths (those are per-build)."""
    gencode = f"-gencode=arch={SUPPORTED_ARCHS[arch]},code={arch}"
    flags = ["-cubin", gencode, *BASE_CUBIN_FLAGS]
    for d in include_dirs:
        flags += ["-I", d]
    flags += list(defines)
    return flags


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in _HIDDEN_FLAG_VARS:
        env.pop(var, None)
    return env


def run_compiler(
    argv: Sequence[str], *, print_command: bool, label: str, timeout: float, cwd: str | None = None
) -> float:
    """Run ``argv``; print it first (shell-quoted) when asked; raise :class:`JitError` with nvcc's output on
    failure. Returns the wall time in seconds."""
    argv = [os.fspath(a) for a in argv]
    if print_command:
        print(f"[{label}] {shlex.join(argv)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_child_env()
        )
    except subprocess.TimeoutExpired as exc:
        raise JitError(f"{label}: nvcc did not finish within {timeout:.0f} s: {shlex.join(argv)}") from exc
    except OSError as exc:
        raise JitError(f"{label}: could not run nvcc: {exc}: {shlex.join(argv)}") from exc
    if proc.returncode != 0:
        out = (proc.stderr + proc.stdout).strip()
        if len(out) > 8000:
            out = "...\n" + out[-8000:]
        raise JitError(f"{label}: nvcc failed (exit {proc.returncode}): {shlex.join(argv)}\n{out}")
    return time.perf_counter() - t0
