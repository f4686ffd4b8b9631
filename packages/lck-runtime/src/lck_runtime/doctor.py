"""Report the GPU(s), toolchain, NVSHMEM and installed lck layers on this machine."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

from lck_runtime.jit.cache import summarize
from lck_runtime.jit.host import ENTRY_NAME as HOST_ENTRY
from lck_runtime.nvshmem import NATIVE_ARCHS
from lck_runtime.nvshmem import status as nvshmem_status
from lck_runtime.paths import jit_cache_dir

LAYERS = ("lck", "lck-runtime", "lck-kernels", "lck-ep", "lck-megatron")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _layer(dist: str) -> str | None:
    """The installed version of a layer, else what a source checkout on the path holds, else None."""
    installed = _version(dist)
    if installed is not None or dist == "lck":
        return installed
    spec = importlib.util.find_spec(dist.replace("-", "_"))
    if spec is None or spec.origin is None:
        return None
    package_dir = Path(spec.origin).resolve().parent
    project = package_dir.parents[1] / "pyproject.toml"  # <package>/src/<module>/__init__.py
    try:
        declared = tomllib.loads(project.read_text())["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        declared = "?"
    return f"{declared} (source at {package_dir}, not installed)"


def nvcc_info() -> dict[str, Any]:
    from lck_runtime.toolchain import find_nvcc  # local import: keeps `lck --help` fast

    path = find_nvcc()
    if path is None:
        return {"path": None, "version": None}
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
    return {"path": path, "version": m.group(2) if m else out.strip().splitlines()[-1]}


def gpu_info() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cap = (p.major, p.minor)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "sms": p.multi_processor_count,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "native_target": NATIVE_ARCHS.get(cap),
            }
        )
    return gpus


def nvshmem_info() -> dict[str, Any]:
    """Installed wheels, then what nvshmem4py reports from this process (importing it needs no GPU)."""
    info: dict[str, Any] = {
        "nvshmem4py": _version("nvshmem4py-cu13"),
        "library": _version("nvidia-nvshmem-cu13"),
    }
    info.update(nvshmem_status())
    return info


def collect() -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "megatron_core": _version("megatron-core"),
        "gpus": gpu_info(),
        "nvcc": nvcc_info(),
        "nvshmem": nvshmem_info(),
        "layers": {name: _layer(name) for name in LAYERS},
        "jit_cache_dir": str(jit_cache_dir("LCK")),
        "ep_jit_cache_dir": str(jit_cache_dir("EP")),
        "jit_cache": {
            "lck": summarize(jit_cache_dir("LCK"), HOST_ENTRY),
            "lck-ep": summarize(jit_cache_dir("EP"), HOST_ENTRY),
        },
    }
    if torch.cuda.is_available():
        report["driver"] = _driver_version()
    return report


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    out = subprocess.run(
        [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _render(r: dict[str, Any]) -> str:
    lines = [f"torch        {r['torch']} (CUDA {r['torch_cuda'] or 'none'})", f"triton       {r['triton']}"]
    if r["gpus"]:
        for g in r["gpus"]:
            native = g["native_target"] or "not a native target: torch.distributed paths"
            lines.append(
                f"GPU {g['index']}        {g['name']}, sm_{g['capability'].replace('.', '')}, {g['sms']} SMs, "
                f"{g['memory_gib']} GiB ({native})"
            )
        lines.append(f"driver       {r.get('driver')}")
    else:
        lines.append("GPU          none visible: kernels run only under TRITON_INTERPRET=1, comms over gloo")
    nv = r["nvcc"]
    lines.append(
        f"nvcc         {nv['version']} at {nv['path']}" if nv["path"] else "nvcc         not found (JIT off)"
    )
    lines.extend(_render_nvshmem(r["nvshmem"]))
    lines.append(f"megatron     {r['megatron_core'] or 'not installed'}")
    lines.append("layers       " + (", ".join(f"{k} {v}" for k, v in r["layers"].items() if v) or "none"))
    missing = [k for k, v in r["layers"].items() if not v and k != "lck"]
    if missing:
        lines.append(f"not installed {', '.join(missing)}")
    for i, (who, c) in enumerate(r["jit_cache"].items()):
        lines.append(("JIT cache    " if i == 0 else "             ") + f"{who}: {_render_cache(c)}")
    return "\n".join(lines)


def _render_cache(c: dict[str, Any]) -> str:
    if not c["exists"]:
        return f"{c['path']} (not created yet: the first kernel build creates it, private)"
    host = "host module built" if c["host_module"] else "host module not built yet"
    private = "private" if c["private"] else "NOT private: lck refuses a cache others can write to"
    return f"{c['path']}, {c['entries']} entries, {c['bytes'] / (1 << 20):.1f} MiB, {host}, {private}"


def _render_nvshmem(sh: dict[str, Any]) -> list[str]:
    if not sh.get("importable"):
        return [
            f"NVSHMEM      nvshmem4py {sh['nvshmem4py']}, libnvshmem {sh['library']}, "
            f"not importable ({sh.get('import_error')}): torch.distributed paths only"
        ]
    lib = (
        sh.get("libnvshmem_version")
        or f"{sh['library']} (host library not loadable: {sh.get('version_error')})"
    )
    lines = [f"NVSHMEM      nvshmem4py {sh.get('nvshmem4py_version', sh['nvshmem4py'])}, libnvshmem {lib}"]
    if "init_status" in sh:
        owner = "owned by lck" if sh.get("owned_by_lck") else "not owned by lck"
        state = f"{sh['init_status_name']} ({sh['init_status']})"
        if sh.get("owned_by_lck"):
            state += f", PE {sh['my_pe']} of {sh['n_pes']}"
        lines.append(f"             status {state}, {owner}")
    else:
        lines.append(f"             status unknown ({sh.get('init_status_error')})")
    if sh.get("env"):
        lines.append("             env " + ", ".join(f"{k}={v}" for k, v in sh["env"].items()))
    return lines


def main(argv: list[str]) -> int:
    """Report GPUs, toolchain, NVSHMEM, installed layers and the JIT cache."""
    parser = argparse.ArgumentParser(prog="lck doctor", description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else _render(report))
    return 0
