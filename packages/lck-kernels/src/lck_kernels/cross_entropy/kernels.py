"""Triton kernels for cross entropy over rows of logits, shared by ``cross_entropy`` and the fused linear ops.

They are built from the row passes of ``rows.py`` (statistics, gradient, coefficients):

- ``_ce_reduction_kernel`` (one program): the mean's denominators on device, without a host sync:
  ``[Σ w_t, n_valid, cw, cz, Σ_c w_c]`` over non-ignored rows (``cw = 1/Σ w_t`` and ``cz = 1/n_valid`` for
  ``mean``, else 1), the same normalisation as ``torch.nn.functional.cross_entropy``.
- ``_ce_finalize_kernel`` (one program): the ``sum``/``mean`` loss and z-loss from the per-row terms.
- ``_ce_fwd_kernel``: per row, stats → cross-entropy term, z-loss term, lse (and entropy); with ``GRAD`` a
  second pass writes the gradient right away, meant to re-read the row from L2. Measured on an H200 at
  8192 × 128256 bf16, one program per SM reading 256 KiB rows puts ~33 MiB of reads, plus the streamed
  gradient, between a tile's two reads, close to the 50 MiB L2, so only part of the re-read hits.
  ``REVERSE`` (tuning key ``reverse``) walks the second pass last tile first, so the tiles read most
  recently come first; measured, it was slower (1.60 ms against 1.51 ms on an H200, 2026-11-30), so it is off.
- ``_ce_fwd_split_kernel`` (``split.py``): the same with each row split over a team of programs.
- ``_ce_bwd_kernel``: the gradient from a saved lse (and entropy) and per-row upstream gradients: the
  recompute path of the fused linear ops.
- ``_ce_rescale_rows_kernel``, ``_rescale_factor_kernel`` + ``_rescale_kernel``: the backward of a
  gradient computed in the forward. Each buffer carries the factor already applied (1 after the forward),
  so a backward multiplies by ``g / applied``: with the usual ``g == 1`` the programs exit at once (a launch,
  not a pass over gigabytes, and no host sync), and a second backward (``retain_graph=True``) with the same
  ``g`` is a no-op instead of scaling twice. In the rows kernel every warp of a program reads a row's
  ``applied`` before one of them writes it back (a barrier per row): without it, a warp that was done
  with a row early updated ``applied`` before a lagging warp had read it, and the lagging warp left its
  share of the row unscaled (17 of 300 calls at 8192 × 128256 on an H200, 2026-12-01).

``launch.ce_launch_config`` picks tiles, warps, grids and switches from the measured defaults (``_DEFAULTS``,
overridable through ``lck_kernels._common.tuning``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lck_kernels.cross_entropy.rows import (
    _ce_coefficients,
    _ce_row_grad,
    _ce_row_stats,
    _ce_store_row,
    _ce_target,
    _f32,
)


@triton.jit
def _ce_reduction_kernel(
    target_ptr,
    weight_ptr,
    red_ptr,
    n_rows,
    n_cols,
    ignore_index,
    MEAN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    count = tl.zeros((), tl.int32)  # integer: exact at any token count
    dw = tl.zeros((), tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        mask = rows < n_rows
        t = tl.load(target_ptr + rows, mask=mask, other=0).to(tl.int64)
        valid = mask & (t != ignore_index)
        count += tl.sum(valid.to(tl.int32), 0)
        if HAS_WEIGHT:
            ok = valid & (t >= 0) & (t < n_cols)
            dw += tl.sum(tl.load(weight_ptr + tl.where(ok, t, 0), mask=ok, other=0.0).to(tl.float32), 0)
    n_valid = count.to(tl.float32)
    if HAS_WEIGHT:
        wsum = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            wsum += tl.sum(tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32), 0)
    else:
        dw = n_valid
        wsum = n_cols * 1.0
    tl.store(red_ptr + 0, dw)
    tl.store(red_ptr + 1, n_valid)
    if MEAN:  # 0/0 when every target is ignored: the loss is NaN, as in torch; gradient rows stay 0
        tl.store(red_ptr + 2, 1.0 / dw)
        tl.store(red_ptr + 3, 1.0 / n_valid)
    else:
        tl.store(red_ptr + 2, 1.0)
        tl.store(red_ptr + 3, 1.0)
    tl.store(red_ptr + 4, wsum)


@triton.jit
def _ce_finalize_kernel(
    ce_ptr,
    z_rows_ptr,
    red_ptr,
    loss_ptr,
    z_ptr,
    n_rows,
    MEAN: tl.constexpr,
    HAS_Z: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program, a fixed summation order: the reduced loss and z-loss in one launch instead of a sum, a
    # division and a fill per term (host cost: issue 28), the same bits on every call.
    acc = tl.zeros((BLOCK,), tl.float32)
    z_acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        mask = rows < n_rows
        acc += tl.load(ce_ptr + rows, mask=mask, other=0.0)
        if HAS_Z:
            z_acc += tl.load(z_rows_ptr + rows, mask=mask, other=0.0)
    total = tl.sum(acc, 0)
    if MEAN:  # 0/0 when every target is ignored: NaN, as torch
        total = total / tl.load(red_ptr + 0)
    if HAS_Z:
        z = tl.sum(z_acc, 0)
        if MEAN:
            z = z / tl.load(red_ptr + 1)
        tl.store(loss_ptr, total + z)
        tl.store(z_ptr, z)
    else:
        tl.store(loss_ptr, total)
        tl.store(z_ptr, 0.0)


@triton.jit
def _ce_fwd_kernel(
    x_ptr,
    x_stride,
    grad_ptr,
    grad_stride,
    target_ptr,
    weight_ptr,
    red_ptr,
    loss_ptr,
    zloss_ptr,
    lse_ptr,
    ent_ptr,
    applied_ptr,
    n_rows,
    n_cols,
    ignore_index,
    eps,
    z_scale,
    scale,
    softcap,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    GRAD: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    REVERSE: tl.constexpr,
    GRAD_AHEAD: tl.constexpr,
    WARP_MAX: tl.constexpr,
):
    eps, z_scale, scale, softcap = _f32(eps), _f32(z_scale), _f32(scale), _f32(softcap)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wsum = tl.load(red_ptr + 4)
    cw = tl.load(red_ptr + 2)
    cz = tl.load(red_ptr + 3)
    for row in range(pid, n_rows, nprog):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * x_stride
        valid, in_range, t_local, w_t = _ce_target(
            target_ptr, row64, weight_ptr, n_cols, ignore_index, HAS_WEIGHT
        )
        m, s, q, sw, zt = _ce_row_stats(
            x_row, n_cols, t_local, weight_ptr, scale, softcap,
            BLOCK, HAS_WEIGHT, SMOOTH, HAS_SOFTCAP, ENTROPY, EVICT, NUM_STAGES, PREFETCH, WARP_MAX,
        )  # fmt: skip
        lse = m + tl.log(s)
        _ce_store_row(
            row64, True, valid, in_range, w_t, lse, q / s, sw, zt, wsum, n_cols, eps, z_scale,
            loss_ptr, zloss_ptr, lse_ptr, ent_ptr, SMOOTH, HAS_Z, ENTROPY,
        )  # fmt: skip
        if GRAD:
            coef_p, coef_t, coef_w = _ce_coefficients(
                valid, in_range, w_t, lse, cw, cz, 0.0, n_cols, wsum, eps, z_scale, HAS_Z
            )
            _ce_row_grad(
                x_row, grad_ptr + row64 * grad_stride, n_cols, t_local, weight_ptr, scale, softcap,
                lse, 0.0, coef_p, coef_t, coef_w, 0.0,
                BLOCK, HAS_WEIGHT, SMOOTH, HAS_SOFTCAP, False, EVICT, NUM_STAGES, REVERSE, GRAD_AHEAD,
            )  # fmt: skip
            tl.store(applied_ptr + row64, 1.0)


@triton.jit
def _ce_bwd_kernel(
    x_ptr,
    x_stride,
    grad_ptr,
    grad_stride,
    target_ptr,
    weight_ptr,
    red_ptr,
    lse_ptr,
    ent_ptr,
    g_loss_ptr,
    g_loss_stride,
    g_lse_ptr,
    g_lse_stride,
    g_ent_ptr,
    g_ent_stride,
    n_rows,
    n_cols,
    ignore_index,
    eps,
    z_scale,
    scale,
    softcap,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_G_LOSS: tl.constexpr,
    HAS_G_LSE: tl.constexpr,
    HAS_G_ENT: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    eps, z_scale, scale, softcap = _f32(eps), _f32(z_scale), _f32(scale), _f32(softcap)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wsum = tl.load(red_ptr + 4)
    red_w = tl.load(red_ptr + 2)
    red_z = tl.load(red_ptr + 3)
    for row in range(pid, n_rows, nprog):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * x_stride
        valid, in_range, t_local, w_t = _ce_target(
            target_ptr, row64, weight_ptr, n_cols, ignore_index, HAS_WEIGHT
        )
        lse = tl.load(lse_ptr + row64)
        g = tl.zeros((), tl.float32)
        gl = tl.zeros((), tl.float32)
        ge = tl.zeros((), tl.float32)
        ez = tl.zeros((), tl.float32)
        if HAS_G_LOSS:
            g = tl.load(g_loss_ptr + row64 * g_loss_stride).to(tl.float32)
        if HAS_G_LSE:
            gl = tl.load(g_lse_ptr + row64 * g_lse_stride).to(tl.float32)
        if HAS_G_ENT:
            ge = tl.load(g_ent_ptr + row64 * g_ent_stride).to(tl.float32)
            ez = lse - tl.load(ent_ptr + row64)  # E_p[z] = lse - H
        coef_p, coef_t, coef_w = _ce_coefficients(
            valid, in_range, w_t, lse, g * red_w, g * red_z, gl, n_cols, wsum, eps, z_scale, HAS_Z
        )
        _ce_row_grad(
            x_row, grad_ptr + row64 * grad_stride, n_cols, t_local, weight_ptr, scale, softcap,
            lse, ez, coef_p, coef_t, coef_w, ge,
            BLOCK, HAS_WEIGHT, SMOOTH, HAS_SOFTCAP, HAS_G_ENT, EVICT, NUM_STAGES, False, False,
        )  # fmt: skip


@triton.jit
def _ce_rescale_rows_kernel(
    grad_ptr, grad_stride, applied_ptr, g_ptr, g_stride, n_rows, n_cols, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, n_rows, nprog):
        row64 = tl.cast(row, tl.int64)
        g = tl.load(g_ptr + row64 * g_stride).to(tl.float32)
        a = tl.load(applied_ptr + row64)
        if g != a:  # the common g == 1 costs one load per row
            f = g / a
            g_row = grad_ptr + row64 * grad_stride
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                v = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(g_row + cols, (v * f).to(grad_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # every warp has read this row's `applied` before it changes (module docstring)
        if g != a:
            tl.store(applied_ptr + row64, g)


@triton.jit
def _rescale_factor_kernel(g_ptr, applied_ptr, factor_ptr):
    g = tl.load(g_ptr).to(tl.float32)
    a = tl.load(applied_ptr)
    tl.store(factor_ptr, tl.where(g == a, 1.0, g / a))
    tl.store(applied_ptr, g)


@triton.jit
def _rescale_kernel(ptr, n, n_blocks, factor_ptr, BLOCK: tl.constexpr):
    f = tl.load(factor_ptr)
    if f != 1.0:
        # Block indices stay int32 (n_blocks is small); element offsets are int64 (n may pass 2^31).
        for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            offs = tl.cast(b, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptr + offs, (v * f).to(ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Measured launch defaults (``launch.ce_launch_config`` turns them into a launch; overridable through
# lck_kernels._common.tuning(...))
# ---------------------------------------------------------------------------------------------------------

# Tuning keys: "cross_entropy_fwd" (loss only: one read), "cross_entropy_fwd_grad" (loss and gradient in
# one kernel: read, re-read from L2, write), "cross_entropy_bwd" (gradient from a saved lse).
# block_bytes: bytes of a row per tile (capped by the row); warps: warps per program; programs_per_sm: a
# persistent grid of that many programs per SM, 0 for one program per row (one team per row when split);
# evict: L2 eviction hints; stages: software-pipelining depth of the row loops (1 = none); prefetch: load the
# next tile of the statistics pass before reducing the current one (kernels with a statistics pass only);
# split: programs per row in the loss+gradient kernel (1 = one program reads the whole row twice; 2, 4 or 8 =
# ``_ce_fwd_split_kernel``, each program of a team reads and writes a contiguous slice of the row).
# Defaults measured on an H200 at 8192 x 128256 bf16 (benchmarks/tune_cross_entropy.py, 2026-11-30).
_DEFAULTS = {
    # One read per element: small programs, many per SM, so that one's reduction overlaps the others'
    # loads, with maxima per warp-wide strip (H200, 2026-11-30, 8192 x 128256 bf16: 0.527 ms, 94% of the
    # copy rate, against 0.545 for per-tile maxima at 4 KiB tiles x 4 warps and 0.558 at 8 KiB x 8).
    "cross_entropy_fwd": {
        "block_bytes": 4096, "warps": 8, "programs_per_sm": 0, "evict": 0, "stages": 1, "prefetch": 1,
        "warp_max": 1,
    },
    # 32 KiB tiles, 1024 threads (one program per SM: the fewest rows in flight, so more of the second
    # read hits L2), the next tile loaded before the current one is used in both passes, eviction hints,
    # maxima per warp-wide strip. H200, 2026-11-30, 8192 x 128256 bf16: 1.29 ms (77% of the copy rate
    # counted as one read and one write; the whole cross_entropy fwd+bwd 1.296-1.307 ms) against 1.35-1.45
    # for per-tile maxima, whose block-wide reduction per tile (a barrier every 16 elements per thread) paced
    # the program. Measured slower (ms, most before warp_max): reverse 1.60 (1.45 with warp_max), split 2/4
    # 1.84/2.40, sm_pct 75/50 1.88/2.76 (90: 1.35 with warp_max), prefetch 2 1.69, smaller or larger tiles
    # 1.42-2.52, two 512-thread programs per SM 1.64, no eviction hints 1.52, writing the target column
    # after the tiles instead of a select per element 1.289 against 1.288, the next row's first tile loaded
    # during the current row 1.314 against 1.295 (both removed).
    "cross_entropy_fwd_grad": {
        "block_bytes": 32768, "warps": 32, "programs_per_sm": 0, "evict": 1, "stages": 1, "prefetch": 1,
        "split": 1, "reverse": 0, "sm_pct": 100, "grad_ahead": 1, "warp_max": 1,
        # cuda 1: the CUDA cluster kernel (cuda.py, csrc/ce_fwd_grad.cu) runs instead where it
        # applies; cluster: blocks per row (0: the smallest of 2/4/8 whose slice fits shared memory three
        # times); threads per block. It moves two passes of HBM traffic instead of three but was slower on an
        # H200 (2026-11-30, 8192 x 128256 bf16: 1.64 ms at 4 x 1024, 1.74 at 8 x 512, against 1.43 for this
        # Triton kernel; 30 clusters of 4 fit, so 120 of 132 SMs work), so it is off.
        "cuda": 0, "cluster": 0, "threads": 1024,
    },
    # One read and one write per element (1.05 ms, 94% of the copy rate).
    "cross_entropy_bwd": {
        "block_bytes": 16384, "warps": 16, "programs_per_sm": 0, "evict": 0, "stages": 1, "prefetch": 0,
    },
}  # fmt: skip
