"""Launches of the vocabulary-parallel kernels (``kernels.py``), with their launch configurations."""

from __future__ import annotations

import torch
import triton

from lck_kernels._common import next_power_of_2, tuned
from lck_kernels.cross_entropy.launch import ce_launch_config, row_arg
from lck_kernels.vocab_parallel.kernels import (
    STATS,
    _vp_combine_kernel,
    _vp_scale_kernel,
    _vp_shard_grad_kernel,
    _vp_shard_stats_kernel,
)

__all__ = ["STATS", "combine", "scale_", "shard_grad", "shard_stats"]


def shard_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    *,
    vocab_start: int,
    scale: float,
    ignore_index: int,
    slot: int,
    smoothing: bool = False,
    entropy: bool = True,
) -> None:
    """Write each row's shard statistics into ``stats[:, slot, :]`` (``stats``: ``[rows, tp, 5]`` fp32).

    ``smoothing`` / ``entropy`` switch the ``Σ z`` and ``q`` sums on (each costs a little per element)."""
    rows, n_cols = logits.shape
    if rows == 0:
        return
    cfg = ce_launch_config("cross_entropy_fwd", rows, n_cols, logits.element_size(), logits.device)
    _vp_shard_stats_kernel[cfg["grid"]](
        logits,
        logits.stride(0),
        target,
        stats,
        rows,
        n_cols,
        vocab_start,
        float(scale),
        ignore_index,
        slot,
        stats.shape[1],
        BLOCK=cfg["BLOCK"],
        SMOOTH=smoothing,
        ENTROPY=entropy,
        EVICT=False,
        NUM_STAGES=cfg["NUM_STAGES"],
        PREFETCH=cfg["PREFETCH"],
        WARP_MAX=cfg["WARP_MAX"],
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
    gl, gl_s = row_arg(g_loss, lse)
    gs, gs_s = row_arg(g_lse, lse)
    ge, ge_s = row_arg(g_entropy, lse)
    cfg = ce_launch_config("cross_entropy_bwd", rows, n_cols, logits.element_size(), logits.device)
    _vp_shard_grad_kernel[cfg["grid"]](
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
        rows,
        n_cols,
        vocab_start,
        float(scale),
        ignore_index,
        1.0 - float(label_smoothing),
        float(label_smoothing) / vocab_size,
        HAS_G_LOSS=g_loss is not None,
        HAS_G_LSE=g_lse is not None,
        HAS_G_ENT=g_entropy is not None,
        SMOOTH=label_smoothing > 0.0,
        BLOCK=cfg["BLOCK"],
        EVICT=cfg["EVICT"],
        NUM_STAGES=cfg["NUM_STAGES"],
        num_warps=cfg["num_warps"],
    )


def scale_(t: torch.Tensor, s: torch.Tensor) -> None:
    """``t *= s`` in place for a contiguous ``t`` and a one-element ``s`` on the same device; no pass when
    ``s == 1`` (decided on the device)."""
    n = t.numel()
    if n == 0:
        return
    cfg = tuned("vp_scale", {"BLOCK": 4096, "num_warps": 8})
    _vp_scale_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](t, n, s, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
