"""Triton kernels of ``rms_norm`` (launch configuration and launches: ``launch.py``).

The forward normalises a block of rows per program; rows wider than one block (``hidden > MAX_BLOCK``) are
tiled (``TILE_BLOCK`` columns at a time), with two passes over the row (the second from L2). The backward
makes one pass over ``x`` and ``dy``: a persistent grid of about ``k × SMs`` programs each walks a contiguous
range of rows and keeps its partial ``dweight`` in fp32 registers; one small reduction over programs
follows (``_rms_norm_dw_kernel``, which also rounds to the weight's dtype). Tiled rows split it into a row-dot
kernel and a column-tiled ``dx``/``dweight`` kernel. ``CASTING`` is the index of the casting mode in
``checks.CASTING_MODES`` (0 llama, 1 gemma, 2 none). Nothing here validates input: the ops in
``ops.py`` do that before launching.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------
# fmt: off


@triton.jit
def _normalise(xf, rstd, w, CASTING: tl.constexpr, DT: tl.constexpr):
    """fp32 ``x`` [R, B], fp32 ``rstd`` [R], fp32 ``offset + w`` [B] -> fp32 output before the final rounding."""
    if CASTING == 0:  # llama
        xn = (xf * rstd[:, None]).to(DT).to(tl.float32)
        return xn * w[None, :]
    elif CASTING == 1:  # gemma
        return xf * rstd[:, None] * w[None, :]
    else:  # none
        r = rstd.to(DT).to(tl.float32)
        xn = (xf * r[:, None]).to(DT).to(tl.float32)
        return xn * w.to(DT).to(tl.float32)[None, :]


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, stride_x, stride_y, eps, offset, CASTING: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TILED: tl.constexpr,
):
    # Float scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    eps = tl.cast(eps, tl.float32)
    offset = tl.cast(offset, tl.float32)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on 3-D activations
    cols = tl.arange(0, BLOCK_N)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if not TILED:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        xf = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        y = _normalise(xf, rstd, w, CASTING, DT)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(DT), mask=mask)
    else:
        # Pass 1 sums squares tile by tile; pass 2 re-reads the row, which is still in L2.
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            xf = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            xf = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32) + offset
            y = _normalise(xf, rstd, w, CASTING, DT)
            tl.store(y_ptr + rows[:, None] * stride_y + c[None, :], y.to(DT), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _effective_weight(w_ptr, cols, col_mask, offset, CASTING: tl.constexpr, DT: tl.constexpr):
    """``offset + w`` in fp32 as the forward used it (rounded to x's dtype in mode "none")."""
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    if CASTING == 2:
        w = w.to(DT).to(tl.float32)
    return w


@triton.jit
def _load_rows(x_ptr, dy_ptr, rows, last, cols, col_mask, stride_x, stride_dy):
    """Rows ``rows`` (those below ``last``) of ``x`` and ``dy``, in their own dtype."""
    mask = (rows < last)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program, stride_dy,
    stride_x, stride_dx, offset, CASTING: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Persistent: program ``p`` owns rows ``[p * rows_per_program, (p + 1) * rows_per_program)``.

    With ``PREFETCH`` the next step's rows are loaded before this step's reduction, so a program always has
    a load in flight (the rows differ, so writing ``dx`` into ``dy`` in place stays safe)."""
    pid = tl.program_id(0)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = _effective_weight(w_ptr, cols, col_mask, offset, CASTING, DT)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # dweight partial sums stay in registers for the whole row range: one reduction at the very end.
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        x_next, dy_next = _load_rows(x_ptr, dy_ptr, first + tl.arange(0, ROWS), last, cols, col_mask, stride_x,
                                     stride_dy)  # fmt: skip
    for start in range(first, last, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < last
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        if PREFETCH:
            x_cur, dy_cur = x_next, dy_next
            x_next, dy_next = _load_rows(x_ptr, dy_ptr, rows + ROWS, last, cols, col_mask, stride_x, stride_dy)
        else:
            x_cur, dy_cur = _load_rows(x_ptr, dy_ptr, rows, last, cols, col_mask, stride_x, stride_dy)
        xf, dy = x_cur.to(tl.float32), dy_cur.to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        xn = xf * rstd[:, None]
        g = dy * w[None, :]
        dot = tl.sum(g * xn, axis=1) / n_cols
        dx = (g - xn * dot[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(DT), mask=mask)
        acc += dy * xn
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def _rms_norm_bwd_dot_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dot_ptr, n_rows, n_cols, stride_dy, stride_x, offset, CASTING:
    tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Tiled path, step 1: ``dot[r] = mean((dy * w) * x * rstd)`` per row."""
    row = tl.program_id(0).to(tl.int64)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    rstd = tl.load(rstd_ptr + row)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        m = c < n_cols
        xf = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + c, mask=m, other=0.0).to(tl.float32)
        w = _effective_weight(w_ptr, c, m, offset, CASTING, DT)
        acc += dy * w * xf
    tl.store(dot_ptr + row, tl.sum(acc, axis=0) * rstd / n_cols)


@triton.jit
def _rms_norm_bwd_tiled_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dot_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program,
    stride_dy, stride_x, stride_dx, offset, CASTING: tl.constexpr, ROWS: tl.constexpr, BLOCK_N:
    tl.constexpr,
):
    """Tiled path, step 2: grid (column tiles, row groups); ``dx`` and a partial ``dweight`` per tile."""
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = _effective_weight(w_ptr, cols, col_mask, offset, CASTING, DT)
    first = pid_g * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for start in range(first, last, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < last
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        xf = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        dot = tl.load(dot_ptr + rows, mask=row_mask, other=0.0)
        xn = xf * rstd[:, None]
        dx = (dy * w[None, :] - xn * dot[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(DT), mask=mask)
        acc += dy * xn
    tl.store(dw_partial_ptr + pid_g.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def _rms_norm_dw_kernel(
    partial_ptr, dw_ptr, n_partials, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``dweight = partial.sum(0)`` rounded to ``dweight``'s dtype: one launch where torch took a reduction
    and a cast (two dispatcher calls and an fp32 temporary on the backward's host path)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for p0 in range(0, n_partials, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < n_partials) & col_mask[None, :]
        block = tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(block, axis=0)
    tl.store(dw_ptr + cols, acc.to(dw_ptr.dtype.element_ty), mask=col_mask)


# fmt: on
