"""The ``torch.library`` ops of the fused linear cross-entropy family and their ``torch.autograd.Function``s.

Opaque ``custom_op``s (they mix cuBLAS GEMMs and Triton launches over chunks of the chunked engine,
``launch.py``):

- the recompute schedule, shared by ``fused_linear_cross_entropy`` (``reduction="none"``) and
  ``fused_linear_scaled_cross_entropy``: ``lck::linear_cross_entropy_stats`` and
  ``lck::linear_cross_entropy_bwd``, with ``LinearCrossEntropyRecomputeFunction``;
- gradients in the forward (reductions sum/mean): ``lck::fused_linear_cross_entropy_fwd`` and
  ``lck::fused_linear_cross_entropy_rescale_`` with ``FusedLinearCrossEntropyFunction``, and
  ``lck::fused_linear_scaled_cross_entropy_fwd`` with ``FusedLinearScaledCrossEntropyFunction``.
"""

from __future__ import annotations

import torch

from lck_kernels._common import check_tensor
from lck_kernels._eager import eager, fast_apply
from lck_kernels.cross_entropy.checks import unpack_saved_gradient
from lck_kernels.cross_entropy.launch import CEOptions, launch_rescale_flat
from lck_kernels.linear_cross_entropy.checks import (
    check_inverse_temperature,
    check_linear_inputs,
    check_op_scalars,
)
from lck_kernels.linear_cross_entropy.launch import (
    ChunkedProblem,
    backward_recompute,
    empty_grads,
    forward_chunked,
)

Tensor = torch.Tensor
SCALED_OP = "fused_linear_scaled_cross_entropy"


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
    problem = ChunkedProblem(x, weight, target, bias, class_weight, opts, reduction, chunk_tokens)
    return forward_chunked(problem, entropy=return_entropy)


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
    problem = ChunkedProblem(x, weight, target, bias, class_weight, opts, reduction, chunk_tokens)
    return backward_recompute(problem, (need_x, need_w, need_b), (lse, entropy), (g_loss, g_lse, g_entropy))


@lce_bwd.register_fake
def _(x, weight, target, bias, class_weight, lse, entropy, g_loss, g_lse, g_entropy, *rest):
    need_x, need_w, need_b = rest[6:9]
    return empty_grads(x, weight, bias, need_x, need_w, need_b)


# ---------------------------------------------------------------------------------------------------------
# Autograd of the recompute schedule
# ---------------------------------------------------------------------------------------------------------


def _input_grads(grads, needs, n_options: int) -> tuple:
    """A Function's backward result for ``(x, weight, target, bias, *options)``: each of ``grads`` (x, weight,
    bias) where ``needs`` (their first three entries) asks for it, None for the target and the options."""
    (gx, gw, gb), (nx, nw, nb) = grads, needs[:3]
    return (gx if nx else None, gw if nw else None, None, gb if nb else None) + (None,) * n_options


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
        return _input_grads((gx, gw, gb), ctx.needs, 12)


# ---------------------------------------------------------------------------------------------------------
# Ops: gradients in the forward
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("lck::fused_linear_cross_entropy_fwd", mutates_args=())
def _flce_fwd(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    need_x: bool,
    need_w: bool,
    need_b: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, z_loss, grad_x, grad_w, grad_b, applied) for reduction sum/mean; losses float32."""
    op = "lck::fused_linear_cross_entropy_fwd"
    check_linear_inputs(op, x, weight, target, bias, class_weight)
    check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens)
    if reduction == "none":
        raise ValueError(f"{op}: reduction='none' takes the recompute schedule (lck::linear_cross_entropy_*)")
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    problem = ChunkedProblem(x, weight, target, bias, class_weight, opts, reduction, chunk_tokens)
    loss, z, _, _, gx, gw, gb = forward_chunked(problem, entropy=False, needs=(need_x, need_w, need_b))
    return loss, z, gx, gw, gb, torch.ones(1, dtype=torch.float32, device=x.device)


@_flce_fwd.register_fake
def _(
    x,
    weight,
    target,
    bias,
    class_weight,
    ignore_index,
    ls,
    zs,
    softcap,
    reduction,
    need_x,
    need_w,
    need_b,
    chunk,
):
    check_linear_inputs("lck::fused_linear_cross_entropy_fwd", x, weight, target, bias, class_weight)
    loss = x.new_empty((), dtype=torch.float32)
    grads = empty_grads(x, weight, bias, need_x, need_w, need_b)
    return loss, torch.empty_like(loss), *grads, x.new_empty((1,), dtype=torch.float32)


@torch.library.custom_op(
    "lck::fused_linear_cross_entropy_rescale_", mutates_args=("grad_x", "grad_w", "grad_b", "applied")
)
def _flce_rescale_(
    grad_x: Tensor, grad_w: Tensor, grad_b: Tensor, applied: Tensor, grad_output: Tensor
) -> None:
    """Each gradient ← gradient × ``grad_output / applied`` (one value each); ``applied`` ← ``grad_output``."""
    op = "lck::fused_linear_cross_entropy_rescale_"
    for name, t in (("grad_x", grad_x), ("grad_w", grad_w), ("grad_b", grad_b)):
        check_tensor(op, name, t, contiguous=True)
    check_tensor(op, "applied", applied, dtypes=(torch.float32,), ndim=1)
    check_tensor(op, "grad_output", grad_output)
    if applied.numel() != 1 or grad_output.numel() != 1:
        raise ValueError(
            f"{op}: applied and grad_output must hold one value each, got shapes {tuple(applied.shape)} "
            f"and {tuple(grad_output.shape)}"
        )
    launch_rescale_flat([grad_x, grad_w, grad_b], applied, grad_output, wrap=False)


@_flce_rescale_.register_fake
def _(grad_x, grad_w, grad_b, applied, grad_output):
    return None


# ---------------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------------


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Gradients in the forward (reduction sum/mean); the backward rescales them in place."""

    @staticmethod
    def forward(
        ctx, x, weight, target, bias, class_weight, ii, ls, zs, softcap, reduction, nx, nw, nb, chunk
    ):
        loss, z, gx, gw, gb, applied = _flce_fwd(
            x, weight, target, bias, class_weight, ii, ls, zs, softcap, reduction, nx, nw, nb, chunk
        )
        ctx.save_for_backward(gx, gw, gb, applied)
        ctx.needs = (nx, nw, nb)
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, g_loss, g_z):
        gx, gw, gb, applied = unpack_saved_gradient(ctx, "fused_linear_cross_entropy")
        _flce_rescale_(gx, gw, gb, applied, g_loss)
        return _input_grads((gx, gw, gb), ctx.needs, 10)


