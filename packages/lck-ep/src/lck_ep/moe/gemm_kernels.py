"""Triton grouped GEMMs of the MoE experts layer's forward, over the expert-major layout.

The kernels tile each expert's segment of rows (``ends`` ``[E]`` int32, cumulative) separately: tile
``i`` is row tile ``i // n_tiles`` of the list of every expert's row tiles and column tile ``i % n_tiles``.
A program finds a tile's expert from ``ends`` itself (a prefix sum over at most a few hundred experts, in
registers), so nothing is read on the host, and loops over tiles ``pid, pid + programs, ...`` up to the
routing's tile count: with one program per tile of the most-tiles routing (``cdiv(M, BLOCK_M) + E`` row
tiles) that is at most one tile, with a persistent grid (one program per SM) several, and the tile and K
loops can then be flattened into one software pipeline (``FLATTEN``). Weights are read through TMA
descriptors of the contiguous ``[E * K, N]`` weight matrix; rows of another expert that a tile's loads
bring in are masked at the store.

- ``_swiglu_gemm_kernel``: ``act = w * silu(g) * u`` with ``[g, u] = a @ W1[e]``, the gate and up column
  tiles of one program side by side (two accumulators), so the activation needs no pass over ``h``; writes
  ``h = [g, u]`` as well when a backward needs it (``WRITE_H``). ``act`` is computed from the rounded
  ``h``, as the separate activation kernel (``kernels.py``) computes it.
- ``_swiglu_gemm_gather_kernel``: the same without ``h``, reading its rows from the tokens through the layout's
  ``entry`` map instead of a gathered copy (the forward when no backward follows: nothing needs the copy).
  Its pointer loads make the GEMM slower than the TMA one, by less than the separate gather costs on a
  persistent grid (H100: 0.781 ms against 0.723 + 0.118, ``benchmarks/grouped_gemm_probe.py --part gather``;
  an early version with one program per tile lost: 0.83-0.86 against 0.66 + 0.10 on an H200).
- ``_grouped_gemm_kernel``: ``out[rows of e] = a[rows of e] @ W[e]``.

Measured on one H200 at the Qwen3-30B-A3B expert shape (``benchmarks/grouped_gemm_probe.py``), the plain
kernel at 128×256×64 tiles is 3-4% faster than ``torch._grouped_mm`` with one program per tile, and 0.360
against 0.405 ms back to back on a flattened persistent grid. Launches, tiles and grids: ``grouped.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fmt: off


@triton.jit
def _tile_counts(ends_ptr, NUM_E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(tiles, cum)`` over ``E_BLOCK`` lanes: each expert's row tiles and their inclusive prefix sum."""
    e_ids = tl.arange(0, E_BLOCK)
    in_e = e_ids < NUM_E
    ends = tl.load(ends_ptr + e_ids, mask=in_e, other=0)
    starts = tl.load(ends_ptr + e_ids - 1, mask=in_e & (e_ids > 0), other=0)
    tiles = tl.where(in_e, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    return tiles, tl.cumsum(tiles, 0)


@triton.jit
def _locate(ends_ptr, tile, n_tiles, tiles, cum, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(expert, first row, segment end, first column) of ``tile`` (< the total): row tile ``tile // n_tiles``
    of the list of every expert's row tiles, column tile ``tile % n_tiles``. The experts before the row tile
    are those whose cumulative tiles end at or before it (experts without rows have no tile)."""
    mt = tile // n_tiles
    before = cum <= mt
    e = tl.sum(before.to(tl.int32), 0)
    first = tl.sum(tl.where(before, tiles, 0), 0)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    return e, start + (mt - first) * BLOCK_M, end, (tile - mt * n_tiles) * BLOCK_N


@triton.jit
def _swiglu_gemm_kernel(
    a_desc, b_desc, w_ptr, ends_ptr, h_ptr, act_ptr, hidden, ffn, stride_h, stride_act, NUM_E: tl.constexpr,
    E_BLOCK: tl.constexpr, WRITE_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Row tile x (gate, up) column tiles of ``h = a[rows] @ W1[e]``, then ``act = w * silu(g) * u``
    with row m's routing weight ``w[m]``. ``a_desc``: the expanded rows ``[M, hidden]`` in
    ``[BLOCK_M, BLOCK_K]`` blocks; ``b_desc``: W1 as ``[E * hidden, 2 * ffn]`` in ``[BLOCK_K, BLOCK_N]``."""
    tiles, cum = _tile_counts(ends_ptr, NUM_E, E_BLOCK, BLOCK_M)
    n_tiles = ffn // BLOCK_N
    for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0) * n_tiles, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        e, row0, end, col0 = _locate(ends_ptr, tile, n_tiles, tiles, cum, BLOCK_M, BLOCK_N)
        acc_g, acc_u = _swiglu_acc(a_desc, b_desc, row0, e * hidden, col0, hidden, ffn, BLOCK_M, BLOCK_N, BLOCK_K)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        _swiglu_store(acc_g, acc_u, w, rows, row_ok, col0, h_ptr, act_ptr, ffn, stride_h, stride_act, WRITE_H,
                      BLOCK_N)


@triton.jit
def _swiglu_acc(a_desc, b_desc, row0, b_row, col0, hidden, ffn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The gate and up accumulators (float32) of rows ``row0 ..`` of ``a_desc`` times W1's rows ``b_row ..``
    at gate column ``col0`` (up column ``ffn + col0``)."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        a = a_desc.load([row0, k])
        acc_g = tl.dot(a, b_desc.load([b_row + k, col0]), acc_g)
        acc_u = tl.dot(a, b_desc.load([b_row + k, ffn + col0]), acc_u)
    return acc_g, acc_u


@triton.jit
def _swiglu_gemm_gather_kernel(
    x_ptr, entry_ptr, w_ptr, b_desc, ends_ptr, act_ptr, hidden, ffn, stride_x, num_topk, stride_act,
    NUM_E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """``_swiglu_gemm_kernel`` without ``h``, its rows gathered from the tokens as it reads them: row m is
    ``x[entry[m] // num_topk]`` (zero where ``entry[m] < 0``), its routing weight ``w[entry[m]]`` (``w`` the
    flat ``[T * K]`` float32 routing), so no gathered copy is written or read. Rows are pointer loads
    (cp.async, the row base pointers computed once per tile), W1 goes through TMA as in the other kernel."""
    tiles, cum = _tile_counts(ends_ptr, NUM_E, E_BLOCK, BLOCK_M)
    n_tiles = ffn // BLOCK_N
    for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0) * n_tiles, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        e, row0, end, col0 = _locate(ends_ptr, tile, n_tiles, tiles, cum, BLOCK_M, BLOCK_N)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        entry = tl.load(entry_ptr + rows, mask=row_ok, other=-1)
        valid = entry >= 0
        src = tl.where(valid, entry // num_topk, 0).to(tl.int64)
        a_rows = x_ptr + src[:, None] * stride_x + tl.arange(0, BLOCK_K)[None, :]
        b_row = e * hidden
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, hidden, BLOCK_K):
            a = tl.load(a_rows + k, mask=valid[:, None], other=0.0)
            acc_g = tl.dot(a, b_desc.load([b_row + k, col0]), acc_g)
            acc_u = tl.dot(a, b_desc.load([b_row + k, ffn + col0]), acc_u)
        w = tl.load(w_ptr + tl.where(valid, entry, 0), mask=valid, other=0.0)
        _swiglu_store(acc_g, acc_u, w, rows, row_ok, col0, act_ptr, act_ptr, ffn, 0, stride_act, False, BLOCK_N)


@triton.jit
def _swiglu_store(acc_g, acc_u, w, rows, row_ok, col0, h_ptr, act_ptr, ffn, stride_h, stride_act,
                  WRITE_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """A first-GEMM tile's epilogue: ``g`` and ``u`` rounded to the output dtype, ``h = [g, u]`` stored when
    ``WRITE_H``, then ``act = w * silu(g) * u`` from the rounded values, on the rows ``row_ok``."""
    g = acc_g.to(act_ptr.dtype.element_ty)
    u = acc_u.to(act_ptr.dtype.element_ty)
    cols = col0 + tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)
    out_ok = row_ok[:, None] & (cols < ffn)[None, :]
    if WRITE_H:
        h_rows = h_ptr + r64[:, None] * stride_h + cols[None, :]
        tl.store(h_rows, g, mask=out_ok)
        tl.store(h_rows + ffn, u, mask=out_ok)
    gf = g.to(tl.float32)
    act = gf * tl.sigmoid(gf) * u.to(tl.float32)
    tl.store(act_ptr + r64[:, None] * stride_act + cols[None, :], (act * w[:, None]).to(act_ptr.dtype.element_ty),
             mask=out_ok)


@triton.jit
def _grouped_gemm_kernel(
    a_desc, b_desc, c_ptr, ends_ptr, n_cols, k_dim, stride_c, NUM_E: tl.constexpr, E_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """``c[rows of e] = a[rows of e] @ W[e]``; ``a_desc`` ``[M, K]`` in ``[BLOCK_M, BLOCK_K]`` blocks,
    ``b_desc`` W as ``[E * K, N]`` in ``[BLOCK_K, BLOCK_N]`` blocks."""
    tiles, cum = _tile_counts(ends_ptr, NUM_E, E_BLOCK, BLOCK_M)
    n_tiles = n_cols // BLOCK_N
    for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0) * n_tiles, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        e, row0, end, col0 = _locate(ends_ptr, tile, n_tiles, tiles, cum, BLOCK_M, BLOCK_N)
        b_row = e * k_dim
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_dim, BLOCK_K):
            acc = tl.dot(a_desc.load([row0, k]), b_desc.load([b_row + k, col0]), acc)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < end)[:, None] & (cols < n_cols)[None, :])


# fmt: on
