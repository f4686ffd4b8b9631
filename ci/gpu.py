"""GPU runner entry: run one layer's GPU tests (and optionally its benchmark) with the system python.

GPU runners are offline machines with a preinstalled torch/triton/CUDA. Nothing is installed from
the network: extra wheels (nvshmem4py, megatron-core, Liger-Kernel as a benchmark peer) come from a
local wheelhouse, unpacked into a private site directory that goes on ``PYTHONPATH`` together with
the packages' ``src`` folders.

    python3 ci/gpu.py --package kernels --runner h200 [--bench] [--out DIR] [-- pytest args]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "kernels", "ep", "megatron")
# NVLink multicast can take a shared host's GPUs out of service: it stays off on our runners.
SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
RUNNERS = {
    "h200": {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "NVSHMEM_REMOTE_TRANSPORT": "none"},
    "b300": {},
}
BENCH = {"kernels": "lck_kernels.bench", "ep": "lck_ep.benchmark", "megatron": "lck_megatron.benchmark"}


def install_wheelhouse(wheelhouse: Path, site: Path) -> None:
    wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
    if not wheels:
        return
    site.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--upgrade",
        "--target",
        str(site),
        *wheels,
    ]
    subprocess.run(cmd, check=True)


def environment(runner: str, site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SAFE_ENV)
    for k, v in RUNNERS[runner].items():
        env.setdefault(k, v)
    paths = [str(ROOT / "packages" / f"lck-{p}" / "src") for p in PACKAGES]
    if site is not None:
        paths.append(str(site))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("TRITON_INTERPRET", None)
    return env


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--package", choices=PACKAGES, required=True)
    parser.add_argument("--runner", choices=sorted(RUNNERS), default="h200")
    parser.add_argument("--wheelhouse", type=Path, default=ROOT / ".device-wheels")
    parser.add_argument("--site", type=Path, default=Path("/tmp/lck-site"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out")))
    parser.add_argument("--bench", action="store_true", help="also run the layer's benchmark")
    parser.add_argument("--no-tests", action="store_true", help="skip the tests (benchmark only)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)

    site = None
    if args.wheelhouse.is_dir():
        install_wheelhouse(args.wheelhouse, args.site)
        site = args.site
    env = environment(args.runner, site)
    args.out.mkdir(parents=True, exist_ok=True)
    rc = 0
    if not args.no_tests:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "packages" / f"lck-{args.package}" / "tests"),
            "-m",
            "gpu",
            "-ra",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={args.out / f'junit-{args.package}-{args.runner}.xml'}",
        ]
        if args.keyword:
            cmd += ["-k", args.keyword]
        cmd += args.pytest_args
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    if args.bench and args.package in BENCH:
        cmd = [sys.executable, "-m", BENCH[args.package], "--out", str(args.out)]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode or rc
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
