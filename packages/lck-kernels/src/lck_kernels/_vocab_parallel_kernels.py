"""Triton kernels for vocabulary-parallel cross entropy, shared by the CE and the fused-linear (FLSCE) ops.

Each rank of a tensor-parallel group holds a contiguous vocabulary shard ``[vocab_start, vocab_start +
n_cols)`` of every row's logits ``z = scale · logits``. The per-row quantities of the whole-vocabulary
softmax decompose over shards, so three kernels suffice:

1. ``_vp_shard_stats_kernel`` — one pass over a row of the shard: the local maximum ``m``, ``s = Σ
   exp(z − m)``, ``q = Σ exp(z − m)·z`` (for the entropy), ``Σ z`` (for label smoothing) and the target
   logit if the target falls in this shard (else 0). It writes these five numbers into slot ``rank`` of a
   ``[rows, tp, 5]`` float32 buffer whose other slots are zero, so a *sum* all-reduce over the group is an
   exact all-gather (``x + 0 = x`` in any order): one collective per call instead of a max then a sum.
2. ``_vp_combine_kernel`` — per row, merges the ``tp`` gathered slots (rescaling each shard's sums to
   the global maximum) into the global log-sum-exp, the NLL / label-smoothed loss and the entropy.
3. ``_vp_shard_grad_kernel`` — given the global LSE (and entropy) of each row and the upstream gradients
   of the per-row outputs, writes ``d(loss)/d(logits)`` of the shard; it may write in place over the logits.

``_vp_scale_kernel`` scales a gradient prepared in the forward by the upstream scalar (no pass at 1.0).

``_vp_target_digest_kernel`` summarises a target vector (min and max of the non-ignored targets and a
position-weighted hash) so the ops can check, in the same collective that checks shapes, that every rank
holds the same targets inside the vocabulary. All row offsets are int64 (rows × vocabulary passes 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lck_kernels._common import next_power_of_2, row_block, tuned, warps_for

STATS = 5  # m, s, q, sum_z, target_z per (row, shard)
_M, _S, _Q, _SZ, _ZT = range(STATS)
# The digest's integer fields are split into 16-bit limbs so that every value is exact in float32.
LIMB_BITS = 16
TARGET_LIMBS = 3  # target fields carry an offset of 2**47, so 3 limbs hold them
TARGET_FIELDS = 3  # min, max and hash of the non-ignored targets
TARGET_OFFSET = 1 << 47
_HASH_MOD = 65521  # the largest prime below 2**16


@triton.jit
def _vp_shard_stats_kernel(
    z_ptr,
    z_row_stride,
    target_ptr,
    stats_ptr,
    n_cols,
    vocab_start,
    scale,
    ignore_index,
    slot,
    tp,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_row_stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    sz = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * scale
        m_new = tl.maximum(m, tl.max(z, 0))
        # A row (or its first tiles) of -inf logits must not turn the running sums into NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp(z - m_ref)
        alpha = tl.exp(m - m_ref)
        finite = z > float("-inf")
        s = s * alpha + tl.sum(e, 0)
        q = q * alpha + tl.sum(tl.where(finite, e * z, 0.0), 0)
        sz += tl.sum(tl.where(mask, z, 0.0), 0)
        m = m_new
    t = tl.load(target_ptr + row).to(tl.int64)
    local = t - vocab_start
    mine = (t != ignore_index) & (local >= 0) & (local < n_cols)
    zt = tl.load(z_row + tl.where(mine, local, 0), mask=mine, other=0.0).to(tl.float32) * scale
    zt = tl.where(mine, zt, 0.0)
    out = stats_ptr + (row * tp + slot) * 5
    tl.store(out + 0, m)
    tl.store(out + 1, s)
    tl.store(out + 2, q)
    tl.store(out + 3, sz)
    tl.store(out + 4, zt)


@triton.jit
def _vp_combine_kernel(
    stats_ptr,
    target_ptr,
    loss_ptr,
    lse_ptr,
    entropy_ptr,
    n_rows,
    tp,
    ignore_index,
    smooth_keep,
    smooth_each,
    BLOCK_R: tl.constexpr,
    BLOCK_TP: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    slots = tl.arange(0, BLOCK_TP)
    mask = row_mask[:, None] & (slots < tp)[None, :]
    base = stats_ptr + (rows[:, None] * tp + slots[None, :]) * 5
    m = tl.load(base + 0, mask=mask, other=float("-inf"))
    big_m = tl.max(m, 1)
    m_ref = tl.where(big_m == float("-inf"), 0.0, big_m)
    w = tl.where(mask, tl.exp(m - m_ref[:, None]), 0.0)
    s = tl.sum(tl.load(base + 1, mask=mask, other=0.0) * w, 1)
    q = tl.sum(tl.load(base + 2, mask=mask, other=0.0) * w, 1)
    sz = tl.sum(tl.load(base + 3, mask=mask, other=0.0), 1)
    zt = tl.sum(tl.load(base + 4, mask=mask, other=0.0), 1)
    s = tl.where(row_mask, s, 1.0)  # rows past the end: keep log() quiet
    lse = m_ref + tl.log(s)
    entropy = lse - q / s
    # Label smoothing (torch's definition): (1 - eps) * nll + eps * mean_j(-log p_j), and
    # mean_j(-log p_j) = lse - sum_z / V; smooth_keep = 1 - eps, smooth_each = eps / V.
    loss = smooth_keep * (lse - zt) + (1.0 - smooth_keep) * lse - smooth_each * sz
    t = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = t != ignore_index
    # Ignored rows contribute nothing: every output is 0 there (and their gradient is 0).
    tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
    tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0), mask=row_mask)
    tl.store(entropy_ptr + rows, tl.where(valid, entropy, 0.0), mask=row_mask)


@triton.jit
def _vp_shard_grad_kernel(
    z_ptr,
    z_row_stride,
    dz_ptr,
    dz_row_stride,
    target_ptr,
    lse_ptr,
    entropy_ptr,
    g_loss_ptr,
    g_loss_stride,
    g_lse_ptr,
    g_lse_stride,
    g_ent_ptr,
    g_ent_stride,
    n_cols,
    vocab_start,
    scale,
    ignore_index,
    smooth_keep,
    smooth_each,
    HAS_G_LOSS: tl.constexpr,
    HAS_G_LSE: tl.constexpr,
    HAS_G_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(target_ptr + row).to(tl.int64)
    valid = t != ignore_index
    lse = tl.load(lse_ptr + row)
    g_loss = tl.zeros((), tl.float32)
    g_lse = tl.zeros((), tl.float32)
    g_ent = tl.zeros((), tl.float32)
    mean_z = tl.zeros((), tl.float32)
    if HAS_G_LOSS:
        g_loss = tl.load(g_loss_ptr + row * g_loss_stride).to(tl.float32)
    if HAS_G_LSE:
        g_lse = tl.load(g_lse_ptr + row * g_lse_stride).to(tl.float32)
    if HAS_G_ENT:
        g_ent = tl.load(g_ent_ptr + row * g_ent_stride).to(tl.float32)
        mean_z = lse - tl.load(entropy_ptr + row)  # E_p[z] = lse - entropy
    local = t - vocab_start
    z_row = z_ptr + row * z_row_stride
    dz_row = dz_ptr + row * dz_row_stride
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32) * scale
        p = tl.exp(z - lse)
        # d loss / dz = p - (1 - eps)·onehot - eps / V;  d lse / dz = p;  d entropy / dz = -p (z - E_p[z]).
        d = g_loss * (p - tl.where(cols == local, smooth_keep, 0.0) - smooth_each)
        if HAS_G_LSE:
            d += g_lse * p
        if HAS_G_ENT:
            d -= g_ent * p * (z - mean_z)
        # Ignored rows: lse was stored as 0 there, so p may be inf/NaN; select 0 regardless.
        d = tl.where(valid, d * scale, 0.0)
        tl.store(dz_row + cols, d.to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _vp_target_digest_kernel(
    target_ptr, n, ignore_index, out_ptr, OFFSET: tl.constexpr, HASH_MOD: tl.constexpr, BLOCK: tl.constexpr
):
    # Sentinels (and clamps) at +-2**46: an empty selection decodes as min > max, and every value plus
    # OFFSET = 2**47 stays inside 48 bits (an out-of-range target is still out of range once clamped).
    lo = tl.full((), 1 << 46, tl.int64)
    hi = tl.full((), -(1 << 46), tl.int64)
    h = tl.zeros((), tl.int64)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < n
        t = tl.load(target_ptr + idx, mask=mask, other=ignore_index).to(tl.int64)
        valid = mask & (t != ignore_index)
        t_c = tl.minimum(tl.maximum(t, -(1 << 46)), 1 << 46)
        lo = tl.minimum(lo, tl.min(tl.where(valid, t_c, 1 << 46), 0))
        hi = tl.maximum(hi, tl.max(tl.where(valid, t_c, -(1 << 46)), 0))
        # Position-weighted, so a permutation of the same targets hashes differently.
        term = ((t % HASH_MOD + HASH_MOD) % HASH_MOD) * ((idx.to(tl.int64) % 1021) + 1)
        h = (h + tl.sum(tl.where(mask, term, 0), 0)) % HASH_MOD
    for k in tl.static_range(3):
        tl.store(out_ptr + k, (((lo + OFFSET) >> (16 * k)) & 0xFFFF).to(tl.float32))
        tl.store(out_ptr + 3 + k, (((hi + OFFSET) >> (16 * k)) & 0xFFFF).to(tl.float32))
        tl.store(out_ptr + 6 + k, ((h >> (16 * k)) & 0xFFFF).to(tl.float32))


@triton.jit
def _vp_scale_kernel(t_ptr, n, s_ptr, BLOCK: tl.constexpr):
    s = tl.load(s_ptr).to(tl.float32)
    # In training the upstream gradient of a summed loss is almost always exactly 1: skip the pass on
    # device, without a host sync to find out.
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(t_ptr + offs, (v * s).to(t_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launchers (inputs already validated by the ops)
# ---------------------------------------------------------------------------------------------------------


def _row_launch(kernel: str, n_cols: int, element_size: int) -> dict[str, int]:
    block = row_block(n_cols, 4096)
    return tuned(kernel, {"BLOCK": block, "num_warps": warps_for(block, element_size, lo=4, hi=16)})


def shard_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    *,
    vocab_start: int,
    scale: float,
    ignore_index: int,
    slot: int,
) -> None:
    """Write each row's shard statistics into ``stats[:, slot, :]`` (``stats``: ``[rows, tp, 5]`` fp32)."""
    rows, n_cols = logits.shape
    if rows == 0:
        return
    cfg = _row_launch("vp_shard_stats", n_cols, logits.element_size())
    _vp_shard_stats_kernel[(rows,)](
        logits,
        logits.stride(0),
        target,
        stats,
        n_cols,
        vocab_start,
        float(scale),
        ignore_index,
        slot,
        stats.shape[1],
        BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"],
    )


