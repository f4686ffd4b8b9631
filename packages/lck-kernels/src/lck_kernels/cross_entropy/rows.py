"""The row passes the cross-entropy kernels are built from (``@triton.jit`` functions, no kernels).

Every row's logits ``x`` enter as ``z = softcap · tanh(scale · x / softcap)`` (``scale`` is an inverse
temperature, 1 for plain cross entropy; the cap is optional). Two building blocks do the work, and both
take a row pointer, the row length, a *local* target index (−1 when the row's target is not in the row)
and scalars, so they apply unchanged to a vocabulary shard ``[vocab_start, vocab_start + n)`` (pass
``target − vocab_start``, or −1 when the target lies outside the shard):

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
  ``C = cw·ε/V``, ``E = ge`` (``_ce_coefficients``; ``_ce_store_row`` writes a row's loss terms).

Row offsets are int64: rows × vocabulary passes 2^31 at 8192 × 262144. Logits are read in their dtype and
never copied to float32; all arithmetic is float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _ce_load_stats_tile(x_row, cols, n_cols, EVICT: tl.constexpr, OTHER: tl.constexpr):
    if EVICT:  # keep the row in L2 for the gradient pass that follows
        return tl.load(x_row + cols, mask=cols < n_cols, other=OTHER, eviction_policy="evict_last")
    return tl.load(x_row + cols, mask=cols < n_cols, other=OTHER)


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
    # A tile is R strips of W columns, each strip with its own running maximum; the strips merge once per
    # row (max-rescaled sums, as shards do). WARP_MAX (tuning key warp_max): W = one warp's 16-byte loads
    # (32 lanes x 16 B), and Triton lays the [R, W] tile out with whole strips per warp, so a strip's
    # maximum is a warp shuffle; otherwise one strip spans the tile, and its maximum is a block-wide
    # reduction (shared memory and a barrier) every tile. The exp sums stay per lane until the end of the
    # row. The smoothing sum is reduced per tile: a third per-lane accumulator would spill registers at 32
    # warps. The loop works in base 2 (z2 = z·log2 e, m2, exp2), and without a soft cap, lanes past the row
    # end load as -inf, so no per-element select is needed: the loop is close to ALU-bound at one row per
    # program, and each op per element shows. PREFETCH tiles of look-ahead (0, 1 or 2) are in flight while
    # a tile is reduced.
    # A finite start (not -inf), so a tile of -inf logits never computes (-inf) - (-inf). A literal rather
    # than a module constant: Inductor recompiles user kernels from source, globals included or not.
    OTHER: tl.constexpr = 0.0 if HAS_SOFTCAP else float("-inf")
    BITS: tl.constexpr = x_row.dtype.element_ty.primitive_bitwidth
    W: tl.constexpr = BLOCK if (not WARP_MAX) or BLOCK * BITS <= 4096 else 4096 // BITS
    R: tl.constexpr = BLOCK // W
    offs = tl.arange(0, R)[:, None] * W + tl.arange(0, W)[None, :]
    m = tl.full((R,), -3.0e38, tl.float32)
    s = tl.zeros((R, W), tl.float32)
    q = tl.zeros((R, W), tl.float32)
    sw = tl.zeros((), tl.float32)
    if PREFETCH >= 1:
        x_next = _ce_load_stats_tile(x_row, offs, n_cols, EVICT, OTHER)
    if PREFETCH >= 2:
        x_next2 = _ce_load_stats_tile(x_row, offs + BLOCK, n_cols, EVICT, OTHER)
    for start in tl.range(0, n_cols, BLOCK, num_stages=NUM_STAGES):
        cols = start + offs
        if PREFETCH >= 2:
            x = x_next
            x_next = x_next2
            x_next2 = _ce_load_stats_tile(x_row, cols + 2 * BLOCK, n_cols, EVICT, OTHER)
        elif PREFETCH == 1:
            x = x_next
            x_next = _ce_load_stats_tile(x_row, cols + BLOCK, n_cols, EVICT, OTHER)
        else:
            x = _ce_load_stats_tile(x_row, cols, n_cols, EVICT, OTHER)
        z2 = _ce_logit2(x, scale, softcap, HAS_SOFTCAP)
        if HAS_SOFTCAP:  # the cap maps -inf to -softcap: mask past the row end explicitly
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
