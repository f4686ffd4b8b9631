"""Triton kernels for vocabulary-parallel cross entropy, shared by the CE and the fused-linear (FLSCE) ops.

Each rank of a tensor-parallel group holds a contiguous vocabulary shard ``[vocab_start, vocab_start +
n_cols)`` of every row's logits ``z = scale · logits``. The per-row quantities of the whole-vocabulary
softmax decompose over shards. The row passes are the single-GPU cross entropy's building blocks
(``lck_kernels.cross_entropy.rows._ce_row_stats`` / ``_ce_row_grad``, which take a shard-local target index, and
their tuned launch configurations); this module adds what the group needs around them:

1. ``_vp_shard_stats_kernel`` — per row of the shard: the local maximum ``m``, ``s = Σ exp(z − m)``,
   ``q = Σ exp(z − m)·z`` (entropy), ``Σ z`` (label smoothing) and the target logit if the target falls in
   this shard (else 0), written into slot ``rank`` of a ``[rows, tp, 5]`` float32 buffer whose other slots
   are zero, so a *sum* all-reduce over the group is an exact all-gather (``x + 0 = x`` in any order): one
   collective per call instead of a max then a sum.
2. ``_vp_combine_kernel`` — per row, merges the ``tp`` gathered slots (rescaling each shard's sums to
   the global maximum) into the global log-sum-exp, the NLL / label-smoothed loss and the entropy.
3. ``_vp_shard_grad_kernel`` — given the global LSE (and entropy) of each row and the upstream gradients
   of the per-row outputs, writes ``d(loss)/d(logits)`` of the shard; it may write in place over the logits.

``_vp_scale_kernel`` scales a gradient prepared in the forward by the upstream scalar (no pass at 1.0).
Launches: ``launch.py``. The target digest that the ops' agreement uses lives in ``digest.py``.
All row offsets are int64 (rows × vocabulary passes 2^31).
"""

import triton
import triton.language as tl

from lck_kernels.cross_entropy.rows import _ce_row_grad, _ce_row_stats, _f32

STATS = 5  # m, s, q, sum_z, target_z per (row, shard)
_M, _S, _Q, _SZ, _ZT = range(STATS)


@triton.jit
def _vp_shard_stats_kernel(
    z_ptr,
    z_row_stride,
    target_ptr,
    stats_ptr,
    n_rows,
    n_cols,
    vocab_start,
    scale,
    ignore_index,
    slot,
    tp,
    BLOCK: tl.constexpr,
    SMOOTH: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    WARP_MAX: tl.constexpr,
):
    scale = _f32(scale)  # fp64 when Inductor launches the kernel
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, n_rows, nprog):
        row64 = tl.cast(row, tl.int64)
        t = tl.load(target_ptr + row64).to(tl.int64)
        local = t - vocab_start
        mine = (t != ignore_index) & (local >= 0) & (local < n_cols)
        m, s, q, sz, zt = _ce_row_stats(
            z_ptr + row64 * z_row_stride, n_cols, tl.where(mine, local, -1), z_ptr, scale, 1.0,
            BLOCK, False, SMOOTH, False, ENTROPY, EVICT, NUM_STAGES, PREFETCH, WARP_MAX,
        )  # fmt: skip
        out = stats_ptr + (row64 * tp + slot) * 5
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
    smooth_keep, smooth_each = _f32(smooth_keep), _f32(smooth_each)  # fp64 when Inductor launches
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
    n_rows,
    n_cols,
    vocab_start,
    scale,
    ignore_index,
    smooth_keep,
    smooth_each,
    HAS_G_LOSS: tl.constexpr,
    HAS_G_LSE: tl.constexpr,
    HAS_G_ENT: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
    EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # fp64 when Inductor launches the kernel
    scale, smooth_keep, smooth_each = _f32(scale), _f32(smooth_keep), _f32(smooth_each)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, n_rows, nprog):
        row64 = tl.cast(row, tl.int64)
        t = tl.load(target_ptr + row64).to(tl.int64)
        valid = t != ignore_index
        local = t - vocab_start
        t_local = tl.where(valid & (local >= 0) & (local < n_cols), local, -1)
        # Ignored rows carry lse = 0; an infinite lse makes every p (and so every term) exactly 0 there.
        lse = tl.where(valid, tl.load(lse_ptr + row64), float("inf"))
        g = tl.zeros((), tl.float32)
        gl = tl.zeros((), tl.float32)
        ge = tl.zeros((), tl.float32)
        ez = tl.zeros((), tl.float32)
        if HAS_G_LOSS:
            g = tl.where(valid, tl.load(g_loss_ptr + row64 * g_loss_stride).to(tl.float32), 0.0)
        if HAS_G_LSE:
            gl = tl.where(valid, tl.load(g_lse_ptr + row64 * g_lse_stride).to(tl.float32), 0.0)
        if HAS_G_ENT:
            ge = tl.where(valid, tl.load(g_ent_ptr + row64 * g_ent_stride).to(tl.float32), 0.0)
            ez = lse - tl.load(entropy_ptr + row64)  # E_p[z] = lse - entropy
        # d/dz of g·loss + gl·lse + ge·entropy, in _ce_row_grad's form
        # A·p − B·[c = t] − C + E·p·(E_p[z] − z) with loss = (1−eps)(lse − z_t) + eps·(lse − Σz / V):
        # A = g + gl, B = g·(1 − eps), C = g·eps / V, E = ge.
        _ce_row_grad(
            z_ptr + row64 * z_row_stride, dz_ptr + row64 * dz_row_stride, n_cols, t_local, z_ptr, scale, 1.0,
            lse, ez, g + gl, g * smooth_keep, g * smooth_each, ge,
            BLOCK, False, SMOOTH, False, HAS_G_ENT, EVICT, NUM_STAGES, False, False,
        )  # fmt: skip


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
