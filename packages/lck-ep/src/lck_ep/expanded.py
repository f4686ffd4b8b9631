"""The expanded expert-major layout that feeds grouped GEMMs, and its reduction back to tokens.

Given the received routing ``recv_topk_idx [N, K]`` (local expert index per slot, -1 where the slot is
not local), the expanded layout has one row per (received row n, slot k) with ``recv_topk_idx[n, k] >=
0``, grouped by local expert ascending, then n ascending, then k ascending. Expert j's segment starts at
``offsets[j]`` and is padded with zero rows to a multiple of ``alignment`` (``offsets[j + 1] -
offsets[j]`` is ``counts[j]`` rounded up). Rows past ``offsets[L]`` (sync-free capacity) are padding too.

Everything here runs as a fixed sequence of torch ops without a host synchronisation (no ``nonzero``,
no boolean indexing, no ``.item()``), so it serves both the synced and the CUDA-graph-safe path; the
caller decides the number of expanded rows ``M`` (exact when it knows the counts, worst case otherwise).

Reduction (:func:`reduce_expanded`): for each received row n, ``partial[n] = sum over k ascending of
[w[n, k] *] x[recv_expanded_index[n, k]]`` over the slots that are local, accumulated in float32 from
+0.0 (one rounding per multiply and per add, no fused multiply-add), then cast to ``x.dtype``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "ExpandedMaps",
    "build_expanded",
    "expanded_capacity",
    "gather_expanded",
    "most_expanded_rows",
    "reduce_expanded",
]


class ExpandedMaps(NamedTuple):
    counts: torch.Tensor  # [L] int32, exact entries per local expert
    offsets: torch.Tensor  # [L + 1] int64, padded segment starts
    src_row: torch.Tensor  # [M] int64, received row per expanded row (-1 padding)
    slot: torch.Tensor  # [M] int64, slot per expanded row (-1 padding)
    index: torch.Tensor  # [N, K] int64, expanded row per (row, slot) (-1 when not local)


def expanded_capacity(num_rows: int, num_topk: int, num_local_experts: int, alignment: int) -> int:
    """Worst-case expanded rows: every slot of every row local, every segment maximally padded."""
    return num_rows * num_topk + num_local_experts * (alignment - 1)


def most_expanded_rows(per_expert: torch.Tensor, num_ranks: int, alignment: int) -> int:
    """The most expanded rows any rank holds: ``per_expert`` ``[S, E]`` (every source's entries per global
    expert, as a synced dispatch's agreement gathers them; rank ``d`` hosts experts ``[d * L, (d + 1) * L)``),
    each rank's segments padded to ``alignment`` and summed."""
    # numpy on the host table: each torch op here would cost the synced dispatch's host several microseconds
    totals = per_expert.cpu().numpy().sum(0).reshape(num_ranks, -1)
    padded = -(-totals // alignment) * alignment
    return int(padded.sum(1).max()) if totals.size else 0


def expert_counts(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """[L] int64 entries per local expert (no host sync)."""
    flat = recv_topk_idx.reshape(-1)
    j = torch.where(flat >= 0, flat, torch.full_like(flat, num_local_experts))
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, j, torch.ones_like(j))
    return counts[:num_local_experts]


def padded_offsets(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    """[L + 1] int64 segment starts, each segment rounded up to a multiple of ``alignment``."""
    padded = torch.div(counts + (alignment - 1), alignment, rounding_mode="floor") * alignment
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    offsets[1:] = torch.cumsum(padded, 0)
    return offsets


def build_expanded(
    recv_topk_idx: torch.Tensor, num_local_experts: int, alignment: int, num_expanded_rows: int
) -> ExpandedMaps:
    """The expanded maps for ``num_expanded_rows`` rows (which must hold ``offsets[L]``)."""
    n, k = recv_topk_idx.shape
    dev = recv_topk_idx.device
    num_entries = n * k
    big_l = num_local_experts
    m = num_expanded_rows
    flat = recv_topk_idx.reshape(-1)
    local = flat >= 0
    j = torch.where(local, flat, torch.full_like(flat, big_l))  # non-local entries sort last
    counts_all = torch.zeros(big_l + 1, dtype=torch.int64, device=dev)
    counts_all.scatter_add_(0, j, torch.ones_like(j))
    counts = counts_all[:big_l]
    offsets = padded_offsets(counts, alignment)
    starts = torch.zeros(big_l + 1, dtype=torch.int64, device=dev)  # unpadded starts in sorted order
    starts[1:] = torch.cumsum(counts_all, 0)[:big_l]
    # Keys are unique, so the sort is a deterministic permutation: expert, then entry order (n, k).
    key = j * num_entries + torch.arange(num_entries, device=dev)
    order = torch.argsort(key)
    sorted_j = j[order]
    rank_in_expert = torch.arange(num_entries, device=dev) - starts[sorted_j]
    seg = sorted_j.clamp(max=big_l - 1)
    row_sorted = torch.where(sorted_j < big_l, offsets[seg] + rank_in_expert, torch.full_like(sorted_j, -1))
    index = torch.empty(num_entries, dtype=torch.int64, device=dev)
    index.scatter_(0, order, row_sorted)  # order is a permutation: no duplicate targets

    rows = torch.arange(m, device=dev)
    # Segment of each expanded row (L past offsets[L]), its position inside the segment, and whether
    # that position holds an entry (not padding).
    seg_of_row = torch.searchsorted(offsets[1:].contiguous(), rows, right=True)
    seg_c = seg_of_row.clamp(max=big_l - 1)
    pos = rows - offsets[seg_c]
    is_entry = (seg_of_row < big_l) & (pos < counts[seg_c])
    sorted_pos = (starts[seg_c] + pos).clamp(min=0, max=max(num_entries - 1, 0))
    if num_entries:
        entry = order[sorted_pos]
        src_row = torch.where(is_entry, torch.div(entry, k, rounding_mode="floor"), -1)
        slot = torch.where(is_entry, entry % k, -1)
    else:
        src_row = torch.full((m,), -1, dtype=torch.int64, device=dev)
        slot = torch.full((m,), -1, dtype=torch.int64, device=dev)
    return ExpandedMaps(
        counts=counts.to(torch.int32),
        offsets=offsets,
        src_row=src_row,
        slot=slot,
        index=index.reshape(n, k),
    )


def gather_expanded(x: torch.Tensor, src_row: torch.Tensor) -> torch.Tensor:
    """``out[m] = x[src_row[m]]``, zero rows where ``src_row[m] == -1``."""
    if x.shape[0] == 0:
        return torch.zeros(src_row.numel(), *x.shape[1:], dtype=x.dtype, device=x.device)
    rows = x.index_select(0, src_row.clamp(min=0))
    return torch.where((src_row >= 0).unsqueeze(1), rows, torch.zeros((), dtype=x.dtype, device=x.device))


def reduce_expanded(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per received row, the (optionally weighted) float32 sum of its expanded rows, cast to ``x.dtype``.

    ``x`` ``[M, H]``, ``index`` ``[N, K]`` (expanded row or -1), ``weights`` ``[N, K]`` float32 or None.
    Slots are added in ascending k; a non-local slot contributes nothing (not even its weight, which may
    be any value there).
    """
    n, k = index.shape
    acc = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0] == 0 or n == 0:
        return acc.to(x.dtype)
    for slot in range(k):
        idx = index[:, slot]
        local = (idx >= 0).unsqueeze(1)
        rows = x.index_select(0, idx.clamp(min=0)).to(torch.float32)
        if weights is not None:
            rows = rows * weights[:, slot : slot + 1]
        # Adding +0.0 where the slot is not local leaves acc's bits unchanged (acc is never -0.0), so
        # this equals skipping those slots.
        acc = acc + torch.where(local, rows, torch.zeros((), dtype=torch.float32, device=x.device))
    return acc.to(x.dtype)
