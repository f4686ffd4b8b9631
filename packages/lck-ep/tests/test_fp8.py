"""FP8 dispatch: ``(x_fp8, x_scales)`` rows travel as one byte row and come back as the same pair, with the
routing of a bf16 dispatch; checked on 2 gloo ranks (reference backend) against every rank's inputs."""

from __future__ import annotations

from typing import Any

import torch
from _routing import route

from lck_runtime.testing import error_text, run_workers

T, H, K, LOCAL = 10, 256, 3, 2


def _inputs(world: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(world):
        t = T - s
        x8 = (torch.randn(t, H, generator=g) * 4).to(torch.float8_e4m3fn)
        scales = torch.rand(t, H // 128, generator=g) + 0.5
        out.append((x8, scales, route("minus_one", t, K, LOCAL * world, world, g)))
    return out


def test_pack_round_trip() -> None:
    from lck_ep.fp8 import pack, unpack

    x8 = torch.randn(5, 384).to(torch.float8_e4m3fn)
    s = torch.rand(5, 3)
    rows = pack(x8, s)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 384 + 12)
    b8, bs = unpack(rows, 384)
    assert torch.equal(b8.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(bs, s)


def _expect(ins: list[Any], rows: int, src_rank: list[int], src_idx: list[int]) -> tuple[torch.Tensor, ...]:
    """The fp8 bytes and scales of each received row, from every rank's inputs (zero on padding)."""
    e8 = torch.zeros(rows, H, dtype=torch.uint8)
    es = torch.zeros(rows, H // 128)
    for n, (r, t) in enumerate(zip(src_rank, src_idx)):
        if r >= 0:
            e8[n] = ins[r][0][t].view(torch.uint8)
            es[n] = ins[r][1][t]
    return e8, es


def _worker(rank: int, world: int, seed: int) -> list[str]:
    import torch.distributed as dist

    from lck_ep import Buffer

    ins = _inputs(world, seed)
    x8, s, idx = ins[rank]
    errors: list[str] = []
    for sync_free in (False, True):
        buf = Buffer(dist.group.WORLD, T, H, K, LOCAL * world, sync_free=sync_free)
        carrier = torch.randn(x8.shape[0], H).to(torch.bfloat16)
        ref = buf.dispatch(carrier, idx)  # the routing a bf16 dispatch gives: which (rank, token) lands where
        src_rank, src_idx = ref.handle.recv_src_rank.tolist(), ref.handle.recv_src_idx.tolist()

        d = buf.dispatch((x8, s), idx)
        got8, gots = d.recv_x
        e8, es = _expect(ins, got8.shape[0], src_rank, src_idx)
        mode = "sync-free" if sync_free else "synced"
        if got8.dtype != torch.float8_e4m3fn or not torch.equal(got8.view(torch.uint8), e8):
            errors.append(f"rank {rank} {mode}: fp8 rows differ")
        if not torch.equal(gots, es):
            errors.append(f"rank {rank} {mode}: scales differ")
        if not torch.equal(d.recv_topk_idx, ref.recv_topk_idx):
            errors.append(f"rank {rank} {mode}: routing differs from the bf16 dispatch")
        r8, rs = buf.dispatch((x8, s), handle=d.handle).recv_x
        if not (torch.equal(r8.view(torch.uint8), e8) and torch.equal(rs, es)):
            errors.append(f"rank {rank} {mode}: replay differs")
        ex = buf.dispatch((x8, s), idx, expand=True, expert_alignment=4)
        eb = buf.dispatch(carrier, idx, expand=True, expert_alignment=4)
        src_row = eb.handle.expanded_src_row.clamp(min=0)
        keep = (eb.handle.expanded_src_row >= 0).unsqueeze(1)
        want8 = torch.where(keep, e8.index_select(0, src_row), 0)
        if not torch.equal(ex.recv_x[0].view(torch.uint8), want8):
            errors.append(f"rank {rank} {mode}: expanded fp8 rows differ")
    buf = Buffer(dist.group.WORLD, T, 200, K, LOCAL * world)
    errors += [f"hidden: {error_text(buf.dispatch, (x8[:, :200], s), idx)}"]
    buf = Buffer(dist.group.WORLD, T, H, K, LOCAL * world)
    errors += [f"scales: {error_text(buf.dispatch, (x8, s[:, :1]), idx)}"]
    errors += [f"pair: {error_text(buf.dispatch, (x8, s, s), idx)}"]
    errors += [f"values: {error_text(buf.dispatch, (x8.float(), s), idx)}"]
    return errors


def test_fp8_dispatch_on_two_ranks() -> None:
    import random

    seed = random.randrange(1, 2**30)
    outs: list[Any] = run_workers(_worker, 2, seed, timeout=180)
    for errors in outs:
        checks = [e for e in errors if e.split(":")[0] in ("hidden", "scales", "pair", "values")]
        real = [e for e in errors if e not in checks]
        assert not real, f"seed {seed}: {real}"
        assert "hidden must be a multiple of 128" in checks[0] and "200" in checks[0], checks[0]
        assert (
            "x_scales must have shape [10, 2]" in checks[1] or "x_scales must have shape [9, 2]" in checks[1]
        ), checks[1]
        assert (
            "x must be a torch.Tensor, got tuple (FP8 rows go as an (x_fp8, x_scales) pair)" in checks[2]
        ), checks[2]
        assert "x must be float8_e4m3fn, got float32" in checks[3], checks[3]
