"""Sync-free mode on GPUs: no host synchronisation, and CUDA-graph capture replayed with new routings.

The CPU suite (test_reference.py) already checks that sync-free results equal the synced ones in the
valid rows; here the properties only a GPU can show: ``torch.cuda.set_sync_debug_mode("error")``
raises on any device-to-host synchronisation inside dispatch/combine, and a captured graph replays
dispatch → expert → combine correctly for routings it was not captured with.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from _routing import route

from lck_runtime.testing import run_workers

T_MAX, H, K, LOCAL, ALIGN = 64, 136, 4, 4, 8


def _inputs(world: int, rank: int, seed: int, kind: str = "balanced"):
    g = torch.Generator().manual_seed(seed)
    out = None
    for s in range(world):
        t = T_MAX if s == 0 else int(torch.randint(0, T_MAX + 1, (1,), generator=g))
        x = torch.randn(t, H, generator=g).to(torch.bfloat16)
        idx = route(kind, t, K, LOCAL * world, world, g)
        w = torch.rand(t, K, generator=g)
        if s == rank:
            out = (x, idx, w)
    assert out is not None
    return out


def _expert(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Expert j scales its segment by (1 + j/4); computed from device offsets only (no host reads)."""
    m = torch.arange(rows.shape[0], device=rows.device)
    j = torch.searchsorted(offsets[1:].contiguous(), m, right=True).clamp(max=offsets.numel() - 2)
    return (rows.float() * (1.0 + 0.25 * j.float()).unsqueeze(1)).to(rows.dtype)


def _round_trip(buf, x, idx, w, bias):
    d = buf.dispatch(x, idx, w, expand=True, expert_alignment=ALIGN)
    y = _expert(d.recv_x, d.handle.expert_offsets)
    c, _ = buf.combine(y, d.handle, topk_weights=d.recv_topk_weights, bias=bias)
    p = buf.dispatch(x, idx, w)
    c2, _ = buf.combine(p.recv_x, p.handle, bias=bias)
    r = buf.dispatch(x, handle=p.handle)
    return c, c2, r.recv_x


def _worker(rank: int, world: int, seed: int) -> list[str]:
    import torch.distributed as dist

    from lck_ep import Buffer
    from lck_runtime.toolchain import find_nvcc

    errors: list[str] = []
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        layout = "kernel" if find_nvcc() else "torch"
        free = Buffer(dist.group.WORLD, T_MAX, H, K, LOCAL * world, sync_free=True, layout=layout)
        synced = Buffer(dist.group.WORLD, T_MAX, H, K, LOCAL * world, layout=layout)
        x, idx, w = (t.to(dev) for t in _inputs(world, rank, seed))
        bias = (
            torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(seed + rank))
            .to(torch.bfloat16)
            .to(dev)
        )
        want = _round_trip(synced, x, idx, w, bias)
        _round_trip(free, x, idx, w, bias)  # warm-up: JIT load, NCCL communicators
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = _round_trip(free, x, idx, w, bias)
        except RuntimeError as exc:
            errors.append(f"rank {rank}: a host synchronisation happened in sync-free mode: {exc}")
            got = None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if got is not None:
            torch.cuda.synchronize()
            n = want[2].shape[0]
            for name, a, b in (("expanded combine", got[0], want[0]), ("combine", got[1], want[1])):
                if not torch.equal(a, b):
                    errors.append(
                        f"rank {rank}: sync-free {name} differs from synced in {int((a != b).sum())} elements"
                    )
            if not torch.equal(got[2][:n], want[2]):
                errors.append(f"rank {rank}: sync-free replay differs from synced replay")

        # CUDA graph: capture once, replay with routings the capture never saw.
        sx, sidx, sw = x.clone(), idx.clone(), w.clone()
        sbias = bias.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _round_trip(free, sx, sidx, sw, sbias)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _round_trip(free, sx, sidx, sw, sbias)
        for trial, kind in enumerate(("skewed", "minus_one", "balanced")):
            # Same token count (static shapes), new values and a new routing every replay.
            nx, nidx, nw = _inputs(world, rank, seed + 101 * (trial + 1), kind)
            t = sx.shape[0]
            nx, nidx, nw = nx[:t], nidx[:t], nw[:t]
            if nx.shape[0] < t:  # pad with tokens that go nowhere
                pad = t - nx.shape[0]
                nx = torch.cat([nx, torch.randn(pad, H).to(torch.bfloat16)])
                nidx = torch.cat([nidx, torch.full((pad, K), -1, dtype=torch.int64)])
                nw = torch.cat([nw, torch.rand(pad, K)])
            sx.copy_(nx)
            sidx.copy_(nidx)
            sw.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            ref = _round_trip(synced, sx.clone(), sidx.clone(), sw.clone(), sbias)
            for name, a, b in (("expanded combine", out[0], ref[0]), ("combine", out[1], ref[1])):
                if not torch.equal(a, b):
                    errors.append(
                        f"rank {rank}: graph replay {trial} ({kind}): {name} differs from eager synced in "
                        f"{int((a != b).sum())} elements"
                    )
    except Exception:
        errors.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    return errors


def _check(world: int) -> None:
    import random

    seed = random.randrange(1, 2**30)
    results: list[Any] = run_workers(_worker, world, seed, backend="nccl", timeout=600)
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, f"seed {seed}:\n" + "\n".join(errors)


@pytest.mark.gpu
def test_sync_free_one_gpu_no_host_sync_and_graph_replay() -> None:
    _check(1)


@pytest.mark.multigpu(2)
def test_sync_free_two_gpus_no_host_sync_and_graph_replay() -> None:
    _check(2)
