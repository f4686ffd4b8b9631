"""The target digest of the vocabulary-parallel ops' agreement.

``_vp_target_digest_kernel`` summarises a target vector (min and max of the non-ignored targets and a
position-weighted hash) into float32 limbs, so that the ops can check, in the same collective that checks
shapes, that every rank holds the same targets inside the vocabulary (``group.agree``).
``_vp_verdict_kernel`` is that check on the device, for calls captured into a CUDA graph
(``capture.py``), where the host cannot read the gathered digests, and for groups of one
rank (:func:`range_verdict`), where a host read would only stall the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lck_kernels._common import next_power_of_2

# The digest's integer fields are split into 16-bit limbs so that every value is exact in float32.
LIMB_BITS = 16
TARGET_LIMBS = 3  # target fields carry an offset of 2**47, so 3 limbs hold them
TARGET_FIELDS = 3  # min, max and hash of the non-ignored targets
TARGET_OFFSET = 1 << 47
_HASH_MOD = 65521  # the largest prime below 2**16


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


# Sizes unspecialised: one compiled kernel serves every group size and vocabulary, so the one load done
# outside capture (``capture.remember``) is the kernel every capture launches.
@triton.jit(do_not_specialize=["n_rows", "width", "digest_at", "vocab_size"])
def _vp_verdict_kernel(
    rows_ptr, n_rows, width, digest_at, vocab_size, out_ptr, OFFSET: tl.constexpr, BLOCK: tl.constexpr
):
    # One program: every gathered row must equal the first (signature and digest), and the first row's
    # non-ignored targets must lie in [0, vocab_size). The verdict is 0.0, or NaN for the loss to carry.
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    first = tl.load(rows_ptr + cols, mask=mask, other=0.0)
    differ = tl.zeros((), tl.int32)
    for r in range(1, n_rows):
        row = tl.load(rows_ptr + r * width + cols, mask=mask, other=0.0)
        differ += tl.sum((row != first).to(tl.int32), 0)
    lo = tl.zeros((), tl.int64)
    hi = tl.zeros((), tl.int64)
    for k in tl.static_range(3):
        lo += tl.load(rows_ptr + digest_at + k).to(tl.int64) << (16 * k)
        hi += tl.load(rows_ptr + digest_at + 3 + k).to(tl.int64) << (16 * k)
    lo -= OFFSET
    hi -= OFFSET
    bad = (differ > 0) | ((lo <= hi) & ((lo < 0) | (hi >= vocab_size)))
    tl.store(out_ptr, tl.where(bad, float("nan"), 0.0))


def target_verdict(rows: torch.Tensor, digest_at: int, vocab_size: int, out: torch.Tensor) -> None:
    """``out`` (one float32) ← 0.0 when the contiguous ``[ranks, width]`` float32 ``rows`` are all equal and
    the digest at column ``digest_at`` (written by :func:`target_digest`) lies in ``[0, vocab_size)``,
    else NaN. No host read: the check of a call captured into a CUDA graph."""
    n_rows, width = rows.shape
    _vp_verdict_kernel[(1,)](
        rows, n_rows, width, digest_at, vocab_size, out,
        OFFSET=TARGET_OFFSET, BLOCK=next_power_of_2(width), num_warps=1,
    )  # fmt: skip


def range_verdict(target: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor:
    """A 0-D float32 tensor on ``target``'s device: 0.0 when every non-ignored target lies in
    ``[0, vocab_size)``, else NaN. Two launches, no host read."""
    digest = torch.empty(1, TARGET_FIELDS * TARGET_LIMBS, device=target.device, dtype=torch.float32)
    target_digest(target, ignore_index, digest)
    out = torch.empty((), device=target.device, dtype=torch.float32)
    target_verdict(digest, 0, vocab_size, out)
    return out
