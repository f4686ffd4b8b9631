"""``lck bench ep --pes N --virtual-hosts H``: the hybrid (scale-out) kernels beside the scale-up ones.

Two runs of N NVSHMEM PEs sharing the visible GPUs (under CUDA MPS, which the caller starts): first the
native scale-up backend on one host (:mod:`lck_ep.benchmark_native`'s rows, without the reference), then
the same group configured as ``H`` virtual hosts of ``N / H`` PEs, where every Buffer runs the hybrid pair:
the unordered pair with ``EP_NUM_SUB_PARTS`` 1, 2 and 4, and the ordered pair. Rows carry GPU, host and
loop time and the bytes a PE sends to other PEs, as the scale-up rows do, merged by
:func:`lck_ep.benchmark_native.merge`; results go to ``<gpu>-pes<N>-vh<H>-<date>-ep-hybrid.{json,csv,png}``.
Between virtual hosts of one GPU the puts are peer stores at HBM speed, so these rows measure the
protocol's own cost (staging, headers, forwarding, relaying) against the direct scale-up path, not a
network.
"""

from __future__ import annotations

import os
from typing import Any

SHAPES = [  # (name, tokens per rank, hidden, top-k, experts)
    ("dsv3", 1024, 7168, 8, 256),
    ("dsv3", 128, 7168, 8, 256),
]
# (provider suffix, environment): each a fresh hybrid state on the same context
SETTINGS = (
    ("unordered_sub1", {"EP_NUM_SUB_PARTS": "1"}),
    ("unordered_sub2", {}),
    ("unordered_sub4", {"EP_NUM_SUB_PARTS": "4"}),
    ("ordered", {"EP_HYBRID_KERNEL": "ordered"}),
)
_VARIABLES = ("EP_HYBRID_KERNEL", "EP_NUM_SUB_PARTS", "EP_MIN_SUB_TOKENS")


def bench_rank(rank: int, world: int, hosts: int, iters: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer, _hybrid_exchange
    from lck_ep.benchmark_native import record_row, time_row
    from lck_runtime.contexts import moe_context

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    cap = max(s[1] for s in SHAPES)
    _, _, hmax, kmax, experts = SHAPES[0]
    cfg = L.MoEConfig(
        max_tokens=cap,
        hidden_size=hmax,
        num_experts=experts,
        top_k=kmax,
        num_hosts=hosts,
        gpus_per_host=world // hosts,
    )
    if not L.configure(moe=cfg):
        raise RuntimeError("the native runtime did not come up (NVSHMEM unavailable)")
    group = dist.group.WORLD
    rows: list[dict[str, Any]] = []

    def attempt(bench: str, provider: str, label: str, fn: Any, nbytes: float, align: Any) -> None:
        record_row(rows, bench, provider, label, nbytes, lambda rec: time_row(rec, fn, iters, align))

    for suffix, env in SETTINGS:
        torch.cuda.synchronize()
        dist.barrier()
        for key in _VARIABLES:
            os.environ.pop(key, None)
        os.environ.update(env)
        _hybrid_exchange._STATES.clear()  # the next Buffer builds the state of this setting
        ctx = moe_context(None)
        ctx.signals.view(ctx.size, -1)[:, 3:].zero_()  # hybrid words: fresh for another pair
        torch.cuda.synchronize()
        dist.barrier()
        meet = Buffer(group, 1, 8, 1, experts, sync_free=True, device=dev)
        no_x = torch.empty(0, 8, dtype=torch.bfloat16, device=dev)
        no_idx = torch.empty(0, 1, dtype=torch.int64, device=dev)

        def align(meet: Any = meet, no_x: Any = no_x, no_idx: Any = no_idx) -> None:
            meet.dispatch(no_x, no_idx, num_worst_tokens=1)

        for shape in SHAPES:
            _bench_shape(shape, f"lck_hybrid_{suffix}", rank, world, hosts, dev, attempt, align)
            torch.cuda.empty_cache()
        meet.check_errors()
    for key in _VARIABLES:
        os.environ.pop(key, None)
    L.finalize()
    return rows


def _bench_shape(
    shape: tuple[str, int, int, int, int],
    provider: str,
    rank: int,
    world: int,
    hosts: int,
    dev: Any,
    attempt: Any,
    align: Any,
) -> None:
    """Dispatch and combine, synced and sync-free, on one shape (collective: every PE runs the same)."""
    from lck_ep.benchmark_native import dispatch_shape

    name, tokens, hidden, k, e = shape
    label = f"{name} T{tokens} H{hidden} K{k} E{e} {hosts}x{world // hosts} PEs"
    _, x, idx, w, synced, d, free, df, sent = dispatch_shape(shape, rank, dev)
    attempt("dispatch", provider, label, lambda: synced.dispatch(x, idx, w), sent, align)
    attempt("dispatch", provider + "_sync_free", label, lambda: free.dispatch(x, idx, w), sent, align)
    attempt("combine", provider, label, lambda: synced.combine(d.recv_x, d.handle), sent, align)
    attempt(
        "combine", provider + "_sync_free", label, lambda: free.combine(df.recv_x, df.handle), sent, align
    )


def main_hybrid(args: Any) -> int:
    """The scale-up rows (one host), then the hybrid rows (``args.virtual_hosts`` hosts), one results file."""
    import datetime as _dt
    import sys
    import time

    import torch

    from lck_ep import benchmark_native
    from lck_runtime.benchmarking import bar_plot, gpu_slug, write_results
    from lck_runtime.testing import run_workers

    hosts = args.virtual_hosts
    pes = args.pes if args.pes is not None else 2 * hosts
    if not torch.cuda.is_available() or hosts < 2 or pes % hosts or not 2 <= pes <= 64:
        print(
            "lck bench ep --virtual-hosts H [--pes N]: needs a CUDA GPU, H >= 2 dividing N (default 2 H)",
            file=sys.stderr,
        )
        return 2
    env = benchmark_native.pes_env(pes)
    iters = args.iters or (10 if args.quick else 20)
    t0 = time.monotonic()
    scale_up = run_workers(
        benchmark_native.bench_rank, pes, iters, False, backend="gloo", timeout=3000, env=env
    )
    hybrid = run_workers(bench_rank, pes, hosts, iters, backend="gloo", timeout=3000, env=env)
    records = benchmark_native.merge(scale_up, pes) + benchmark_native.merge(hybrid, pes)
    slug = gpu_slug()
    stem = f"{slug}-pes{pes}-vh{hosts}-{_dt.date.today().isoformat()}-ep-hybrid"
    paths = write_results(
        records,
        args.out,
        stem,
        meta={
            "pes": pes,
            "virtual_hosts": hosts,
            "gpus": torch.cuda.device_count(),
            "iters": iters,
            "shapes": SHAPES,
            "scale_up_shapes": benchmark_native.SHAPES,
            "settings": SETTINGS,
            "seconds": round(time.monotonic() - t0, 1),
            "env": {k: v for k, v in env.items() if k.startswith(("EP_", "NVSHMEM_", "CUDA_"))},
        },
        plot=lambda recs, path: bar_plot(
            [r for r in recs if r.error is None and r.bench in ("dispatch", "combine")],
            path,
            title=f"lck-ep hybrid ({hosts} virtual hosts) beside scale-up, {pes} PEs on {slug}",
        ),
    )
    benchmark_native.print_records(records, 36, 44, of_copy=False)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0 if not any(r.error for r in records) else 1
