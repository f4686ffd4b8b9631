"""The FLSCE context's all-reduce inside a CUDA graph, on two GPUs with the NVSHMEM path configured.

Two calls with ``algorithm="auto"`` (a sum and a max, low-latency and standard sizes) are captured into
one graph: inside capture they must take NCCL, not the one-shot path (host epoch counters) nor NVSHMEM's
reduction (a scratch ordered across streams by host events; a live graph holding it blocks finalize), and
forcing ``"nvshmem"`` there raises. The graph is replayed on fresh data against
float64 references, with eager one-shot calls on another stream between the replays, and ``finalize()``
runs while the graph is still alive.
"""

from __future__ import annotations

from typing import Any

import pytest
from _observed import per_rank

from lck_runtime.testing import SINGLE_HOST_NVSHMEM_ENV, error_text, run_workers


def _rand(rank: int, case: int, numel: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 + 7919 * case + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float32) * 4.0).cuda()


def _reference(case: int, numel: int, world: int, op: str) -> Any:
    import torch

    parts = torch.stack([_rand(r, case, numel).double() for r in range(world)])
    return parts.sum(0) if op == "sum" else parts.amax(0)


def _two_gpus(rank: int, world: int) -> dict[str, Any]:
    import torch

    import lck_runtime as L
    from lck_runtime import collectives

    out: dict[str, Any] = {}
    out["native"] = L.configure(flsce=L.FusedLinearCrossEntropyConfig(4096, 8, 16))
    ctx = L.flsce_context()
    out["p2p"] = ctx.p2p
    sizes = {"sum": 5000, "max": 30000}  # the low-latency and the standard one-shot kernels when eager
    seeds = {"sum": 1, "max": 2}
    bufs = {op: _rand(rank, 0, n) for op, n in sizes.items()}

    def step() -> None:
        for op, t in bufs.items():
            ctx.all_reduce_(t, op)

    nvshmem_calls: list[int] = []
    real = collectives._nvshmem_all_reduce

    def counted(*args: Any) -> None:
        nvshmem_calls.append(1)
        real(*args)

    collectives._nvshmem_all_reduce = counted
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (eager: the one-shot path)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    out["nvshmem reductions captured"] = len(nvshmem_calls)
    collectives._nvshmem_all_reduce = real
    # Forcing NVSHMEM's reduction inside capture is refused before anything is captured.
    refused = torch.cuda.CUDAGraph()
    with torch.cuda.graph(refused, capture_error_mode="thread_local"):
        out["forced nvshmem"] = error_text(ctx.all_reduce_, bufs["sum"], "sum", algorithm="nvshmem")
    del refused

    worst = 0.0
    for case in range(1, 4):
        for op, t in bufs.items():
            t.copy_(_rand(rank, 10 * case + seeds[op], t.numel()))
        graph.replay()
        # an eager one-shot call on another stream between replays
        eager = _rand(rank, 10 * case + 7, 3000)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ctx.all_reduce_(eager, "sum")
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for op, t in bufs.items():
            ref = _reference(10 * case + seeds[op], t.numel(), world, op)
            worst = max(worst, float((t.double() - ref).abs().max()))
        worst = max(
            worst, float((eager.double() - _reference(10 * case + 7, 3000, world, "sum")).abs().max())
        )
    out["worst"] = worst
    ctx.check_collectives()
    L.finalize()  # with the graph alive
    out["finalized"] = True
    del graph
    return out


@pytest.mark.multigpu(2)
def test_all_reduce_in_a_cuda_graph_takes_nccl_and_replays() -> None:
    outs = run_workers(_two_gpus, 2, backend="nccl", timeout=120, env=SINGLE_HOST_NVSHMEM_ENV)
    for o, where in per_rank(outs):
        assert o["native"] is True and o["p2p"] is True, where
        assert o["nvshmem reductions captured"] == 0, where
        assert o["forced nvshmem"].startswith(
            "ValueError: all_reduce_: algorithm 'nvshmem' cannot be captured"
        ), where
        assert o["worst"] <= 1e-5, where  # two fp32 addends: at most one rounding
        assert o["finalized"] is True, where
