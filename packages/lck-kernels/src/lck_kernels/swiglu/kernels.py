"""Triton kernels of SwiGLU, shared by both forms (two tensors, and one packed gate-up buffer).

They work on 2-D tiles ``[BLOCK_M, BLOCK_N]`` of the ``[rows, n]`` problem, with int64 row offsets (3-D
activations can exceed 2**31 elements). Launch configuration and launches: ``launch.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------
# fmt: off


@triton.jit
def _tile(pid, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows (int64), columns and mask of tile ``pid``; tiles run along a row first, then down the rows."""
    n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid_m = pid // n_col_blocks
    pid_n = pid - pid_m * n_col_blocks
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _swiglu_fwd_kernel(
    a_ptr, b_ptr, c_ptr, n_rows, n_cols, stride_a, stride_b, stride_c, BLOCK_M: tl.constexpr, BLOCK_N:
    tl.constexpr,
):
    rows, cols, mask = _tile(tl.program_id(0), n_rows, n_cols, BLOCK_M, BLOCK_N)
    a = tl.load(a_ptr + rows * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    c = a * tl.sigmoid(a) * b
    tl.store(c_ptr + rows * stride_c + cols, c.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    a_ptr, b_ptr, dc_ptr, da_ptr, db_ptr, n_rows, n_cols, stride_a, stride_b, stride_dc, stride_da,
    stride_db, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``da``/``db`` may alias ``a``/``b`` (in-place packed backward): every element is loaded before it is
    stored by the same thread, and the launch config never replicates elements across threads."""
    rows, cols, mask = _tile(tl.program_id(0), n_rows, n_cols, BLOCK_M, BLOCK_N)
    a = tl.load(a_ptr + rows * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    dc = tl.load(dc_ptr + rows * stride_dc + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    db = dc * silu
    da = dc * b * (s + silu * (1.0 - s))
    tl.store(da_ptr + rows * stride_da + cols, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + rows * stride_db + cols, db.to(db_ptr.dtype.element_ty), mask=mask)


# fmt: on
