"""``lck bench ep`` / ``python -m lck_ep.benchmark``: time EP dispatch/combine and the layout kernel.

On GPUs it starts one process per visible GPU (NCCL; at most ``--gpus``) and, for each shape,
times on every rank with fixed iteration counts, a device sync, a barrier and a device-side meeting
point before each timed call (never an adaptive repeat count, which would desynchronise collectives):

- ``layout``: the JIT layout kernel (``lck_kernel``) against the same layout in torch ops (``torch``);
- ``dispatch`` / ``combine``: lck's reference backend over NCCL, synced (``lck_reference``) and
  sync-free (``lck_reference_sync_free``), expanded layout included for ``dispatch_expanded``;
- ``a2a``: the peer floor, one NCCL ``all_to_all_single`` carrying every (token, slot) row without
  deduplication (``nccl_a2a``), the baseline the GPU kernels of later issues must beat.

Rank 0 writes ``<out>/<gpu>-x<W>-<date>-ep.{json,csv,png}`` with provenance; each record's ``extra``
holds the bytes a rank sends and the resulting GB/s, and the median over ranks of the per-rank medians
is reported (a collective finishes when its slowest rank does). ``--cpu`` runs the same code over gloo
on the CPU at small sizes (timed with ``time.perf_counter``), for a smoke test without a GPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # per rank
    hidden: int
    num_topk: int
    experts_per_rank: int

    def label(self, world: int) -> str:
        return f"{self.name} T{self.tokens} H{self.hidden} K{self.num_topk} E{self.experts_per_rank * world}"


GPU_SHAPES = [
    # DeepSeek-V3-like rows (H 7168, top-8) and the Qwen3-30B-A3B MoE shape of FACTS.md (H 2048, E 128)
    Shape("dsv3", 4096, 7168, 8, 128),
    Shape("dsv3", 512, 7168, 8, 128),
    Shape("qwen3", 8192, 2048, 8, 64),
]
QUICK_GPU_SHAPES = [Shape("dsv3", 512, 7168, 8, 128), Shape("qwen3", 4096, 2048, 8, 64)]
CPU_SHAPES = [Shape("tiny", 64, 256, 4, 4)]


def _timer(device_type: str, iters: int, warmup: int) -> Callable[..., list[float]]:
    import torch.distributed as dist

    from lck_runtime.benchmarking import device_barrier, time_cuda

    if device_type == "cuda":
        # The device-side meeting point keeps host-barrier skew out of the timed collective.
        align = device_barrier()
        return lambda fn: time_cuda(fn, warmup=warmup, iters=iters, barrier=dist.barrier, align=align)

    def cpu(fn: Callable[[], Any]) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    return cpu


def _route(tokens: int, num_topk: int, num_experts: int, device: Any, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    # Random distinct experts per token: what a trained router produces, roughly balanced.
    idx = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :num_topk].contiguous()
    return idx.to(device)


def _bench_rank(
    rank: int, world: int, shapes: list[dict[str, Any]], iters: int, warmup: int
) -> list[dict[str, Any]]:
    """Run on every rank; returns this rank's per-provider timings as plain dicts."""
    import torch
    import torch.distributed as dist

    from lck_runtime.benchmarking import summarize

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timed = _timer(device.type, iters, warmup)
    if not cuda:
        torch.set_num_threads(1)  # steadier CPU timings; the ranks share the machine's cores
    rows: list[dict[str, Any]] = []

    def record(
        bench: str,
        provider: str,
        shape: Shape,
        times: list[float] | None,
        sent_bytes: float | None,
        error: str | None = None,
    ) -> None:
        rows.append(
            {
                "bench": bench,
                "provider": provider,
                "shape": shape.label(world),
                "dtype": "bfloat16",
                "times": times,
                "bytes": sent_bytes,
                "error": error,
                "summary": summarize(times) if times else None,
            }
        )

    def attempt(
        bench: str, provider: str, shape: Shape, fn: Callable[[], Any], sent_bytes: float | None
    ) -> None:
        try:
            times = timed(fn)
        except Exception as exc:  # a provider that cannot run this case is a record, not a crash
            record(bench, provider, shape, None, sent_bytes, f"{type(exc).__name__}: {exc}"[:300])
            if cuda:
                torch.cuda.synchronize()
            return
        record(bench, provider, shape, times, sent_bytes)

    for sd in shapes:
        _bench_shape(Shape(**sd), rank, world, device, attempt)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _bench_shape(shape: Shape, rank: int, world: int, device: Any, attempt: Callable[..., None]) -> None:
    """Time every provider on one shape (collective: every rank runs the same sequence)."""
    import torch
    import torch.distributed as dist

    from lck_ep.buffer import Buffer, kernel_layout_available
    from lck_ep.layout import layout_reference

    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    num_experts = shape.experts_per_rank * world
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(shape.tokens, shape.hidden, generator=g).to(dtype).to(device)
    idx = _route(shape.tokens, shape.num_topk, num_experts, device, 1000 + rank)
    w = torch.rand(shape.tokens, shape.num_topk, generator=g).to(device)

    if cuda and kernel_layout_available():
        from lck_ep.layout import layout_kernel

        attempt("layout", "lck_kernel", shape, lambda: layout_kernel(idx, num_experts, world), None)
    attempt("layout", "torch", shape, lambda: layout_reference(idx, num_experts, world), None)

    synced = Buffer(dist.group.WORLD, shape.tokens, shape.hidden, shape.num_topk, num_experts)
    free = Buffer(dist.group.WORLD, shape.tokens, shape.hidden, shape.num_topk, num_experts, sync_free=True)
    d = synced.dispatch(x, idx, w)
    df = free.dispatch(x, idx, w)
    row_bytes = shape.hidden * x.element_size()
    # Bytes this rank sends to other ranks (rows to itself are a local copy).
    sent = float(sum(c for r, c in enumerate(d.handle.send_counts) if r != rank) * row_bytes)
    attempt("dispatch", "lck_reference", shape, lambda: synced.dispatch(x, idx, w), sent)
    attempt("dispatch", "lck_reference_sync_free", shape, lambda: free.dispatch(x, idx, w), sent)
    attempt("dispatch_cached", "lck_reference", shape, lambda: synced.dispatch(x, handle=d.handle), sent)
    attempt(
        "dispatch_expanded",
        "lck_reference_sync_free",
        shape,
        lambda: free.dispatch(x, idx, w, expand=True, expert_alignment=128),
        sent,
    )
    attempt("combine", "lck_reference", shape, lambda: synced.combine(d.recv_x, d.handle), sent)
    attempt("combine", "lck_reference_sync_free", shape, lambda: free.combine(df.recv_x, df.handle), sent)

    # The peer floor: every (token, slot) row through one all-to-all, no deduplication.
    n = shape.tokens * shape.num_topk // world * world
    src = torch.randn(n, shape.hidden, generator=g).to(dtype).to(device)
    dst = torch.empty_like(src)
    a2a_bytes = float(n - n // world) * row_bytes
    provider = "nccl_a2a" if cuda else "gloo_a2a"
    attempt("a2a", provider, shape, lambda: dist.all_to_all_single(dst, src), a2a_bytes)


def _merge(per_rank: list[list[dict[str, Any]]], world: int) -> list[Any]:
    """One Record per (bench, provider, shape): median over ranks of each rank's median."""
    from lck_runtime.benchmarking import Record

    records = []
    for i, first in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        errors = [r["error"] for r in rows if r["error"]]
        rec = Record(first["bench"], first["provider"], "fwd", first["shape"], first["dtype"])
        if errors or any(r["summary"] is None for r in rows):
            rec.error = errors[0] if errors else "no timings"
        else:
            for key in ("median_ms", "p20_ms", "p80_ms"):
                setattr(rec, key, statistics.median(r["summary"][key] for r in rows))
            rec.extra["per_rank_median_ms"] = [r["summary"]["median_ms"] for r in rows]
            rec.extra["world"] = world
            sent = [r["bytes"] for r in rows if r["bytes"] is not None]
            if sent:
                rec.extra["sent_mb_per_rank"] = statistics.median(sent) / 1e6
                rec.extra["gb_per_s"] = statistics.median(sent) / (rec.median_ms * 1e-3) / 1e9
        records.append(rec)
    return records


def _run_in_process(fn: Callable[..., Any], *args: Any) -> Any:
    """World 1 on the CPU without a child process (what the CPU smoke test uses)."""
    import torch

    threads = torch.get_num_threads()  # _bench_rank pins one thread on the CPU; give the caller its own back
    try:
        return _in_process(fn, *args)
    finally:
        torch.set_num_threads(threads)


def _in_process(fn: Callable[..., Any], *args: Any) -> Any:
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1 or dist.get_backend() != "gloo":
            raise RuntimeError("lck bench ep --cpu --gpus 1: this process already has a multi-rank group")
        return [fn(0, 1, *args)]
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            return [fn(0, 1, *args)]
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Time EP dispatch/combine (reference over NCCL, synced and sync-free), the layout kernel, and NCCL all-to-all."""
    import torch

    from lck_runtime.benchmarking import bar_plot, gpu_slug, write_results
    from lck_runtime.testing import run_workers

    parser = argparse.ArgumentParser(prog="lck bench ep", description=main.__doc__)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"result folder (default {DEFAULT_OUT})"
    )
    parser.add_argument("--quick", action="store_true", help="two shapes, fewer iterations")
    parser.add_argument(
        "--gpus", type=int, default=None, help="ranks (default: every visible GPU; 2 on --cpu)"
    )
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per provider")
    parser.add_argument(
        "--cpu", action="store_true", help="run over gloo on the CPU (smoke test, tiny shapes)"
    )
    parser.add_argument(
        "--pes",
        type=int,
        default=None,
        help="the native backend with this many NVSHMEM PEs sharing the visible GPUs (under CUDA MPS "
        "when there are fewer GPUs), beside the reference and a plain peer copy (lck_ep.benchmark_native)",
    )
    parser.add_argument(
        "--virtual-hosts",
        type=int,
        default=None,
        help="the native backend's PEs (--pes N, default twice this) also as this many virtual hosts: the hybrid "
        "(scale-out) kernels' rows beside the scale-up ones (lck_ep.benchmark_hybrid)",
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="with --pes: skip the gloo reference rows"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.virtual_hosts is not None:
        from lck_ep.benchmark_hybrid import main_hybrid

        return main_hybrid(args)
    if args.pes is not None:
        from lck_ep.benchmark_native import main_native

        return main_native(args)

    if args.cpu:
        world = args.gpus or 2
        shapes = CPU_SHAPES
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            print("lck bench ep: needs a CUDA GPU (or --cpu for a smoke run over gloo)", file=sys.stderr)
            return 2
        world = args.gpus or torch.cuda.device_count()
        if not 1 <= world <= torch.cuda.device_count():
            print(
                f"lck bench ep: --gpus must be in [1, {torch.cuda.device_count()}], got {world}",
                file=sys.stderr,
            )
            return 2
        shapes = QUICK_GPU_SHAPES if args.quick else GPU_SHAPES
        backend = "nccl"
    iters = args.iters or (5 if args.cpu else 10 if args.quick else 30)
    warmup = 2 if args.cpu else 5
    shape_dicts = [asdict(s) for s in shapes]
    t0 = time.monotonic()
    if args.cpu and world == 1:
        per_rank = _run_in_process(_bench_rank, shape_dicts, iters, warmup)
    else:
        per_rank = run_workers(
            _bench_rank,
            world,
            shape_dicts,
            iters,
            warmup,
            backend=backend,
            timeout=3000,
            env={"PYTHONUNBUFFERED": "1"} | ({"NCCL_NVLS_ENABLE": "0"} if backend == "nccl" else {}),
        )
    records = _merge(per_rank, world)
    slug = gpu_slug() if not args.cpu else "cpu"
    stem = f"{slug}-x{world}-{_dt.date.today().isoformat()}-ep" + ("-quick" if args.quick else "")
    paths = write_results(
        records,
        args.out,
        stem,
        meta={
            "world": world,
            "backend": backend,
            "iters": iters,
            "warmup": warmup,
            "shapes": shape_dicts,
            "seconds": round(time.monotonic() - t0, 1),
            "env": {k: v for k, v in os.environ.items() if k.startswith("EP_")},
        },
        plot=lambda recs, path: bar_plot(recs, path, title=f"lck-ep on {world} x {slug} ({backend})"),
    )
    _print_table(records)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0 if not any(r.error for r in records) else 1


def _print_table(records: list[Any]) -> None:
    print(f"{'bench':<18}{'provider':<26}{'shape':<30}{'ms':>9}{'GB/s':>8}")
    for r in records:
        ms = f"{r.median_ms:9.3f}" if r.median_ms is not None else f"{'err':>9}"
        gbps = r.extra.get("gb_per_s")
        print(
            f"{r.bench:<18}{r.provider:<26}{r.shape:<30}{ms}{(f'{gbps:8.1f}' if gbps else ''):>8}"
            + (f"  {r.error}" if r.error else "")
        )


if __name__ == "__main__":
    raise SystemExit(main())
