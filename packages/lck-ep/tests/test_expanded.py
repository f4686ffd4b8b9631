"""Expanded expert-major layout and its reduction, against explicit loops (single process)."""

from __future__ import annotations

import pytest
import torch

from lck_ep.expanded import (
    build_expanded,
    expanded_capacity,
    gather_expanded,
    most_expanded_rows,
    padded_offsets,
    reduce_expanded,
)


def _recv_idx(n: int, k: int, num_local: int, g: torch.Generator, p_local: float = 0.5) -> torch.Tensor:
    idx = torch.randint(0, num_local, (n, k), generator=g)
    idx[torch.rand(n, k, generator=g) > p_local] = -1
    return idx


def _naive(idx: torch.Tensor, num_local: int, alignment: int):
    entries = {j: [] for j in range(num_local)}
    for n, row in enumerate(idx.tolist()):
        for k, j in enumerate(row):
            if j >= 0:
                entries[j].append((n, k))
    src, slot, offsets = [], [], [0]
    for j in range(num_local):
        for n, k in entries[j]:
            src.append(n)
            slot.append(k)
        pad = -len(entries[j]) % alignment
        src += [-1] * pad
        slot += [-1] * pad
        offsets.append(len(src))
    index = [[-1] * idx.shape[1] for _ in range(idx.shape[0])]
    for m, (n, k) in enumerate(zip(src, slot)):
        if n >= 0:
            index[n][k] = m
    return [len(entries[j]) for j in range(num_local)], offsets, src, slot, index


@pytest.mark.parametrize(
    ("n", "k", "num_local", "alignment"),
    [(40, 4, 3, 1), (33, 8, 4, 8), (7, 1, 2, 16), (0, 2, 3, 4), (5, 3, 1, 128)],
)
@pytest.mark.parametrize("extra_rows", [0, 37])
def test_maps_match_loops(n, k, num_local, alignment, extra_rows) -> None:
    g = torch.Generator().manual_seed(n * 131 + k * 17 + num_local + alignment)
    idx = _recv_idx(n, k, num_local, g)
    counts, offsets, src, slot, index = _naive(idx, num_local, alignment)
    m = offsets[-1] + extra_rows  # extra rows: sync-free capacity beyond the data
    maps = build_expanded(idx, num_local, alignment, m)
    assert maps.counts.tolist() == counts
    assert maps.offsets.tolist() == offsets
    assert all(o % alignment == 0 for o in offsets)
    assert maps.src_row.tolist() == src + [-1] * extra_rows
    assert maps.slot.tolist() == slot + [-1] * extra_rows
    assert maps.index.tolist() == index
    x = torch.randn(n, 6, generator=g)
    out = gather_expanded(x, maps.src_row)
    for row, s in enumerate(maps.src_row.tolist()):
        assert torch.equal(out[row], x[s] if s >= 0 else torch.zeros(6)), row


def test_capacity_bounds_every_routing() -> None:
    g = torch.Generator().manual_seed(5)
    n, k, num_local, a = 16, 4, 3, 8
    idx = torch.randint(0, num_local, (n, k), generator=g)  # every slot local: the worst case
    need = _naive(idx, num_local, a)[1][-1]
    assert need <= expanded_capacity(n, k, num_local, a)
    maps = build_expanded(idx, num_local, a, expanded_capacity(n, k, num_local, a))
    assert int(maps.offsets[-1]) == need


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_reduce_is_the_fixed_order_float32_sum(dtype, weighted) -> None:
    g = torch.Generator().manual_seed(11)
    n, k, num_local, h = 25, 6, 3, 20
    idx = _recv_idx(n, k, num_local, g, p_local=0.6)
    maps = build_expanded(idx, num_local, 4, _naive(idx, num_local, 4)[1][-1])
    x = torch.randn(maps.src_row.numel(), h, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g) if weighted else None
    if w is not None:
        w[idx < 0] = float("nan")  # a non-local slot's weight must not leak in
    got = reduce_expanded(x, maps.index, w)
    want = torch.empty(n, h, dtype=dtype)
    ref64 = torch.zeros(n, h, dtype=torch.float64)
    for row in range(n):
        acc = torch.zeros(h, dtype=torch.float32)
        for slot in range(k):
            m = int(maps.index[row, slot])
            if m < 0:
                continue
            term = x[m].float() * w[row, slot] if w is not None else x[m].float()
            acc = acc + term
            ref64[row] += x[m].double() * (float(w[row, slot]) if w is not None else 1.0)
        want[row] = acc.to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    assert not torch.isnan(got).any()
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.double(), ref64, atol=tol * max(1.0, ref64.abs().max().item()), rtol=tol)


def test_most_expanded_rows_is_the_largest_ranks_padded_layout() -> None:
    # 3 sources, 2 ranks of 2 experts: totals per expert 5, 0 | 9, 1
    per_expert = torch.tensor([[1, 0, 4, 0], [4, 0, 0, 1], [0, 0, 5, 0]])
    assert most_expanded_rows(per_expert, 2, 1) == 10  # rank 1: 9 + 1
    assert most_expanded_rows(per_expert, 2, 4) == 16  # rank 0: 8 + 0, rank 1: 12 + 4
    assert most_expanded_rows(per_expert, 2, 8) == 24  # rank 0: 8, rank 1: 16 + 8
    assert most_expanded_rows(torch.zeros(2, 4, dtype=torch.int64), 2, 16) == 0
    # as build_expanded pads each rank's own counts
    for rank in range(2):
        counts = per_expert.sum(0)[2 * rank : 2 * rank + 2]
        assert int(padded_offsets(counts, 8)[-1]) <= most_expanded_rows(per_expert, 2, 8)
