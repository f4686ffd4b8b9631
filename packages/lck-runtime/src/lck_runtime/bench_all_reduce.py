"""Time ``FlsceContext.all_reduce_`` (the one-shot NVLink path and NVSHMEM's team reduction) against NCCL
``all_reduce`` on the same GPUs.

    python -m lck_runtime.bench_all_reduce --out DIR [--gpus 2] [--sizes 1024,65536,...] [--iters 30]

Spawns one NCCL process per GPU, configures the runtime with an FLSCE section large enough for the
largest size, and times every provider with fixed iteration counts, CUDA events, a barrier and a device-side
meeting point before every call (``benchmarking.time_cuda``). Each record is the slowest rank's median. Writes
``all_reduce-<gpu>-<date>.{json,csv,png}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from typing import Any

DEFAULT_SIZES = (1024, 65536, 131072, 262144, 1 << 20, 8 << 20, 32 << 20)  # fp32; 32 Mi = 128 MiB


def _worker(rank: int, world: int, sizes: list[int], iters: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime.benchmarking import device_barrier, summarize, time_cuda

    hidden = 1024
    native = L.configure(flsce=L.FusedLinearCrossEntropyConfig(-(-max(sizes) // hidden), hidden, 1))
    ctx = L.flsce_context()
    align = device_barrier()  # the ranks' events start together: no rank times a late peer's host skew
    rows = []
    try:
        for n in sizes:
            src = torch.randn(n, device="cuda")
            t = torch.empty_like(src)
            # default arguments bind this iteration's tensors
            calls = [("nccl", lambda t=t: dist.all_reduce(t))]
            if native:
                calls[:0] = [
                    ("lck-p2p", lambda t=t: ctx.all_reduce_(t, "sum", algorithm="p2p")),
                    ("lck-nvshmem", lambda t=t: ctx.all_reduce_(t, "sum", algorithm="nvshmem")),
                ]
            else:
                calls[:0] = [("lck-torch.distributed", lambda t=t: ctx.all_reduce_(t, "sum"))]
            for provider, fn in calls:
                times = time_cuda(
                    fn,
                    warmup=5,
                    iters=iters,
                    setup=lambda t=t, src=src: t.copy_(src),
                    barrier=dist.barrier,
                    align=align,
                )
                rows.append({"provider": provider, "numel": n, **summarize(times)})
            # one checked call per lck path: it agrees with NCCL
            b = src.clone()
            dist.all_reduce(b)
            for algorithm in ("p2p", "nvshmem") if native else ("auto",):
                a = src.clone()
                ctx.all_reduce_(a, "sum", algorithm=algorithm)
                torch.cuda.synchronize()
                rows.append({"check": n, "algorithm": algorithm, "max_abs_diff": float((a - b).abs().max())})
    finally:
        L.finalize()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Benchmark the runtime's all_reduce_ against NCCL."""
    p = argparse.ArgumentParser(prog="python -m lck_runtime.bench_all_reduce", description=main.__doc__)
    p.add_argument("--out", required=True, help="directory for the JSON/CSV/PNG results")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument(
        "--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated fp32 element counts"
    )
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        p.error(f"--sizes needs positive element counts, got {args.sizes!r}")
    if args.gpus < 2 or args.iters < 1:
        p.error("--gpus must be >= 2 and --iters >= 1")

    import torch

    from lck_runtime.benchmarking import Record, bar_plot, gpu_slug, write_results
    from lck_runtime.testing import run_workers

    if torch.cuda.device_count() < args.gpus:
        print(f"need {args.gpus} CUDA devices, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    env = {
        "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
        "NVSHMEM_REMOTE_TRANSPORT": "none",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    per_rank = run_workers(_worker, args.gpus, sizes, args.iters, backend="nccl", timeout=1800, env=env)
    records, checks = [], []
    for i, row in enumerate(per_rank[0]):
        if "check" in row:
            worst = max(r[i]["max_abs_diff"] for r in per_rank)
            checks.append(
                {"numel": row["check"], "algorithm": row["algorithm"], "max_abs_diff_vs_nccl": worst}
            )
            print(f"numel {row['check']}: lck ({row['algorithm']}) vs NCCL max abs diff {worst:.3g}")
            continue
        slowest = max(per_rank, key=lambda r: r[i]["median_ms"])[i]
        mib = row["numel"] * 4 / 2**20
        records.append(
            Record(
                bench="all_reduce",
                provider=row["provider"],
                mode="sum",
                shape=f"{row['numel']} ({mib:.3g} MiB)",
                dtype="float32",
                median_ms=slowest["median_ms"],
                p20_ms=slowest["p20_ms"],
                p80_ms=slowest["p80_ms"],
                extra={
                    "gpus": args.gpus,
                    "bus_GBps": 2 * (args.gpus - 1) / args.gpus * mib * 2**20 / slowest["median_ms"] / 1e6,
                },
            )
        )
        print(f"{row['provider']:>22} {records[-1].shape:>22}: {slowest['median_ms']:.4f} ms")
    stem = f"all_reduce-{gpu_slug()}-{_dt.date.today().isoformat()}"
    paths = write_results(
        records,
        args.out,
        stem,
        meta={"gpus": args.gpus, "iters": args.iters, "checks": checks},
        plot=lambda recs, path: bar_plot(recs, path, title=f"all_reduce_ vs NCCL, {args.gpus} GPUs"),
    )
    print("wrote " + ", ".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
