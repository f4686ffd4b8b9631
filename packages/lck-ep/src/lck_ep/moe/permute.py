"""The no-communication expert-major layout: this rank's (token, slot) entries sorted by expert.

The layout is the one :meth:`lck_ep.Buffer.dispatch` gives with ``expand=True`` on a single rank (see
:mod:`lck_ep.handle`): one row per (token t, slot k) whose expert is valid, grouped by expert ascending,
then token ascending, then slot ascending; expert j's rows start at ``offsets[j]``, and each segment is
padded with zero rows to a multiple of ``alignment``. The two paths therefore feed the grouped GEMMs
identical rows, and give identical results.

The number of rows is fixed by the shapes, not the data (``T * K + E * (alignment - 1)``; rows past
``offsets[E]`` belong to no expert and nothing reads them), so building the layout reads nothing on the
host. Where Triton runs (CUDA, or the CPU interpreter) three kernels build it (``layout_kernels.py``:
count per chunk, one scan, place); elsewhere torch ops do: one stable sort of the ``T * K`` expert ids, a
binary search for the segment bounds, and small scatters. Both give the same layout.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lck_ep.moe import launch


class LocalLayout(NamedTuple):
    entry: torch.Tensor  # [M] int64: flat (t * K + k) entry of each expanded row, -1 on padding rows
    index: torch.Tensor  # [T, K] int64: expanded row of each (t, k), -1 where topk_idx is -1
    offsets: torch.Tensor  # [E + 1] int64: padded segment starts; offsets[E] = rows in use
    ends: torch.Tensor  # [E] int32: offsets[1:], the cumulative segment ends torch._grouped_mm takes


def num_rows(num_tokens: int, num_topk: int, num_experts: int, alignment: int) -> int:
    """Rows of the layout: every entry plus the most padding any routing can need."""
    return num_tokens * num_topk + num_experts * (alignment - 1)


@functools.cache
def _kernels():  # imported on first use: `import lck_ep.moe` stays cheap
    from lck_ep.moe import layout_kernels

    return layout_kernels


def build_local_layout(topk_idx: torch.Tensor, num_experts: int, alignment: int) -> LocalLayout:
    """The layout of ``topk_idx`` ``[T, K]`` (int64 expert ids in ``[0, E)`` or -1; checked by the caller)."""
    if launch.use_triton(topk_idx):
        layout, ids_ok = _triton_layout(topk_idx, num_experts, alignment)
        if topk_idx.device.type == "cuda":
            # Ids outside [-1, E) fail a device-side assertion (no host read); they write no row.
            torch._assert_async(ids_ok)
        return layout
    return _torch_layout(topk_idx, num_experts, alignment)


def _triton_layout(
    topk_idx: torch.Tensor, num_experts: int, alignment: int
) -> tuple[LocalLayout, torch.Tensor]:
    """The layout, and a one-element int32 tensor that is 1 when every id is in ``[-1, E)``, else 0."""
    t, k = topk_idx.shape
    dev = topk_idx.device
    n, e = t * k, num_experts
    flat = topk_idx.reshape(-1).contiguous()
    e_block = max(16, launch.next_pow2(e))
    chunk = max(16, 16384 // e_block)  # the [chunk, E_BLOCK] one-hot of a program: 16K elements
    chunks = launch.triton_cdiv(n, chunk)
    rows = max(chunks, 1)  # without tokens the place kernel's one program still reads a prefix row
    scratch = torch.empty(2 * rows * e_block + rows + e_block + 1, dtype=torch.int32, device=dev)
    counts = scratch[: rows * e_block]
    prefix = scratch[rows * e_block : 2 * rows * e_block]
    bad = scratch[2 * rows * e_block : 2 * rows * e_block + rows]
    totals = scratch[2 * rows * e_block + rows : -1]
    ok = scratch[-1:]
    offsets = torch.empty(e + 1, dtype=torch.int64, device=dev)
    ends = torch.empty(e, dtype=torch.int32, device=dev)
    entry = torch.full((num_rows(t, k, e, alignment),), -1, dtype=torch.int64, device=dev)
    index = torch.empty(n, dtype=torch.int64, device=dev)
    kern = _kernels()
    if chunks:
        launch.run(
            kern._layout_count_kernel, (chunks,), flat, counts, bad, n, e, CHUNK=chunk, E_BLOCK=e_block,
            num_warps=4,
        )  # fmt: skip
    launch.run(
        kern._layout_scan_kernel, (e_block // 16,), counts, prefix, totals, bad, ok, chunks, E_BLOCK=e_block,
        COLS=16, ROWS=512, num_warps=4,
    )  # fmt: skip
    launch.run(kern._layout_place_kernel, (max(chunks, 1),),
        flat, prefix, totals, entry, index, offsets, ends, n, e, alignment, CHUNK=chunk, E_BLOCK=e_block,
        num_warps=4,
    )  # fmt: skip
    return LocalLayout(entry=entry, index=index.reshape(t, k), offsets=offsets, ends=ends), ok


def _torch_layout(topk_idx: torch.Tensor, num_experts: int, alignment: int) -> LocalLayout:
    if topk_idx.device.type == "cuda" and topk_idx.numel():
        # A device-side assertion instead of a host read: the layout stays free of syncs.
        torch._assert_async(((topk_idx >= -1) & (topk_idx < num_experts)).all())
    t, k = topk_idx.shape
    dev = topk_idx.device
    n = t * k
    e = num_experts
    flat = topk_idx.reshape(-1)
    # -1 entries sort after every expert; a stable sort keeps (token, slot) order inside an expert.
    key = torch.where(flat >= 0, flat, e).to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.searchsorted(sorted_key, torch.arange(e + 1, dtype=torch.int32, device=dev))
    m = num_rows(t, k, e, alignment)
    if alignment == 1:
        # Sorted position p is expanded row p: no padding, rows past bounds[E] are the -1 entries.
        offsets = bounds.to(torch.int64)
        row_of_sorted = torch.arange(n, device=dev)
        entry = torch.where(sorted_key < e, order, -1)
    else:
        counts = (bounds[1:] - bounds[:-1]).to(torch.int64)
        padded = torch.div(counts + (alignment - 1), alignment, rounding_mode="floor") * alignment
        offsets = torch.zeros(e + 1, dtype=torch.int64, device=dev)
        offsets[1:] = torch.cumsum(padded, 0)
        seg = sorted_key.clamp(max=e - 1).to(torch.int64)
        pos = torch.arange(n, device=dev) - bounds[seg]
        # -1 entries all land on row m - 1 (a padding row past offsets[E]) and stay -1 there.
        row_of_sorted = torch.where(sorted_key < e, offsets[seg] + pos, m - 1)
        entry = torch.full((m,), -1, dtype=torch.int64, device=dev)
        entry.scatter_(0, row_of_sorted, torch.where(sorted_key < e, order, -1))
    index = torch.empty(n, dtype=torch.int64, device=dev)
    index.scatter_(0, order, torch.where(sorted_key < e, row_of_sorted, -1))
    return LocalLayout(
        entry=entry, index=index.reshape(t, k), offsets=offsets, ends=offsets[1:].to(torch.int32)
    )
