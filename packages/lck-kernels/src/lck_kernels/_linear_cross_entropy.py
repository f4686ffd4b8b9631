"""The recompute schedule's ops and autograd, shared by the fused linear cross-entropy ops.

Registers ``lck::linear_cross_entropy_stats`` and ``lck::linear_cross_entropy_bwd`` (opaque ``custom_op``s:
they mix cuBLAS GEMMs and Triton launches) and their ``torch.autograd.Function``, shared by
``fused_linear_cross_entropy`` (``reduction="none"``) and ``fused_linear_scaled_cross_entropy``. The
chunked engine they run on (both schedules, the memory budget, ``plan_chunk_tokens``) is
``_linear_cross_entropy_chunks``; the names the ops modules and tests use are re-exported here.
"""

from __future__ import annotations

import torch

from lck_kernels._common import check_tensor
from lck_kernels._cross_entropy_checks import check_linear_inputs, check_op_scalars
from lck_kernels._cross_entropy_launch import CEOptions
from lck_kernels._linear_cross_entropy_chunks import (
    CHUNK_ALIGN,
    DEFAULT_CHUNK_BYTES,
    backward_recompute,
    empty_grads,
    forward_stats,
    forward_with_grads,
    needs_grads,
    plan_chunk_tokens,
)

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# Ops: the recompute schedule (reduction="none" here; every call of the scaled op)
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("lck::linear_cross_entropy_stats", mutates_args=())
def lce_stats(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    inverse_temperature: float,
    reduction: str,
    return_entropy: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, z_loss, lse, entropy) in float32; ``entropy`` is empty unless ``return_entropy``."""
    op = "lck::linear_cross_entropy_stats"
    check_linear_inputs(op, x, weight, target, bias, class_weight)
    check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens)
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap, inverse_temperature)
    return forward_stats(x, weight, target, bias, class_weight, opts, reduction, return_entropy, chunk_tokens)


@lce_stats.register_fake
def _(x, weight, target, bias, class_weight, ii, ls, zs, softcap, inv_t, reduction, return_entropy, chunk):
    check_linear_inputs("lck::linear_cross_entropy_stats", x, weight, target, bias, class_weight)
    n = x.shape[0]
    shape = (n,) if reduction == "none" else ()
    rows = x.new_empty((n,), dtype=torch.float32)
    ent = x.new_empty((n if return_entropy else 0,), dtype=torch.float32)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.float32), rows, ent


@torch.library.custom_op("lck::linear_cross_entropy_bwd", mutates_args=())
def lce_bwd(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    lse: Tensor,
    entropy: Tensor | None,
    g_loss: Tensor | None,
    g_lse: Tensor | None,
    g_entropy: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    inverse_temperature: float,
    reduction: str,
    need_x: bool,
    need_w: bool,
    need_b: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_w, grad_b) by recomputing the logits; unneeded gradients are empty."""
    op = "lck::linear_cross_entropy_bwd"
    check_linear_inputs(op, x, weight, target, bias, class_weight)
    check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens)
    n = x.shape[0]
    check_tensor(op, "lse", lse, dtypes=(torch.float32,), ndim=1)
    for name, g in (("entropy", entropy), ("g_lse", g_lse), ("g_entropy", g_entropy)):
        if g is not None:
            check_tensor(op, name, g, ndim=1)
    if g_loss is not None:
        check_tensor(op, "g_loss", g_loss, ndim=1 if reduction == "none" else 0)
    if g_entropy is not None and entropy is None:
        raise ValueError(f"{op}: g_entropy needs the entropy saved by the forward")
    sizes = [t.shape[0] for t in (lse, entropy, g_lse, g_entropy) if t is not None]
    if g_loss is not None and g_loss.dim() == 1:
        sizes.append(g_loss.shape[0])
    if any(s != n for s in sizes):
        raise ValueError(f"{op}: per-token tensors must have {n} rows (x's), got {sizes}")
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap, inverse_temperature)
    return backward_recompute(
        x, weight, target, bias, class_weight, opts, reduction, lse, entropy, g_loss, g_lse, g_entropy,
        need_x, need_w, need_b, chunk_tokens,
    )  # fmt: skip


@lce_bwd.register_fake
def _(x, weight, target, bias, class_weight, lse, entropy, g_loss, g_lse, g_entropy, *rest):
    need_x, need_w, need_b = rest[6:9]
    return empty_grads(x, weight, bias, need_x, need_w, need_b)


# ---------------------------------------------------------------------------------------------------------
# Autograd of the recompute schedule
# ---------------------------------------------------------------------------------------------------------


class LinearCrossEntropyRecomputeFunction(torch.autograd.Function):
    """Forward keeps lse (and entropy); backward recomputes the logits. Outputs: loss, z, lse, entropy."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        target,
        bias,
        class_weight,
        ii,
        ls,
        zs,
        softcap,
        inv_t,
        reduction,
        ent,
        nx,
        nw,
        nb,
        chunk,
    ):
        loss, z, lse, entropy = lce_stats(
            x, weight, target, bias, class_weight, ii, ls, zs, softcap, inv_t, reduction, ent, chunk
        )
        ctx.save_for_backward(x, weight, target, bias, class_weight, lse, entropy)
        ctx.options = (ii, ls, zs, softcap, inv_t, reduction)
        ctx.needs = (nx, nw, nb, chunk, ent)
        ctx.mark_non_differentiable(z)
        return loss, z, lse, entropy

    @staticmethod
    def backward(ctx, g_loss, g_z, g_lse, g_entropy):
        x, weight, target, bias, class_weight, lse, entropy = ctx.saved_tensors
        nx, nw, nb, chunk, ent = ctx.needs
        gx, gw, gb = lce_bwd(
            x, weight, target, bias, class_weight, lse, entropy if ent else None, g_loss, g_lse,
            g_entropy if ent else None, *ctx.options, nx, nw, nb, chunk,
        )  # fmt: skip
        return (gx if nx else None, gw if nw else None, None, gb if nb else None) + (None,) * 12


# Engine names are re-exported: the fused_linear_* modules, tests and tuning scripts import them here.
__all__ = [
    "CHUNK_ALIGN",
    "DEFAULT_CHUNK_BYTES",
    "LinearCrossEntropyRecomputeFunction",
    "empty_grads",
    "forward_with_grads",
    "lce_bwd",
    "lce_stats",
    "needs_grads",
    "plan_chunk_tokens",
]
