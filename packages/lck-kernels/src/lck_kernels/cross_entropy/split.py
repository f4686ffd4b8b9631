"""``_ce_fwd_split_kernel`` (tuning key ``split``): cross-entropy loss and gradient with each row split over a team.

Each row goes to a *team* of ``SPLIT`` consecutive programs, each owning a contiguous, tile-aligned slice
of the columns. A member computes its slice's statistics, publishes them as one record in a small
zero-filled buffer, waits for its partners' records, merges them (max-rescaled sums, as for vocabulary
shards) into the row's lse, and writes the gradient of its own slice. The data between a slice's two reads
shrinks by the team size (~8 MiB at 4), so the re-read can hit L2: two passes of HBM traffic instead of
three. The records are written and polled with relaxed atomics (performed in L2; each word carries a ready
bit and is written once per call, so no fences are needed); every program reads and overwrites only its
own slice, so the gradient may overwrite the logits. Progress: team members are consecutive program ids,
and every grid either fits the GPU at once (persistent) or leaves whole teams resident while the next wait
for an SM; a team never spans more programs than SMs. A member whose partner never publishes (a scheduling
fault) gives up after ``MAX_SPIN`` polls, raises an abort flag that ends every other wait, and writes NaN
for its rows instead of hanging. The interpreter runs programs one after another, so there the kernel runs
as two launches: ``PHASE`` 1 (statistics and records) then ``PHASE`` 2 (merge and gradient); on a GPU
``PHASE`` 0 does both in one launch. Measured slower than one program per row on an H200 (see
``kernels._DEFAULTS``), so it is off by default.
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

# Polls of a team's records before the split kernel gives up (NaN rows) instead of hanging: each poll is an
# L2 round trip (~1 µs), so about a second, far beyond the wait for a partner program to get an SM (at most
# another team's share of the rows, unless kernels on other streams hold SMs that long). The first program
# to give up raises the abort flag, so every later wait ends at once: the stall is bounded once per launch.
MAX_SPIN = 1 << 20


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
