"""Triton kernels for cross entropy over rows of logits, shared by ``cross_entropy`` and the fused linear ops.

Every row's logits ``x`` enter as ``z = softcap · tanh(scale · x / softcap)`` (``scale`` is an inverse
temperature, 1 for plain cross entropy; the cap is optional). Two ``@triton.jit`` building blocks do the
work, and both take a row pointer, the row length, a *local* target index (−1 when the row's target is not
in the row) and scalars, so they apply unchanged to a vocabulary shard ``[vocab_start, vocab_start + n)``
(pass ``target − vocab_start``, or −1 when the target lies outside the shard):

- ``_ce_row_stats``: one streaming pass giving the running maximum ``m``, ``s = Σ exp(z − m)``,
  ``q = Σ exp(z − m)·z`` (entropy), ``Σ w·z`` (label smoothing, ``w`` the class weights or 1) and the
  target logit. ``lse = m + log s``; shards combine these by the usual max-rescaled sums. With ``WARP_MAX``
  (the default) each warp-wide strip of a tile keeps its own running maximum, so a tile costs warp shuffles
  instead of a block-wide reduction; the strips merge once per row.
- ``_ce_row_grad``: one pass that writes ``∂L/∂x`` given the row's lse (from the stats just computed, from
  a saved forward, or from an all-reduce over shards) and four per-row coefficients::

      ∂L/∂z_c = A·p_c − B·[c = t] − C·w_c + E·p_c·(E_p[z] − z_c),   p_c = exp(z_c − lse)

  then multiplies by the soft-cap derivative ``1 − (z_c/softcap)²`` and by ``scale``. For a row loss
  ``L = cw·ce + cz·ζ·lse² + gl·lse + ge·H`` with ``ce = (1−ε)·w_t·(lse − z_t) + (ε/V)·(W·lse − Σ w_c z_c)``
  (``W = Σ w_c``) this is ``A = cw·((1−ε)·w_t + ε·W/V) + 2·cz·ζ·lse + gl``, ``B = cw·(1−ε)·w_t``,
  ``C = cw·ε/V``, ``E = ge``.

Kernels built from them:

- ``_ce_reduction_kernel`` (one program): the mean's denominators on device, without a host sync:
  ``[Σ w_t, n_valid, cw, cz, Σ_c w_c]`` over non-ignored rows (``cw = 1/Σ w_t`` and ``cz = 1/n_valid`` for
  ``mean``, else 1), the same normalisation as ``torch.nn.functional.cross_entropy``.
- ``_ce_fwd_kernel``: per row, stats → cross-entropy term, z-loss term, lse (and entropy); with ``GRAD`` a
  second pass writes the gradient right away, meant to re-read the row from L2. Measured on an H200 at
  8192 × 128256 bf16, a forward second pass mostly does not: one program per SM reading 256 KiB rows puts
  ~33 MiB of reads, plus the streamed gradient, between a tile's two reads, close to the 50 MiB L2, and
  the oldest tile comes first. ``REVERSE`` (tuning key ``reverse``) walks the second pass last tile first,
  so the tiles read most recently come first; measured, it was slower (1.60 ms against 1.51 ms on an H200,
  2026-11-30), so it is off.
- ``_ce_fwd_split_kernel`` (tuning key ``split``): the same loss and gradient with each row split over a
  *team* of ``SPLIT`` consecutive programs, each owning a contiguous, tile-aligned slice of the columns.
  A member computes its slice's statistics, publishes them as one record in a small zero-filled buffer,
  waits for its partners' records, merges them (max-rescaled sums, as for vocabulary shards) into the row's
  lse, and writes the gradient of its own slice. The data between a slice's two reads shrinks by the team
  size (~8 MiB at 4), so the re-read can hit L2: two passes of HBM traffic instead of three. The records
  are written and polled with relaxed atomics (performed in L2; each word carries a ready bit and is
  written once per call, so no fences are needed); every program reads and overwrites only its own slice,
  so the gradient may overwrite the logits. Progress: team members are consecutive program ids, and every
  grid either fits the GPU at once (persistent) or leaves whole teams resident while the next wait for an
  SM; a team never spans more programs than SMs. A member whose partner never publishes (a scheduling
  fault) gives up after ``MAX_SPIN`` polls, raises an abort flag that ends every other wait, and writes
  NaN for its rows instead of hanging. The interpreter
  runs programs one after another, so there the kernel runs as two launches: ``PHASE`` 1 (statistics and
  records) then ``PHASE`` 2 (merge and gradient); on a GPU ``PHASE`` 0 does both in one launch.
- ``_ce_bwd_kernel``: the gradient from a saved lse (and entropy) and per-row upstream gradients: the
  recompute path of the fused linear ops.
- ``_ce_rescale_rows_kernel``, ``_rescale_factor_kernel`` + ``_rescale_kernel``: the backward of a
  gradient computed in the forward. Each buffer carries the factor already applied (1 after the forward),
  so a backward multiplies by ``g / applied``: with the usual ``g == 1`` the programs exit at once (a launch,
  not a pass over gigabytes, and no host sync), and a second backward (``retain_graph=True``) with the same
  ``g`` is a no-op instead of scaling twice.

Row offsets are int64: rows × vocabulary passes 2^31 at 8192 × 262144. Logits are read in their dtype and
never copied to float32; all arithmetic is float32.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from lck_kernels._common import next_power_of_2, num_sms, tuned


@triton.jit
def _f32(v):
    # Inductor launches user kernels with Python float arguments typed fp64 (a direct launch types them
    # fp32): every kernel casts its float scalars first, so the row math (and the types of its loop-carried
    # values) stays fp32 however the kernel is launched.
    return tl.cast(v, tl.float32)


@triton.jit
def _tanh(x):
    # exp-based: libdevice's tanh is not available in the interpreter; saturates exactly to ±1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _ce_logit(x, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    z = x.to(tl.float32) * scale
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    return z


@triton.jit
def _ce_logit2(x, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    # The logit in base 2, z·log2(e), for exp2: without a cap, log2(e) folds into the scale multiply the
    # logit needs anyway (exp would multiply by log2(e) again inside, one more op per element).
    if HAS_SOFTCAP:
        return _ce_logit(x, scale, softcap, HAS_SOFTCAP) * 1.4426950408889634
    return x.to(tl.float32) * (scale * 1.4426950408889634)


@triton.jit
def _ce_load_at(x_row, cols, n_cols, EVICT: tl.constexpr, OTHER: tl.constexpr):
    if EVICT:  # keep the row in L2 for the gradient pass that follows
        return tl.load(x_row + cols, mask=cols < n_cols, other=OTHER, eviction_policy="evict_last")
    return tl.load(x_row + cols, mask=cols < n_cols, other=OTHER)


@triton.jit
def _ce_load_tile(x_row, start, n_cols, BLOCK: tl.constexpr, EVICT: tl.constexpr, OTHER: tl.constexpr):
    return _ce_load_at(x_row, start + tl.arange(0, BLOCK), n_cols, EVICT, OTHER)


@triton.jit
def _ce_grad_tile(x_row, start, n_cols, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    # A tile of the gradient pass (the row's last use: streamed when EVICT); nothing outside [0, n_cols).
    cols = start + tl.arange(0, BLOCK)
    mask = (cols >= 0) & (cols < n_cols)
    if EVICT:
        return tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(x_row + cols, mask=mask, other=0.0)


@triton.jit
def _ce_row_stats(
    x_row,
    n_cols,
    t_local,
    w_ptr,
    scale,
    softcap,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    WARP_MAX: tl.constexpr,
):
    # WARP_MAX (tuning key warp_max): running maxima per warp-wide strip instead of per tile, so a tile
    # needs no block-wide reduction (no shared memory, no barrier); see _ce_row_stats_strips.
    if WARP_MAX:
        m, s, q, sw, zt = _ce_row_stats_strips(
            x_row, n_cols, t_local, w_ptr, scale, softcap,
            BLOCK, HAS_WEIGHT, SMOOTH, HAS_SOFTCAP, ENTROPY, EVICT, NUM_STAGES, PREFETCH,
        )  # fmt: skip
    else:
        m, s, q, sw, zt = _ce_row_stats_tiles(
            x_row, n_cols, t_local, w_ptr, scale, softcap,
            BLOCK, HAS_WEIGHT, SMOOTH, HAS_SOFTCAP, ENTROPY, EVICT, NUM_STAGES, PREFETCH,
        )  # fmt: skip
    return m, s, q, sw, zt


@triton.jit
def _ce_row_stats_strips(
    x_row,
    n_cols,
    t_local,
    w_ptr,
    scale,
    softcap,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # The tile as R strips of W columns, W = one warp's 16-byte loads (32 lanes x 16 B): Triton lays a
    # [R, W] tile out with whole strips per warp, so the per-strip maximum is a warp shuffle, not a
    # block-wide reduction through shared memory with a barrier. Each strip keeps its own running maximum;
    # the strips merge once per row (max-rescaled sums, as shards do). Same results as the per-tile form
    # up to float32 rounding of the sums.
    OTHER: tl.constexpr = 0.0 if HAS_SOFTCAP else float("-inf")
    BITS: tl.constexpr = x_row.dtype.element_ty.primitive_bitwidth
    W: tl.constexpr = BLOCK if BLOCK * BITS <= 4096 else 4096 // BITS
    R: tl.constexpr = BLOCK // W
    offs = tl.arange(0, R)[:, None] * W + tl.arange(0, W)[None, :]
    m = tl.full((R,), -3.0e38, tl.float32)
    s = tl.zeros((R, W), tl.float32)
    q = tl.zeros((R, W), tl.float32)
    sw = tl.zeros((), tl.float32)
    if PREFETCH >= 1:
        x_next = _ce_load_at(x_row, offs, n_cols, EVICT, OTHER)
    for start in tl.range(0, n_cols, BLOCK, num_stages=NUM_STAGES):
        cols = start + offs
        if PREFETCH >= 1:
            x = x_next
            x_next = _ce_load_at(x_row, cols + BLOCK, n_cols, EVICT, OTHER)
        else:
            x = _ce_load_at(x_row, cols, n_cols, EVICT, OTHER)
        z2 = _ce_logit2(x, scale, softcap, HAS_SOFTCAP)
        if HAS_SOFTCAP:
            z2 = tl.where(cols < n_cols, z2, float("-inf"))
        m_new = tl.maximum(m, tl.max(z2, 1))
        e = tl.exp2(z2 - m_new[:, None])
        alpha = tl.exp2(m - m_new)[:, None]
        s = s * alpha + e
        if ENTROPY:
            q = q * alpha + tl.where(e > 0.0, e * z2, 0.0)
        if SMOOTH:
            mask = cols < n_cols
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                sw += tl.sum(tl.sum(tl.where(mask, w * z2, 0.0), 1), 0)
            else:
                sw += tl.sum(tl.sum(tl.where(mask, z2, 0.0), 1), 0)
        m = m_new
    big_m = tl.max(m, 0)
    r = tl.exp2(m - big_m)
    has_t = t_local >= 0
    xt = tl.load(x_row + tl.where(has_t, t_local, 0), mask=has_t, other=0.0)
    zt = tl.where(has_t, _ce_logit(xt, scale, softcap, HAS_SOFTCAP), 0.0)
    ln2 = 0.6931471805599453
    s_all = tl.sum(tl.sum(s, 1) * r, 0)
    q_all = tl.sum(tl.sum(q, 1) * r, 0) * ln2
    return big_m * ln2, s_all, q_all, sw * ln2, zt


@triton.jit
def _ce_row_stats_tiles(
    x_row,
    n_cols,
    t_local,
    w_ptr,
    scale,
    softcap,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # One block-wide reduction per tile (the maximum): the exp sums stay per lane until the end of the
    # row, rescaled by a per-tile scalar. The smoothing sum is reduced per tile instead: a third per-lane
    # accumulator would spill registers at 32 warps. The loop works in base 2 (z2 = z·log2 e, m2, exp2),
    # and without a soft cap, lanes past the row end load as -inf, so no per-element select is needed:
    # the loop is close to ALU-bound at one row per program, and each op per element shows.
    # A finite start (not -inf), so a tile of -inf logits never computes (-inf) - (-inf). A literal rather
    # than a module constant: Inductor recompiles user kernels from source, globals included or not.
    OTHER: tl.constexpr = 0.0 if HAS_SOFTCAP else float("-inf")
    m = tl.full((), -3.0e38, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    q = tl.zeros((BLOCK,), tl.float32)
    sw = tl.zeros((), tl.float32)
    # PREFETCH tiles of look-ahead (0, 1 or 2): the next loads are in flight during this tile's reduction.
    if PREFETCH >= 1:
        x_next = _ce_load_tile(x_row, 0, n_cols, BLOCK, EVICT, OTHER)
    if PREFETCH >= 2:
        x_next2 = _ce_load_tile(x_row, BLOCK, n_cols, BLOCK, EVICT, OTHER)
    for start in tl.range(0, n_cols, BLOCK, num_stages=NUM_STAGES):
        cols = start + tl.arange(0, BLOCK)
        if PREFETCH >= 2:
            x = x_next
            x_next = x_next2
            x_next2 = _ce_load_tile(x_row, start + 2 * BLOCK, n_cols, BLOCK, EVICT, OTHER)
        elif PREFETCH == 1:
            x = x_next
            x_next = _ce_load_tile(x_row, start + BLOCK, n_cols, BLOCK, EVICT, OTHER)
        else:
            x = _ce_load_tile(x_row, start, n_cols, BLOCK, EVICT, OTHER)
        z2 = _ce_logit2(x, scale, softcap, HAS_SOFTCAP)
        if HAS_SOFTCAP:  # the cap maps -inf to -softcap: mask past the row end explicitly
            z2 = tl.where(cols < n_cols, z2, float("-inf"))
        m_new = tl.maximum(m, tl.max(z2, 0))
        e = tl.exp2(z2 - m_new)
        alpha = tl.exp2(m - m_new)
        s = s * alpha + e
        if ENTROPY:
            q = q * alpha + tl.where(e > 0.0, e * z2, 0.0)
        if SMOOTH:
            mask = cols < n_cols
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                sw += tl.sum(tl.where(mask, w * z2, 0.0), 0)
            else:
                sw += tl.sum(tl.where(mask, z2, 0.0), 0)
        m = m_new
    has_t = t_local >= 0
    xt = tl.load(x_row + tl.where(has_t, t_local, 0), mask=has_t, other=0.0)
    zt = tl.where(has_t, _ce_logit(xt, scale, softcap, HAS_SOFTCAP), 0.0)
    ln2 = 0.6931471805599453
    return m * ln2, tl.sum(s, 0), tl.sum(q, 0) * ln2, sw * ln2, zt


@triton.jit
def _ce_row_grad(
    x_row,
    g_row,
    n_cols,
    t_local,
    w_ptr,
    scale,
    softcap,
    lse,
    ez,
    coef_p,
    coef_t,
    coef_w,
    coef_e,
    BLOCK: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    REVERSE: tl.constexpr,
    AHEAD: tl.constexpr,
):
    # REVERSE walks the tiles last to first: right after a statistics pass over the same row, the tiles
    # read last are the likeliest still in L2, whereas a forward walk starts with the oldest. AHEAD loads
    # the next tile while this one is computed and stored. The coefficients absorb ``scale`` once per row
    # instead of a multiply per element.
    lse2 = lse * 1.4426950408889634  # base 2, as _ce_logit2
    coef_p, coef_t, coef_w, coef_e = coef_p * scale, coef_t * scale, coef_w * scale, coef_e * scale
    n_tiles = tl.cdiv(n_cols, BLOCK)
    if AHEAD:
        x_next = _ce_grad_tile(x_row, (n_tiles - 1) * BLOCK if REVERSE else 0, n_cols, BLOCK, EVICT)
    for i in tl.range(0, n_tiles, num_stages=NUM_STAGES):
        if REVERSE:
            start = (n_tiles - 1 - i) * BLOCK
            after = start - BLOCK
        else:
            start = i * BLOCK
            after = start + BLOCK
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        if AHEAD:
            x = x_next
            x_next = _ce_grad_tile(x_row, after, n_cols, BLOCK, EVICT)
        else:
            x = _ce_grad_tile(x_row, start, n_cols, BLOCK, EVICT)
        z2 = _ce_logit2(x, scale, softcap, HAS_SOFTCAP)
        p = tl.exp2(z2 - lse2)
        d = p * coef_p
        if ENTROPY or HAS_SOFTCAP:
            z = z2 * 0.6931471805599453
        if ENTROPY:
            d += tl.where(p > 0.0, coef_e * p * (ez - z), 0.0)
        if SMOOTH:
            if HAS_WEIGHT:
                d -= coef_w * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                d -= coef_w
        d = tl.where(cols == t_local, d - coef_t, d)
        if HAS_SOFTCAP:
            r = z / softcap
            d = d * (1.0 - r * r)
        d = d.to(g_row.dtype.element_ty)
        if EVICT:
            tl.store(g_row + cols, d, mask=mask, eviction_policy="evict_first")
        else:
            tl.store(g_row + cols, d, mask=mask)


@triton.jit
def _ce_target(target_ptr, row, weight_ptr, n_cols, ignore_index, HAS_WEIGHT: tl.constexpr):
    """(valid, in_range, local target index or -1, class weight of the target)."""
    t = tl.load(target_ptr + row).to(tl.int64)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < n_cols)
    has_t = valid & in_range
    t_local = tl.where(has_t, t, -1)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + tl.where(has_t, t, 0), mask=has_t, other=0.0).to(tl.float32)
    else:
        w_t = tl.where(has_t, 1.0, 0.0)
    return valid, in_range, t_local, w_t


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
def _ce_coefficients(valid, in_range, w_t, lse, cw, cz, gl, n_cols, wsum, eps, z_scale, HAS_Z: tl.constexpr):
    """(A, B, C) of the module docstring; NaN for a target outside [0, n_cols) that is not ignored."""
    coef_t = tl.where(valid, cw * (1.0 - eps) * w_t, 0.0)  # cw is inf when every target is ignored
    coef_w = tl.where(valid, cw * eps / n_cols, 0.0)
    coef_p = coef_t + coef_w * wsum + gl
    if HAS_Z:
        coef_p += tl.where(valid, cz * 2.0 * z_scale * lse, 0.0)
    coef_p = tl.where(valid & (in_range == 0), float("nan"), coef_p)
    return coef_p, coef_t, coef_w


@triton.jit
def _ce_store_row(
    row64, lead, valid, in_range, w_t, lse, ez, sw, zt, wsum, n_cols, eps, z_scale,
    loss_ptr, zloss_ptr, lse_ptr, ent_ptr,
    SMOOTH: tl.constexpr, HAS_Z: tl.constexpr, ENTROPY: tl.constexpr,
):  # fmt: skip
    """The row's loss terms, lse and entropy (``ez = E_p[z]``) from its statistics; stored where ``lead``."""
    ce = (1.0 - eps) * w_t * (lse - zt)
    if SMOOTH:
        ce += eps / n_cols * (wsum * lse - sw)
    ce = tl.where(valid, tl.where(in_range, ce, float("nan")), 0.0)
    tl.store(loss_ptr + row64, ce, mask=lead)
    tl.store(lse_ptr + row64, lse, mask=lead)
    if HAS_Z:
        tl.store(zloss_ptr + row64, tl.where(valid, z_scale * lse * lse, 0.0), mask=lead)
    if ENTROPY:
        tl.store(ent_ptr + row64, lse - ez, mask=lead)


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
def _ce_pack(v):
    # float32 bits in the low word, a ready flag in bit 32: the zero-filled record reads "not ready"
    return (v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | (1 << 32)


@triton.jit
def _ce_unpack(w):
    return (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _ce_fwd_split_kernel(
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
    part_ptr,
    n_rows,
    n_cols,
    chunk,
    ignore_index,
    eps,
    z_scale,
    scale,
    softcap,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    PHASE: tl.constexpr,
    MAX_SPIN: tl.constexpr,
    WARP_MAX: tl.constexpr,
):
    """Loss and gradient with each row split over a team of ``SPLIT`` programs (see the module docstring)."""
    eps, z_scale, scale, softcap = _f32(eps), _f32(z_scale), _f32(scale), _f32(softcap)
    pid = tl.program_id(0)
    member = pid % SPLIT
    team = pid // SPLIT
    n_teams = tl.num_programs(0) // SPLIT
    c0 = member * chunk
    c_len = tl.maximum(tl.minimum(chunk, n_cols - c0), 0)
    lead = member == 0
    wsum = tl.load(red_ptr + 4)
    cw = tl.load(red_ptr + 2)
    cz = tl.load(red_ptr + 3)
    # A record per (row, member): 8 int64 words, fields m, s, q, Σw·z, z_t in the first 5. The word after
    # the last record is the abort flag; each poll reads it in lane 7 alongside the team's records.
    lane = tl.arange(0, 8)
    lanes = tl.arange(0, SPLIT * 8)
    used = (lanes % 8) < 5
    polled = used | (lanes == 7)
    abort_ptr = part_ptr + tl.cast(n_rows, tl.int64) * (SPLIT * 8)
    for row in range(team, n_rows, n_teams):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * x_stride
        valid, in_range, t_local, w_t = _ce_target(
            target_ptr, row64, weight_ptr, n_cols, ignore_index, HAS_WEIGHT
        )
        t_chunk = tl.where((t_local >= c0) & (t_local < c0 + c_len), t_local - c0, -1)
        records = part_ptr + row64 * (SPLIT * 8)
        if PHASE != 2:
            m, s, q, sw, zt = _ce_row_stats(
                x_row + c0, c_len, t_chunk, weight_ptr + c0, scale, softcap,
                BLOCK, HAS_WEIGHT, SMOOTH, HAS_SOFTCAP, ENTROPY, EVICT, NUM_STAGES, PREFETCH, WARP_MAX,
            )  # fmt: skip
            v = tl.where(
                lane == 0, m, tl.where(lane == 1, s, tl.where(lane == 2, q, tl.where(lane == 3, sw, zt)))
            )
            # Relaxed atomics, performed in L2 where every SM sees them: each word is written once per call and
            # read until its ready flag shows, so no fence orders them (and repeating one is harmless).
            tl.atomic_xchg(records + member * 8 + lane, _ce_pack(v), mask=lane < 5, sem="relaxed")
        if PHASE != 1:
            poll = tl.where(lanes == 7, abort_ptr, records + lanes)
            words = tl.atomic_add(poll, 0, mask=polled, sem="relaxed")
            if PHASE == 0:  # the team's other members publish concurrently: wait for their records
                spins = 0
                while (
                    (tl.min(tl.where(used, words >> 32, 1), 0) == 0)
                    & (tl.max(tl.where(lanes == 7, words, 0), 0) == 0)
                    & (spins < MAX_SPIN)
                ):
                    words = tl.atomic_add(poll, 0, mask=polled, sem="relaxed")
                    spins += 1
            ready = tl.min(tl.where(used, words >> 32, 1), 0) == 1
            if PHASE == 0:  # give up on every later wait too: one bounded stall, then NaN, never a hang
                tl.atomic_xchg(abort_ptr, 1, mask=ready == 0, sem="relaxed")
            vals = tl.reshape(_ce_unpack(tl.where(used, words, 0)), (SPLIT, 8))
            field = tl.arange(0, 8)[None, :]
            pm = tl.sum(tl.where(field == 0, vals, 0.0), 1)
            big_m = tl.max(pm, 0)
            f = tl.exp(pm - big_m)
            s_all = tl.sum(tl.sum(tl.where(field == 1, vals, 0.0), 1) * f, 0)
            q_all = tl.sum(tl.sum(tl.where(field == 2, vals, 0.0), 1) * f, 0)
            sw_all = tl.sum(tl.sum(tl.where(field == 3, vals, 0.0), 1), 0)
            zt_all = tl.sum(tl.sum(tl.where(field == 4, vals, 0.0), 1), 0)
            # A team member that never published (a scheduling fault): NaN for the row, never a hang.
            lse = tl.where(ready, big_m + tl.log(s_all), float("nan"))
            _ce_store_row(
                row64, lead, valid, in_range, w_t, lse, q_all / s_all, sw_all, zt_all, wsum, n_cols, eps,
                z_scale, loss_ptr, zloss_ptr, lse_ptr, ent_ptr, SMOOTH, HAS_Z, ENTROPY,
            )  # fmt: skip
            coef_p, coef_t, coef_w = _ce_coefficients(
                valid, in_range, w_t, lse, cw, cz, 0.0, n_cols, wsum, eps, z_scale, HAS_Z
            )
            _ce_row_grad(
                x_row + c0, grad_ptr + row64 * grad_stride + c0, c_len, t_chunk, weight_ptr + c0, scale,
                softcap, lse, 0.0, coef_p, coef_t, coef_w, 0.0,
                BLOCK, HAS_WEIGHT, SMOOTH, HAS_SOFTCAP, False, EVICT, NUM_STAGES, False, False,
            )  # fmt: skip
            tl.store(applied_ptr + row64, 1.0, mask=lead)


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
# Launch configuration: small pure functions, overridable through lck_kernels._common.tuning(...)
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
        # cuda 1: the CUDA cluster kernel (_cross_entropy_cuda, csrc/ce_fwd_grad.cu) runs instead where it
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
_ELEMENTS_PER_THREAD_FLOOR = 8  # fewer warps for short rows: at least this many elements per thread
MAX_SPLIT = 8
# Polls of a team's records before the split kernel gives up (NaN rows) instead of hanging: each poll is an
# L2 round trip (~1 µs), so about a second, far beyond the wait for a partner program to get an SM (at most
# another team's share of the rows, unless kernels on other streams hold SMs that long). The first program
# to give up raises the abort flag, so every later wait ends at once: the stall is bounded once per launch.
MAX_SPIN = 1 << 20


def _floor_power_of_2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def ce_launch_config(
    kernel: str, n_rows: int, n_cols: int, element_size: int, device: torch.device
) -> dict[str, Any]:
    """Tile width, warps, grid size and constexpr switches for one of the row kernels.

    The tile is ``block_bytes`` of logits (so fp32 rows take half the elements of bf16 rows), capped by
    the row length; warps shrink for short rows. The grid is ``programs_per_sm × SMs`` (a persistent grid) or one
    program per row, never more programs than rows. With ``split`` > 1 (loss+gradient kernel only) each row
    goes to a team of ``SPLIT`` consecutive programs (a power of two, at most the row's tiles and 8), each
    owning ``CHUNK`` columns (whole tiles); the grid is a whole number of teams, at most one per row.
    """
    cfg = tuned(kernel, dict(_DEFAULTS[kernel]))
    block = next_power_of_2(max(16, cfg["block_bytes"] // max(element_size, 1)))
    block = min(block, max(16, next_power_of_2(n_cols)))
    warps = next_power_of_2(max(1, min(cfg["warps"], block // (32 * _ELEMENTS_PER_THREAD_FLOOR))))
    per_sm = cfg["programs_per_sm"]
    sms = num_sms(device)
    tiles = triton.cdiv(n_cols, block)
    split = min(_floor_power_of_2(cfg.get("split", 1)), _floor_power_of_2(tiles), MAX_SPLIT)
    split = min(split, _floor_power_of_2(sms))  # a team must fit the GPU at once
    # sm_pct < 100 (persistent grids only): fewer programs than SMs, so fewer rows in flight between a tile's
    # two reads (a smaller L2 working set) at the price of fewer SMs streaming.
    pct = max(1, min(100, cfg.get("sm_pct", 100)))
    teams = n_rows if per_sm <= 0 else min(n_rows, max(1, per_sm * sms * pct // 100 // split))
    return {
        "BLOCK": block,
        "num_warps": warps,
        "grid": (max(1, teams) * split,),
        "EVICT": bool(cfg["evict"]),
        "NUM_STAGES": max(1, cfg["stages"]),
        "PREFETCH": max(0, min(2, int(cfg.get("prefetch", 0)))),
        "SPLIT": split,
        "CHUNK": triton.cdiv(tiles, split) * block,
        "REVERSE": bool(cfg.get("reverse", 0)),
        "GRAD_AHEAD": bool(cfg.get("grad_ahead", 0)),
        "WARP_MAX": bool(cfg.get("warp_max", 0)),
    }


def rescale_grid(n: int, block: int, device: torch.device) -> tuple[int]:
    """A persistent grid for the flat rescale: a few programs per SM, each striding over ``n``."""
    return (max(1, min(triton.cdiv(n, block), 8 * num_sms(device))),)
