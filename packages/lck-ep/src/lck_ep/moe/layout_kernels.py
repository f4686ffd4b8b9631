"""Triton kernels that build the local expert-major layout (:mod:`lck_ep.moe.permute`) in three launches,
in place of a device sort and a dozen small torch ops.

The ``T * K`` flat entries are cut into chunks of ``CHUNK``; each chunk's entries are matched against every
expert at once (a ``[CHUNK, E_BLOCK]`` one-hot), so counting and the stable rank of an entry among the
chunk's entries of its expert are a sum and a prefix sum over that tile, with no atomics:

1. ``_layout_count_kernel``: per chunk, the entries of each expert (and of ids outside ``[-1, E)``);
2. ``_layout_scan_kernel`` (a program per 16 experts): each expert's total, and for every chunk the entries
   of that expert in earlier chunks (``prefix``);
3. ``_layout_place_kernel``: each expert's padded segment start from the totals (``offsets``, ``ends``), and
   row ``offsets[e] + prefix[chunk, e] + rank`` for each entry: ``entry[row]`` and ``index``.

Entries of one expert keep their flat order (token, then slot), as the stable sort did, so the layout is
the same bit for bit. Launches: ``permute.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fmt: off


@triton.jit
def _layout_count_kernel(idx_ptr, counts_ptr, bad_ptr, n, num_experts, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    """``counts[b, e]``: entries of chunk ``b`` whose expert is ``e`` (-1 entries match none); ``bad[b]``: its
    entries outside ``[-1, E)``."""
    b = tl.program_id(0)
    j = b * CHUNK + tl.arange(0, CHUNK)
    ok = j < n
    x = tl.load(idx_ptr + j, mask=ok, other=-1)
    e_ids = tl.arange(0, E_BLOCK)
    hit = (x[:, None] == e_ids[None, :]).to(tl.int32)
    tl.store(counts_ptr + b * E_BLOCK + e_ids, tl.sum(hit, 0))
    tl.store(bad_ptr + b, tl.sum((ok & ((x < -1) | (x >= num_experts))).to(tl.int32), 0))


@triton.jit
def _layout_scan_kernel(
    counts_ptr, prefix_ptr, totals_ptr, bad_ptr, ok_ptr, num_chunks, E_BLOCK: tl.constexpr, COLS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Program c, experts ``[c * COLS, (c + 1) * COLS)``: ``prefix[b, e] = sum of counts[b', e] over b' < b``
    and ``totals[e]``; program 0 also sets ``ok[0]`` to whether no chunk had an id outside ``[-1, E)``."""
    c = tl.program_id(0)
    cols = c * COLS + tl.arange(0, COLS)
    r_ids = tl.arange(0, ROWS)
    run = tl.zeros([COLS], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + r_ids
        ok = (rows < num_chunks)[:, None]
        at = rows[:, None] * E_BLOCK + cols[None, :]
        cnt = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(prefix_ptr + at, run[None, :] + tl.cumsum(cnt, 0) - cnt, mask=ok)
        run += tl.sum(cnt, 0)
    tl.store(totals_ptr + cols, run)
    if c == 0:
        bad = tl.zeros([ROWS], dtype=tl.int32)
        for r0 in range(0, num_chunks, ROWS):
            rows = r0 + r_ids
            bad += tl.load(bad_ptr + rows, mask=rows < num_chunks, other=0)
        tl.store(ok_ptr, (tl.sum(bad, 0) == 0).to(tl.int32))


@triton.jit
def _layout_place_kernel(
    idx_ptr, prefix_ptr, totals_ptr, entry_ptr, index_ptr, offsets_ptr, ends_ptr, n, num_experts, alignment,
    CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
):
    """Segment starts from the totals (each padded to ``alignment``; program 0 writes ``offsets`` ``[E + 1]``
    int64 and ``ends`` ``[E]`` int32), then row of entry j (chunk b): ``offsets[e] + prefix[b, e] +`` its rank
    among the chunk's entries of expert e; ``entry[row] = j``, ``index[j] = row`` (-1 for a -1 entry)."""
    b = tl.program_id(0)
    e_ids = tl.arange(0, E_BLOCK)
    in_e = e_ids < num_experts
    total = tl.load(totals_ptr + e_ids)
    padded = tl.where(in_e, (total + alignment - 1) // alignment * alignment, 0)
    incl = tl.cumsum(padded, 0)
    start = incl - padded
    if b == 0:
        tl.store(offsets_ptr + e_ids, start.to(tl.int64), mask=in_e)
        tl.store(offsets_ptr + num_experts, tl.sum(padded, 0).to(tl.int64))
        tl.store(ends_ptr + e_ids, incl, mask=in_e)
    j = b * CHUNK + tl.arange(0, CHUNK)
    ok = j < n
    x = tl.load(idx_ptr + j, mask=ok, other=-1)
    hit = (x[:, None] == e_ids[None, :]).to(tl.int32)
    base = start + tl.load(prefix_ptr + b * E_BLOCK + e_ids)
    row = tl.sum(hit * (base[None, :] + tl.cumsum(hit, 0) - 1), 1)
    valid = (x >= 0) & (x < num_experts)  # out-of-range ids (refused through ok) write nothing
    tl.store(index_ptr + j, tl.where(valid, row, -1).to(tl.int64), mask=ok)
    tl.store(entry_ptr + row, j.to(tl.int64), mask=ok & valid)


# fmt: on
