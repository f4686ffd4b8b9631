"""Triton kernels of the MoE experts layer: row gather into the expert-major layout, the fused SwiGLU
with the routing weight (forward and backward), and the per-token reduction back from expanded rows.

Row indices are int64 inside the kernels (``rows * stride`` exceeds 2**31 at 65536 × 2048 × 16). Every
accumulation is in float32 with plain adds in a fixed order (no atomics), so results are reproducible
bit for bit. Launches and configurations: ``launch.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fmt: off


@triton.jit
def _gather_rows_kernel(
    x_ptr, w_ptr, entry_ptr, out_ptr, w_out_ptr, n_rows, n_cols, num_topk, stride_x, stride_out,
    HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``out[m] = x[entry[m] // num_topk]`` (zero row where ``entry[m] < 0``) and, with ``HAS_W``,
    ``w_out[m] = w[entry[m]]`` (0 where ``entry[m] < 0``; ``w`` is the flat ``[T * K]`` float32 routing)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    entry = tl.load(entry_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    valid = entry >= 0
    src = tl.where(valid, entry // num_topk, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    vals = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=valid[:, None] & col_ok[None, :],
                   other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], vals,
             mask=row_ok[:, None] & col_ok[None, :])
    if HAS_W:
        if pid_n == 0:
            wv = tl.load(w_ptr + tl.where(valid, entry, 0), mask=valid, other=0.0)
            tl.store(w_out_ptr + rows, wv, mask=row_ok)


@triton.jit
def _swiglu_weighted_fwd_kernel(
    h_ptr, w_ptr, act_ptr, used_ptr, n_cols, stride_h, stride_act, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``act[m, j] = w[m] * silu(h[m, j]) * h[m, n_cols + j]`` (gate then up halves of one row) for the
    rows in use (``m < used[0]``, the last segment end, read on the device); later rows are left alone."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < tl.load(used_ptr)
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    base = h_ptr + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + n_cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
    a = g * tl.sigmoid(g) * u
    tl.store(act_ptr + rows[:, None] * stride_act + cols[None, :], (a * w[:, None]).to(act_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _swiglu_weighted_bwd_kernel(
    h_ptr, w_ptr, dact_ptr, dh_ptr, dw_ptr, act_ptr, used_ptr, n_rows, n_cols, stride_h, stride_dact,
    stride_dh, stride_act, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """For ``act = w * silu(g) * u``: ``dh = [dg, du]``, ``dw[m] = sum_j dact[m, j] * silu(g) * u`` (float32,
    column blocks in ascending order) and ``act`` itself again (for the second GEMM's weight gradient, so
    the forward need not keep it). Rows past ``used[0]`` (in no segment) get ``dw = 0`` and nothing else."""
    pid_m = tl.program_id(0)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < tl.load(used_ptr)
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
    dw = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        base = h_ptr + rows[:, None] * stride_h + cols[None, :]
        g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + n_cols, mask=mask, other=0.0).to(tl.float32)
        da = tl.load(dact_ptr + rows[:, None] * stride_dact + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        a = silu * u
        dw += tl.sum(da * a, axis=1)
        dw_a = da * w[:, None]
        dg = dw_a * u * (s + silu * (1.0 - s))
        du = dw_a * silu
        out = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
        tl.store(out, dg.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(out + n_cols, du.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(act_ptr + rows[:, None] * stride_act + cols[None, :], (a * w[:, None]).to(act_ptr.dtype.element_ty),
                 mask=mask)
    tl.store(dw_ptr + rows, dw, mask=rows < n_rows)


@triton.jit
def _reduce_rows_kernel(
    y_ptr, index_ptr, out_ptr, n_cols, num_topk, stride_y, stride_out, BLOCK_N: tl.constexpr,
):
    """``out[t] = sum over k ascending of y[index[t, k]]`` for ``index[t, k] >= 0``, float32 from +0.0,
    cast once to ``out``'s dtype (the order of :func:`lck_ep.expanded.reduce_expanded`)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, num_topk):
        row = tl.load(index_ptr + t * num_topk + k).to(tl.int64)
        if row >= 0:
            acc += tl.load(y_ptr + row * stride_y + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _zero_empty_experts_kernel(
    out_ptr, ends_ptr, per_expert, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Zero ``out[j]`` (``per_expert`` elements) when expert j's segment is empty; other programs return
    at once. Grid ``(E, SPLITS)``: each program clears one strided share of its expert."""
    j = tl.program_id(0)
    start = tl.load(ends_ptr + j - 1, mask=j > 0, other=0)
    if tl.load(ends_ptr + j) == start:
        base = out_ptr + j.to(tl.int64) * per_expert
        for off in range(tl.program_id(1) * BLOCK, per_expert, SPLITS * BLOCK):
            cols = off + tl.arange(0, BLOCK)
            tl.store(base + cols, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=cols < per_expert)


# fmt: on