def combine(
    stats: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (loss, lse, entropy) in float32 from the gathered ``[rows, tp, 5]`` statistics."""
    rows, tp, _ = stats.shape
    loss, lse, entropy = (torch.empty(rows, device=stats.device, dtype=torch.float32) for _ in range(3))
    if rows == 0:
        return loss, lse, entropy
    block_tp = next_power_of_2(tp)
    cfg = tuned("vp_combine", {"BLOCK_R": max(16, min(256, 4096 // block_tp)), "num_warps": 4})
    _vp_combine_kernel[(triton.cdiv(rows, cfg["BLOCK_R"]),)](
        stats,
        target,
        loss,
        lse,
        entropy,
        rows,
        tp,
        ignore_index,
        1.0 - float(label_smoothing),
        float(label_smoothing) / vocab_size,
        BLOCK_R=cfg["BLOCK_R"],
        BLOCK_TP=block_tp,
        num_warps=cfg["num_warps"],
    )
    return loss, lse, entropy


def _row_grad_arg(g: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    if g is None:
        return like, 0
    return g, (g.stride(0) if g.dim() == 1 else 0)


def shard_grad(
    logits: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    g_loss: torch.Tensor | None,
    g_lse: torch.Tensor | None = None,
    g_entropy: torch.Tensor | None = None,
    vocab_start: int,
    vocab_size: int,
    scale: float,
    ignore_index: int,
    label_smoothing: float = 0.0,
) -> None:
    """Write ``d/d logits`` of ``Σ g_loss·loss + g_lse·lse + g_entropy·entropy`` over the shard into ``out``.

    The ``g_*`` are per-row float tensors ``[rows]`` (any stride, e.g. an expanded scalar) or ``None``.
    ``out`` may be ``logits`` itself (in place).
    """
    rows, n_cols = logits.shape
    if rows == 0:
        return
    if g_entropy is not None and entropy is None:
        raise ValueError("shard_grad: g_entropy needs the per-row entropy")
    gl, gl_s = _row_grad_arg(g_loss, lse)
    gs, gs_s = _row_grad_arg(g_lse, lse)
    ge, ge_s = _row_grad_arg(g_entropy, lse)
    cfg = _row_launch("vp_shard_grad", n_cols, logits.element_size())
    _vp_shard_grad_kernel[(rows,)](
        logits,
        logits.stride(0),
        out,
        out.stride(0),
        target,
        lse,
        entropy if entropy is not None else lse,
        gl,
        gl_s,
        gs,
        gs_s,
        ge,
        ge_s,
        n_cols,
        vocab_start,
        float(scale),
        ignore_index,
        1.0 - float(label_smoothing),
        float(label_smoothing) / vocab_size,
        HAS_G_LOSS=g_loss is not None,
        HAS_G_LSE=g_lse is not None,
        HAS_G_ENT=g_entropy is not None,
        BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"],
    )


def target_digest(target: torch.Tensor, ignore_index: int, out: torch.Tensor) -> None:
    """Write 9 float32 limbs into ``out``: min and max of the non-ignored targets, and their hash."""
    n = target.numel()
    block = min(4096, next_power_of_2(max(n, 1)))
    _vp_target_digest_kernel[(1,)](
        target, n, ignore_index, out, OFFSET=TARGET_OFFSET, HASH_MOD=_HASH_MOD, BLOCK=block, num_warps=4
    )


def decode_target_digest(limbs: list[float]) -> tuple[int, int, int]:
    """(min, max, hash) from the 9 limbs written by :func:`target_digest`; min > max when all are ignored."""
    vals = []
    for f in range(TARGET_FIELDS):
        v = 0
        for k in range(TARGET_LIMBS):
            v |= int(limbs[f * TARGET_LIMBS + k]) << (LIMB_BITS * k)
        vals.append(v)
    return vals[0] - TARGET_OFFSET, vals[1] - TARGET_OFFSET, vals[2]


def scale_(t: torch.Tensor, s: torch.Tensor) -> None:
    """``t *= s`` in place for a contiguous ``t`` and a one-element ``s`` on the same device; no pass when
    ``s == 1`` (decided on the device)."""
    n = t.numel()
    if n == 0:
        return
    cfg = tuned("vp_scale", {"BLOCK": 4096, "num_warps": 8})
    _vp_scale_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](t, n, s, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
