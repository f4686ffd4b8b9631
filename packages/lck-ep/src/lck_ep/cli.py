"""``lck ep``: lck-ep's commands. ``lck ep warmup --arch sm_90a[,sm_100a]`` pre-builds every kernel the
native backend launches into the JIT cache (``EP_JIT_CACHE_DIR``), with nvcc and no GPU, so that a cluster
job compiles once on one node instead of on every rank at its first call.

The kernels are built under the ``EP_*`` knobs of the environment, as a run with the same environment
would look them up; each entry is printed with what it does, its architecture and its cache path.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["KERNEL_ROLES", "main", "warmup"]

# What each cache entry is, for the listing (kernel name -> role).
KERNEL_ROLES = {
    "ep_layout": "layout (tokens per rank and expert, token-to-rank mask)",
    "ep_send_slots": "dispatch, send slots (each token's row in its destinations' regions)",
    "ep_dispatch_send": "dispatch, sender (rows into the destinations' workspaces)",
    "ep_dispatch_recv": "dispatch, receiver (waits for the sources; routing laid out, counts per expert)",
    "ep_combine_send": "combine, sender (partial rows back to their sources)",
    "ep_combine_recv": "combine, receiver (float32 sum in rank order, bias, rounding)",
    "ep_combine_zero_copy": "combine, zero-copy input (waits until every rank finished reading the workspace)",
    "ep_expand_maps": "dispatch, expanded maps (expert-major rank of every routed slot)",
    "ep_dispatch_rows": "dispatch, rows out of the workspace (compact or expert-major), then release",
    "ep_reduce_expanded": "combine, expanded rows reduced per received row (weighted, float32)",
    "ep_combine_send_expanded": "combine of expanded rows, sender (each received row reduced into its source's region)",
    "ep_agree": "synced call, argument agreement (every rank's vector through the workspaces' mailboxes)",
}


def role(name: str) -> str:
    """What a cache entry is: a native kernel's role, or the hybrid pair's (``ep_hybrid_<role>_<pair>``)."""
    if name in KERNEL_ROLES:
        return KERNEL_ROLES[name]
    from lck_ep.hybrid_codegen import HYBRID_ROLES

    return f"{HYBRID_ROLES[name.split('_')[2]]}, {name.split('_')[3]} pair"


def warmup(archs: list[str]) -> list[tuple[str, str, str, float]]:
    """Compile every native-backend kernel and the hybrid pair ``EP_HYBRID_KERNEL`` selects for each arch;
    ``[(kernel, arch, cubin path, seconds)]``.

    Knobs are validated before nvcc runs (a bad ``EP_*`` value raises ``KnobError``)."""
    from lck_ep.codegen import NATIVE_KERNELS
    from lck_ep.hybrid import compile_hybrid_kernels
    from lck_ep.jit import compile_layout_kernel
    from lck_ep.knobs import read_knobs
    from lck_ep.native import compile_native_kernels

    knobs = read_knobs()
    out = []
    for arch in archs:
        t0 = time.perf_counter()
        out.append(
            ("ep_layout", arch, str(compile_layout_kernel(arch, knobs=knobs)), time.perf_counter() - t0)
        )
        for name in NATIVE_KERNELS:
            t0 = time.perf_counter()
            path = compile_native_kernels(arch, knobs, only=(name,))[name]
            out.append((name, arch, path, time.perf_counter() - t0))
        t0 = time.perf_counter()
        for name, path in compile_hybrid_kernels(arch, knobs).items():  # the pair EP_HYBRID_KERNEL selects
            out.append((name, arch, path, time.perf_counter() - t0))
            t0 = time.perf_counter()
    return out


def main(argv: list[str] | None = None) -> int:
    """Expert-parallel tools: lck ep warmup --arch sm_90a[,sm_100a]."""
    from lck_runtime.jit import SUPPORTED_ARCHS

    parser = argparse.ArgumentParser(prog="lck ep", description="lck-ep tools")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warmup", help="pre-build the EP kernels into the JIT cache (nvcc, no GPU needed)")
    w.add_argument(
        "--arch",
        required=True,
        help=f"comma-separated targets among {', '.join(SUPPORTED_ARCHS)} (e.g. sm_90a,sm_100a)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in SUPPORTED_ARCHS]
    if not archs or bad:
        print(
            f"lck ep warmup: --arch {args.arch!r}: expected a comma-separated list of {', '.join(SUPPORTED_ARCHS)}",
            file=sys.stderr,
        )
        return 2
    from lck_runtime.toolchain import find_nvcc

    if find_nvcc() is None:
        print("lck ep warmup: nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    for name, arch, path, secs in warmup(archs):
        print(f"{name:<20} {arch:<8} {secs:5.1f} s  {role(name)}\n{'':<20} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