# ---------------------------------------------------------------------------------------------------------
# Op and autograd: the reduced NLL's gradient finished in the forward
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("lck::fused_linear_scaled_cross_entropy_fwd", mutates_args=())
def _flsce_fwd(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    inverse_temperature: float,
    reduction: str,
    return_entropy: bool,
    need_x: bool,
    need_w: bool,
    need_b: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(nll, lse, entropy, grad_x, grad_w, grad_b, applied) for reduction sum/mean: the reduced NLL and
    the gradients of it; ``entropy`` is empty unless ``return_entropy``, unneeded gradients are empty."""
    op = "lck::fused_linear_scaled_cross_entropy_fwd"
    check_linear_inputs(op, x, weight, target, bias, None)
    check_op_scalars(op, ignore_index, 0.0, 0.0, 0.0, reduction, chunk_tokens)
    check_inverse_temperature(op, inverse_temperature)
    if reduction == "none":
        raise ValueError(f"{op}: reduction='none' takes the recompute schedule (lck::linear_cross_entropy_*)")
    opts = CEOptions(ignore_index, 0.0, 0.0, 0.0, inverse_temperature)
    problem = ChunkedProblem(x, weight, target, bias, None, opts, reduction, chunk_tokens)
    nll, _, lse, entropy, gx, gw, gb = forward_chunked(
        problem, entropy=return_entropy, needs=(need_x, need_w, need_b)
    )
    return nll, lse, entropy, gx, gw, gb, torch.ones(1, dtype=torch.float32, device=x.device)


@_flsce_fwd.register_fake
def _(x, weight, target, bias, ignore_index, inv_t, reduction, return_entropy, need_x, need_w, need_b, chunk):
    check_linear_inputs("lck::fused_linear_scaled_cross_entropy_fwd", x, weight, target, bias, None)
    n = x.shape[0]
    rows = x.new_empty((n,), dtype=torch.float32)
    entropy = x.new_empty((n if return_entropy else 0,), dtype=torch.float32)
    grads = empty_grads(x, weight, bias, need_x, need_w, need_b)
    return x.new_empty((), dtype=torch.float32), rows, entropy, *grads, x.new_empty((1,), dtype=torch.float32)


class FusedLinearScaledCrossEntropyFunction(torch.autograd.Function):
    """Reduced NLL with its gradient finished in the forward; the backward scales it in place, and
    recomputes the logits only for gradients that reach lse or entropy."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, ii, inv_t, reduction, ent, nx, nw, nb, chunk):
        nll, lse, entropy, gx, gw, gb, applied = _flsce_fwd(
            x, weight, target, bias, ii, inv_t, reduction, ent, nx, nw, nb, chunk
        )
        ctx.save_for_backward(x, weight, target, bias, lse, entropy, gx, gw, gb, applied)
        ctx.options = (ii, inv_t, reduction)
        ctx.needs = (nx, nw, nb, chunk, ent)
        ctx.set_materialize_grads(False)  # an output nobody differentiates costs nothing in the backward
        return nll, lse, entropy

    @staticmethod
    def backward(ctx, g_nll, g_lse, g_entropy):
        x, weight, target, bias, lse, entropy, gx, gw, gb, applied = unpack_saved_gradient(ctx, SCALED_OP)
        nx, nw, nb, chunk, ent = ctx.needs
        ii, inv_t, reduction = ctx.options
        grads = [None, None, None]
        if g_nll is not None:
            _flce_rescale_(gx, gw, gb, applied, g_nll)
            grads = [gx, gw, gb]
        g_entropy = g_entropy if ent else None
        if g_lse is not None or g_entropy is not None:
            extra = lce_bwd(
                x, weight, target, bias, None, lse, entropy if ent else None, None, g_lse, g_entropy,
                ii, 0.0, 0.0, 0.0, inv_t, reduction, nx, nw, nb, chunk,
            )  # fmt: skip
            grads = [e if g is None else g + e for g, e in zip(grads, extra)]
        return _input_grads(grads, ctx.needs, 8)


# Plain eager calls run the bodies above directly (the dispatcher's custom-op autograd and alias checks cost
# ~0.3 ms of host time per call); torch.compile, fake tensors and modes still take the registered ops.
lce_stats = eager(lce_stats)
lce_bwd = eager(lce_bwd)
_flce_fwd = eager(_flce_fwd)
_flce_rescale_ = eager(_flce_rescale_, ("grad_x", "grad_w", "grad_b", "applied"))
_flsce_fwd = eager(_flsce_fwd)


lce_recompute_apply = fast_apply(LinearCrossEntropyRecomputeFunction)
flce_apply = fast_apply(FusedLinearCrossEntropyFunction)
flsce_apply = fast_apply(FusedLinearScaledCrossEntropyFunction)
