"""Triton kernels that build the local expert-major layout (:mod:`lck_ep.moe.permute`) in three launches,
in place of a device sort and a dozen small torch ops.

The ``T * K`` flat entries are cut into chunks of ``CHUNK``; each chunk's entries are matched against every
expert at once (a ``[CHUNK, E_BLOCK]`` one-hot), so counting and the stable rank of an entry among the
chunk's entries of its expert are a sum and a prefix sum over that tile, with no atomics:

1. ``_layout_count_kernel``: per chunk, the entries of each expert;
2. ``_layout_scan_kernel`` (one program): each expert's total and padded segment (``offsets``, ``ends``),
   then, for every chunk, where its first entry of each expert goes (``base``: the segment start plus the
   entries of earlier chunks);
3. ``_layout_place_kernel``: row ``base[chunk, e] + rank`` for each entry: ``entry[row]`` and ``index``.

Entries of one expert keep their flat order (token, then slot), as the stable sort did, so the layout is
the same bit for bit. Launches: ``permute.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fmt: off


@triton.jit
def _layout_count_kernel(idx_ptr, counts_ptr, n, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    """``counts[b, e]``: entries of chunk ``b`` whose expert is ``e`` (-1 entries match none)."""
    b = tl.program_id(0)
    j = b * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(idx_ptr + j, mask=j < n, other=-1)
    e_ids = tl.arange(0, E_BLOCK)
    hit = (x[:, None] == e_ids[None, :]).to(tl.int32)
    tl.store(counts_ptr + b * E_BLOCK + e_ids, tl.sum(hit, 0))


@triton.jit
def _layout_scan_kernel(
    counts_ptr, base_ptr, offsets_ptr, ends_ptr, num_chunks, num_experts, alignment, E_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One program: ``offsets`` ``[E + 1]`` int64 (segment starts, each segment padded to ``alignment``),
    ``ends`` ``[E]`` int32, and ``base[b, e] = offsets[e] + sum of counts[b', e] over b' < b``."""
    e_ids = tl.arange(0, E_BLOCK)
    r_ids = tl.arange(0, ROWS)
    total = tl.zeros([E_BLOCK], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + r_ids
        c = tl.load(counts_ptr + rows[:, None] * E_BLOCK + e_ids[None, :], mask=(rows < num_chunks)[:, None],
                    other=0)
        total += tl.sum(c, 0)
    in_e = e_ids < num_experts
    padded = tl.where(in_e, (total + alignment - 1) // alignment * alignment, 0)
    incl = tl.cumsum(padded, 0)
    start = incl - padded
    tl.store(offsets_ptr + e_ids, start.to(tl.int64), mask=in_e)
    tl.store(offsets_ptr + num_experts, tl.sum(padded, 0).to(tl.int64))
    tl.store(ends_ptr + e_ids, incl, mask=in_e)
    run = start
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + r_ids
        ok = (rows < num_chunks)[:, None]
        c = tl.load(counts_ptr + rows[:, None] * E_BLOCK + e_ids[None, :], mask=ok, other=0)
        tl.store(base_ptr + rows[:, None] * E_BLOCK + e_ids[None, :], run[None, :] + tl.cumsum(c, 0) - c, mask=ok)
        run += tl.sum(c, 0)


@triton.jit
def _layout_place_kernel(
    idx_ptr, base_ptr, entry_ptr, index_ptr, n, num_experts, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
):
    """Row of entry j (chunk b): ``base[b, e] +`` its rank among the chunk's entries of expert e;
    ``entry[row] = j``, ``index[j] = row`` (-1 for a -1 entry)."""
    b = tl.program_id(0)
    j = b * CHUNK + tl.arange(0, CHUNK)
    ok = j < n
    x = tl.load(idx_ptr + j, mask=ok, other=-1)
    e_ids = tl.arange(0, E_BLOCK)
    hit = (x[:, None] == e_ids[None, :]).to(tl.int32)
    base = tl.load(base_ptr + b * E_BLOCK + e_ids)
    row = tl.sum(hit * (base[None, :] + tl.cumsum(hit, 0) - 1), 1)
    valid = (x >= 0) & (x < num_experts)  # out-of-range ids (refused by the caller's assertion) write nothing
    tl.store(index_ptr + j, tl.where(valid, row, -1).to(tl.int64), mask=ok)
    tl.store(entry_ptr + row, j.to(tl.int64), mask=ok & valid)


# fmt: on
