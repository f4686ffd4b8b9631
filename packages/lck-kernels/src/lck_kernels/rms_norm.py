"""RMSNorm: ``y = x / sqrt(mean(x², -1) + eps) * (offset + weight)``, Triton forward and backward.

Casting modes (what is rounded where; reductions always accumulate in fp32, and ``offset + weight`` is
formed in fp32):

- ``"llama"`` (Hugging Face Llama): normalise in fp32, round the normalised row to ``x.dtype``, multiply by
  ``offset + weight`` in fp32, round the product to ``x.dtype``. With a weight in ``x.dtype`` and no
  offset this is the HF computation ``weight * (x.float() * rstd).to(x.dtype)`` (up to fp32 summation order).
- ``"gemma"`` (Hugging Face Gemma): everything in fp32, one rounding of the final product to ``x.dtype``:
  ``(x.float() * rstd * (offset + weight.float())).to(x.dtype)``.
- ``"none"``: no upcast of the elementwise steps, as eager code with every tensor in ``x.dtype``: ``rstd``
  (from the fp32 mean square), the normalised row, ``offset + weight`` and the product are each rounded to
  ``x.dtype``.

The output has ``x``'s dtype and shape (any rank ≥ 1; leading dimensions are rows). The backward is the
exact gradient of the unrounded function, computed in fp32 from ``x`` and the ``rstd`` saved by the forward,
in one pass over ``x`` and ``dy``: a persistent grid of about ``k × SMs`` programs each walks a contiguous
range of rows and keeps its partial ``dweight`` in fp32 registers; one small reduction over programs follows.
Rows wider than one block (``hidden > 16384``) are tiled: the forward makes two passes over the row (the
second from L2), the backward splits into a row-dot kernel and a column-tiled ``dx``/``dweight`` kernel.

``in_place=True`` writes ``dx`` into ``dy``'s buffer in the backward (no new activation-sized allocation).
Only use it when nothing else reads that gradient: a residual ``x + norm(x)`` hands the same gradient tensor
to both branches, and overwriting it can corrupt the other branch's gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lck_kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check_choice,
    check_float,
    check_same_device,
    check_tensor,
    define_op,
    launcher,
    num_sms,
    row_block,
    rows_view,
    tuned,
    warps_for,
)

CASTING_MODES = ("llama", "gemma", "none")  # the kernels' CASTING constexpr is the index: 0, 1, 2
# Widest row one program holds in registers; wider rows are tiled.
MAX_BLOCK = 16384


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
# Validation, launch configuration, launches
# ---------------------------------------------------------------------------------------------------------


def _check_x_weight(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight, ndim=1)
    check_same_device(op, x=x, weight=weight)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)} but x's last dimension is {x.shape[-1]}"
        )
    if weight.shape[0] > 1 and weight.stride(0) != 1:
        raise ValueError(f"{op}: weight must be contiguous, got stride {weight.stride(0)}")
    rows_view(op, "x", x)


def _check_rms_norm_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> None:
    _check_x_weight(op, x, weight)
    check_float(op, "eps", eps, minimum=0.0)
    check_float(op, "offset", offset)
    check_choice(op, "casting_mode", casting_mode, CASTING_MODES)


def _check_rms_norm_bwd_inputs(
    op: str, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, casting_mode: str
) -> None:
    _check_x_weight(op, x, weight)
    check_tensor(op, "dy", dy, dtypes=(x.dtype,))
    check_tensor(op, "rstd", rstd, dtypes=(torch.float32,), ndim=1, contiguous=True)
    check_same_device(op, x=x, dy=dy, rstd=rstd)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy has shape {tuple(dy.shape)} but x has shape {tuple(x.shape)}")
    if rstd.shape[0] != x.numel() // x.shape[-1]:
        raise ValueError(f"{op}: rstd has {rstd.shape[0]} entries but x has {x.numel() // x.shape[-1]} rows")
    rows_view(op, "dy", dy)
    check_choice(op, "casting_mode", casting_mode, CASTING_MODES)


def fwd_config(n_cols: int, element_size: int) -> dict[str, int]:
    """Forward launch parameters: ``BLOCK_N`` (columns per tile), ``ROWS`` (rows per program), ``num_warps``.

    Small rows are packed several to a program so each program still moves ~8 KiB per tensor.
    """
    block = row_block(n_cols, MAX_BLOCK)
    rows = max(1, min(16, 4096 // block)) if block >= n_cols else 1
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
    registers (2.3–2.6 ms). Wider rows and float32 keep the earlier setting (no look-ahead: its doubled
    input registers would not fit beside the fp32 ``dweight`` partials).
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
    else:
        rows = max(1, min(16, (8192 if block >= 4096 else 2048) // block)) if whole else 1
        warps = min(32, 2 * warps_for(block, element_size, lo=2))
        cfg = {"ROWS": rows, "num_warps": warps, "PROGRAMS_PER_SM": 2, "PREFETCH": 0}
    return tuned("rms_norm_bwd", {"BLOCK_N": block, **cfg})


def _launch_fwd(x2, weight, y2, rstd, eps, offset, casting) -> None:
    n_rows, n_cols = x2.shape
    cfg = fwd_config(n_cols, x2.element_size())
    block, rows = cfg["BLOCK_N"], cfg["ROWS"]
    launcher(_rms_norm_fwd_kernel)[(cdiv(n_rows, rows),)](
        x2, weight, y2, rstd, n_rows, n_cols, x2.stride(0), y2.stride(0), float(eps), float(offset),
        CASTING=casting, ROWS=rows, BLOCK_N=block, TILED=block < n_cols, num_warps=cfg["num_warps"],
    )  # fmt: skip


def _launch_bwd(dy2, x2, weight, rstd, dx2, offset, casting) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------------------
# torch.library ops (namespace lck::)
# ---------------------------------------------------------------------------------------------------------


def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rms_norm_inputs("lck::rms_norm_fwd", x, weight, eps, offset, casting_mode)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, y2 = rows_view("lck::rms_norm_fwd", "x", x), y.view(-1, x.shape[-1])
    rstd = torch.empty((x2.shape[0],), dtype=torch.float32, device=x.device)
    if x2.shape[0] > 0:
        _launch_fwd(x2, weight, y2, rstd, eps, offset, CASTING_MODES.index(casting_mode))
    return y, rstd


def _fwd_fake(x, weight, eps, offset, casting_mode):
    _check_rms_norm_inputs("lck::rms_norm_fwd", x, weight, eps, offset, casting_mode)
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        (rows,), dtype=torch.float32
    )


_rms_norm_fwd = define_op("lck::rms_norm_fwd", _fwd_impl, fake=_fwd_fake)


def _bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "lck::rms_norm_bwd"
    _check_rms_norm_bwd_inputs(op, dy, x, weight, rstd, casting_mode)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rstd.shape[0] == 0:
        return dx, torch.zeros_like(weight)
    dw = _launch_bwd(
        rows_view(op, "dy", dy), rows_view(op, "x", x), weight, rstd, dx.view(-1, x.shape[-1]),
        offset, CASTING_MODES.index(casting_mode),
    )  # fmt: skip
    return dx, dw.to(weight.dtype)


def _bwd_fake(dy, x, weight, rstd, offset, casting_mode):
    _check_rms_norm_bwd_inputs("lck::rms_norm_bwd", dy, x, weight, rstd, casting_mode)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


_rms_norm_bwd = define_op("lck::rms_norm_bwd", _bwd_impl, fake=_bwd_fake)


def _bwd_inplace_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> torch.Tensor:
    """Writes ``dx`` into ``dy`` (which must not have overlapping rows); returns ``dweight``."""
    op = "lck::rms_norm_bwd_"
    _check_rms_norm_bwd_inputs(op, dy, x, weight, rstd, casting_mode)
    dy2 = rows_view(op, "dy", dy)
    if dy2.shape[0] > 1 and dy2.stride(0) < dy2.shape[1]:
        raise ValueError(
            f"{op}: dy rows overlap (row stride {dy2.stride(0)} < {dy2.shape[1]}); cannot write dx into it"
        )
    if rstd.shape[0] == 0:
        return torch.zeros_like(weight)
    dw = _launch_bwd(dy2, rows_view(op, "x", x), weight, rstd, dy2, offset, CASTING_MODES.index(casting_mode))
    return dw.to(weight.dtype)


def _bwd_inplace_fake(dy, x, weight, rstd, offset, casting_mode):
    _check_rms_norm_bwd_inputs("lck::rms_norm_bwd_", dy, x, weight, rstd, casting_mode)
    return torch.empty_like(weight)


_rms_norm_bwd_ = define_op(
    "lck::rms_norm_bwd_", _bwd_inplace_impl, mutates_args=("dy",), fake=_bwd_inplace_fake
)


# ---------------------------------------------------------------------------------------------------------
# Autograd, functional API, module
# ---------------------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """Autograd wiring of ``lck::rms_norm_fwd`` / ``lck::rms_norm_bwd`` (``_bwd_`` when ``in_place``)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place):
        y, rstd = _rms_norm_fwd(x, weight, eps, offset, casting_mode)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if not dy.is_contiguous():  # e.g. an expanded gradient of a sum: give the kernel real rows
            dy = dy.contiguous()
        if ctx.in_place:
            dw = _rms_norm_bwd_(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
            dx = dy
        else:
            dx, dw = _rms_norm_bwd(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale by ``offset + weight``.

    Args:
        x: ``[..., hidden]`` float32/float16/bfloat16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``); its
            leading dimensions must collapse into rows without a copy (contiguous, or a column slice).
        weight: ``[hidden]`` contiguous float tensor on ``x``'s device (any of the three float dtypes).
        eps: added to the mean square before the reciprocal square root (finite, ≥ 0).
        offset: added to ``weight`` (Gemma uses 1.0 with a zero-initialised weight).
        casting_mode: ``"llama"``, ``"gemma"`` or ``"none"`` (module docstring says exactly what each rounds).
        in_place: write ``dx`` into the incoming gradient's buffer in backward (see the module docstring
            for when that is unsafe).

    Returns ``y`` with ``x``'s shape and dtype (contiguous). Differentiable in ``x`` and ``weight``.
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong dtype, device, shape or stride.
    """
    _check_rms_norm_inputs("rms_norm", x, weight, eps, offset, casting_mode)
    if not isinstance(in_place, bool):
        raise TypeError(f"rms_norm: in_place must be a bool, got {type(in_place).__name__}")
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), casting_mode, in_place)


class LckRMSNorm(torch.nn.Module):
    """RMSNorm layer: ``rms_norm(x, self.weight, eps, offset, casting_mode, in_place)``.

    ``weight`` is ``[hidden_size]``, filled with ``init`` (1.0 for Llama; 0.0 with ``offset=1.0`` for Gemma).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        in_place: bool = False,
        init: float = 1.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"LckRMSNorm: hidden_size must be a positive int, got {hidden_size!r}")
        check_choice("LckRMSNorm", "casting_mode", casting_mode, CASTING_MODES)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"LckRMSNorm: dtype must be float32, float16 or bfloat16, got {dtype}")
        self.hidden_size, self.eps, self.offset = hidden_size, float(eps), float(offset)
        self.casting_mode, self.in_place = casting_mode, bool(in_place)
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), float(init), device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, self.casting_mode, self.in_place)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, "
            f"casting_mode={self.casting_mode!r}, in_place={self.in_place}"
        )
