"""Triton kernels of ``rms_norm``, their launch configuration and their launches.

The forward normalises a block of rows per program; rows wider than one block (``hidden > MAX_BLOCK``) are
tiled (``TILE_BLOCK`` columns at a time), with two passes over the row (the second from L2). The backward
makes one pass over ``x`` and ``dy``: a persistent grid of about ``k × SMs`` programs each walks a contiguous
range of rows and keeps its partial ``dweight`` in fp32 registers; one small reduction over programs
follows. Tiled rows split it into a row-dot kernel and a column-tiled ``dx``/``dweight`` kernel. ``CASTING`` is the index of the casting mode in
``rms_norm.CASTING_MODES`` (0 llama, 1 gemma, 2 none). Nothing here validates input: the ops in
``rms_norm`` do that before launching.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lck_kernels._common import cdiv, launcher, num_sms, row_block, tuned, warps_for

# Widest row one program holds in registers; wider rows are tiled.
MAX_BLOCK = 16384
# Tile of a tiled row, and its warps. Measured on an H200 (2026-12-01, bf16, kernels alone, commit ee4201e,
# `tune_rms_norm_swiglu.py --wide`): 4096-wide tiles with 16 warps against the 16384-wide ones before, whose
# last tile of a 20480 row was three quarters padding: forward 0.095 / 0.086 / 0.079 ms against 0.123 /
# 0.122 / 0.079 at 4096x20480 / 4096x18432 / 2048x28672; backward (16 warps, 2 programs per SM) 0.232 /
# 0.215 / 0.179 against 0.261 / 0.245 / 0.192, within 3% of the best candidate at each shape.
TILE_BLOCK, TILE_WARPS = 4096, 16


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


# fmt: on
# ---------------------------------------------------------------------------------------------------------
# Launch configuration, launches
# ---------------------------------------------------------------------------------------------------------


def fwd_config(n_cols: int, element_size: int) -> dict[str, int]:
    """Forward launch parameters: ``BLOCK_N`` (columns per tile), ``ROWS`` (rows per program), ``num_warps``.

    Small rows are packed several to a program so each program still moves ~8 KiB per tensor.
    """
    block = row_block(n_cols, MAX_BLOCK)
    if block < n_cols:
        return tuned("rms_norm_fwd", {"BLOCK_N": TILE_BLOCK, "ROWS": 1, "num_warps": TILE_WARPS})
    rows = max(1, min(16, 4096 // block))
    return tuned(
        "rms_norm_fwd", {"BLOCK_N": block, "ROWS": rows, "num_warps": warps_for(rows * block, element_size)}
    )


def bwd_config(n_cols: int, element_size: int) -> dict[str, int]:
    """Backward launch parameters; ``PROGRAMS_PER_SM`` sizes the persistent grid.

    Half-precision rows up to 8192 wide use the look-ahead kernel (``PREFETCH``: the next rows load during
    this step's reduction). Measured on an H200 (2026-11-30, bf16, backward kernel alone): at 16384×4096,
    2 rows × 16 warps, one program per SM, 0.120 ms against 0.152 ms without look-ahead (2 rows × 8 warps
    × 2 per SM); at 16384×1024, 2 rows × 4 warps × 8 per SM, 0.045 ms against 0.059 ms; at 16384×8192,
    1 row × 8 warps × 2 per SM, 0.234 ms against 0.270 ms. Packing 4 rows of 4096 or 8 rows spilled
    registers (2.3–2.6 ms). Other whole rows and float32 keep the earlier setting (no look-ahead: its doubled
    input registers would not fit beside the fp32 ``dweight`` partials); tiled rows take ``TILE_BLOCK``-wide
    tiles (measured above ``TILE_BLOCK``).
    """
    block = row_block(n_cols, MAX_BLOCK)
    whole = block >= n_cols
    half = element_size <= 2  # measured in bf16; fp32 rows double the look-ahead's registers
    if whole and half and block == 4096:
        cfg = {"ROWS": 2, "num_warps": 16, "PROGRAMS_PER_SM": 1, "PREFETCH": 1}
    elif whole and half and block == 8192:
        cfg = {"ROWS": 1, "num_warps": 8, "PROGRAMS_PER_SM": 2, "PREFETCH": 1}
    elif whole and half and block < 4096:
        rows = max(1, min(16, 2048 // block))
        warps = min(32, 2 * warps_for(block, element_size, lo=2))
        cfg = {"ROWS": rows, "num_warps": warps, "PROGRAMS_PER_SM": 8, "PREFETCH": 1}
    elif not whole:
        block = TILE_BLOCK
        cfg = {"ROWS": 1, "num_warps": TILE_WARPS, "PROGRAMS_PER_SM": 2, "PREFETCH": 0}
    else:
        rows = max(1, min(16, (8192 if block >= 4096 else 2048) // block))
        warps = min(32, 2 * warps_for(block, element_size, lo=2))
        cfg = {"ROWS": rows, "num_warps": warps, "PROGRAMS_PER_SM": 2, "PREFETCH": 0}
    return tuned("rms_norm_bwd", {"BLOCK_N": block, **cfg})


def launch_fwd(x2, weight, y2, rstd, eps, offset, casting) -> None:
    n_rows, n_cols = x2.shape
    cfg = fwd_config(n_cols, x2.element_size())
    block, rows = cfg["BLOCK_N"], cfg["ROWS"]
    launcher(_rms_norm_fwd_kernel)[(cdiv(n_rows, rows),)](
        x2, weight, y2, rstd, n_rows, n_cols, x2.stride(0), y2.stride(0), float(eps), float(offset),
        CASTING=casting, ROWS=rows, BLOCK_N=block, TILED=block < n_cols, num_warps=cfg["num_warps"],
    )  # fmt: skip


def launch_bwd(dy2, x2, weight, rstd, dx2, offset, casting) -> torch.Tensor:
    """Launch the backward; return ``dweight`` (fp32, summed over programs, not yet cast)."""
    n_rows, n_cols = x2.shape
    cfg = bwd_config(n_cols, x2.element_size())
    block, rows = cfg["BLOCK_N"], cfg["ROWS"]
    programs = max(1, min(num_sms(x2.device) * cfg["PROGRAMS_PER_SM"], cdiv(n_rows, rows)))
    # Whole multiples of ROWS per program, so only the last program sees a ragged tail.
    per_program = cdiv(cdiv(n_rows, programs), rows) * rows
    programs = cdiv(n_rows, per_program)
    partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x2.device)
    if block >= n_cols:
        launcher(_rms_norm_bwd_kernel)[(programs,)](
            dy2, x2, weight, rstd, dx2, partial, n_rows, n_cols, per_program,
            dy2.stride(0), x2.stride(0), dx2.stride(0), float(offset),
            CASTING=casting, ROWS=rows, BLOCK_N=block, PREFETCH=bool(cfg["PREFETCH"]), num_warps=cfg["num_warps"],
        )  # fmt: skip
    else:
        dot = torch.empty((n_rows,), dtype=torch.float32, device=x2.device)
        launcher(_rms_norm_bwd_dot_kernel)[(n_rows,)](
            dy2, x2, weight, rstd, dot, n_rows, n_cols, dy2.stride(0), x2.stride(0), float(offset),
            CASTING=casting, BLOCK_N=block, num_warps=cfg["num_warps"],
        )  # fmt: skip
        # dot is complete before dx overwrites dy (in place): kernels on one stream run in order.
        launcher(_rms_norm_bwd_tiled_kernel)[(cdiv(n_cols, block), programs)](
            dy2, x2, weight, rstd, dot, dx2, partial, n_rows, n_cols, per_program,
            dy2.stride(0), x2.stride(0), dx2.stride(0), float(offset),
            CASTING=casting, ROWS=rows, BLOCK_N=block, num_warps=cfg["num_warps"],
        )  # fmt: skip
    return partial.sum(0)
