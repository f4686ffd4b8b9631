"""Fused linear cross entropy: ``cross_entropy(x @ weight.T + bias, target)`` without ``[tokens, vocab]`` logits.

The loss options and their semantics are those of :func:`lck_kernels.cross_entropy.cross_entropy`
(``class_weight`` is its ``weight``); the chunked schedules, the chunk budget and the precision choices are
described in ``lck_kernels._linear_cross_entropy_chunks``. In short: for ``reduction="sum"``/``"mean"`` every
gradient is finished in the forward (three GEMMs per token) and the backward is a device-side rescale that
costs one launch when the incoming gradient is 1; for ``reduction="none"`` the forward keeps each token's
log-sum-exp and the backward recomputes the logits (four GEMMs per token). Inputs that do not require grad
skip their GEMMs; without any grad the forward is one GEMM per token. Extra memory is the logits chunk
(``chunk_bytes``, default 512 MiB) plus ``[tokens]`` float32 rows, at any token count.

Ops (opaque ``torch.library.custom_op``: they mix cuBLAS GEMMs and Triton launches over chunks):
``lck::fused_linear_cross_entropy_fwd`` and ``lck::fused_linear_cross_entropy_rescale_`` (gradients in the
forward, here), ``lck::linear_cross_entropy_stats`` and ``lck::linear_cross_entropy_bwd`` (the recompute
schedule, in ``lck_kernels._linear_cross_entropy``, shared with the scaled op).
"""

from __future__ import annotations

import torch

from lck_kernels._common import check_tensor
from lck_kernels._cross_entropy_checks import (
    check_chunking,
    check_flag,
    check_linear_inputs,
    check_loss_options,
    check_op_scalars,
    flatten_tokens,
    unpack_saved_gradient,
)
from lck_kernels._cross_entropy_launch import CEOptions, launch_rescale_flat
from lck_kernels._linear_cross_entropy import (
    LinearCrossEntropyRecomputeFunction,
    empty_grads,
    forward_with_grads,
    lce_stats,
    needs_grads,
    plan_chunk_tokens,
)

Tensor = torch.Tensor

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
    loss, z, _, _, gx, gw, gb = forward_with_grads(
        x, weight, target, bias, class_weight, opts, reduction, need_x, need_w, need_b, chunk_tokens
    )
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
        nx, nw, nb = ctx.needs
        return (gx if nx else None, gw if nw else None, None, gb if nb else None) + (None,) * 10


# ---------------------------------------------------------------------------------------------------------
# Functional API and module
# ---------------------------------------------------------------------------------------------------------


def fused_linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    class_weight: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_z_loss: bool = False,
    chunk_bytes: int | None = None,
    max_chunk_tokens: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``cross_entropy(x @ weight.T + bias, target, ...)`` computed chunk by chunk.

    Args:
        x: ``[..., hidden]`` float32/float16/bfloat16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``) whose
            leading dimensions collapse into rows without a copy.
        weight: ``[vocab, hidden]`` of ``x``'s dtype and device (any strides).
        target: int64/int32 class indices of shape ``x.shape[:-1]``.
        bias: optional ``[vocab]`` of ``x``'s dtype.
        class_weight: optional ``[vocab]`` float class weights (``weight`` of ``F.cross_entropy``).
        ignore_index, label_smoothing, lse_square_scale, softcap, reduction, return_z_loss: as in
            :func:`lck_kernels.cross_entropy.cross_entropy`.
        chunk_bytes: budget of the logits chunk buffer in bytes (default 512 MiB).
        max_chunk_tokens: an upper bound on tokens per chunk (e.g. for tests or tuning).

    Returns the loss in ``x.dtype`` (0-D, or ``target``'s shape for ``"none"``), or ``(loss, z_loss)``.
    Differentiable w.r.t. ``x``, ``weight`` and ``bias``. Raises ``TypeError``/``ValueError`` naming the
    argument for a wrong dtype, device, shape, stride or option.
    """
    op = "fused_linear_cross_entropy"
    x2, t1 = flatten_tokens(op, x, target)
    check_linear_inputs(op, x2, weight, t1, bias, class_weight)
    check_loss_options(
        op,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        reduction=reduction,
    )
    check_chunking(op, chunk_bytes, max_chunk_tokens)
    check_flag(op, "return_z_loss", return_z_loss)
    chunk = plan_chunk_tokens(
        x2.shape[0],
        weight.shape[0],
        x.element_size(),
        chunk_bytes=chunk_bytes,
        max_chunk_tokens=max_chunk_tokens,
    )
    options = (ignore_index, float(label_smoothing), float(lse_square_scale), float(softcap or 0.0))
    nx, nw, nb = needs_grads(x, weight, bias)
    if not (nx or nw or nb):
        loss, z, _, _ = lce_stats(x2, weight, t1, bias, class_weight, *options, 1.0, reduction, False, chunk)
    elif reduction == "none":
        loss, z, _, _ = LinearCrossEntropyRecomputeFunction.apply(
            x2, weight, t1, bias, class_weight, *options, 1.0, reduction, False, nx, nw, nb, chunk
        )
    else:
        loss, z = FusedLinearCrossEntropyFunction.apply(
            x2, weight, t1, bias, class_weight, *options, reduction, nx, nw, nb, chunk
        )
    if reduction == "none":
        loss, z = loss.view(target.shape), z.view(target.shape)
    loss = loss.to(x.dtype)
    return (loss, z.to(x.dtype)) if return_z_loss else loss


class LckFusedLinearCrossEntropyLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`fused_linear_cross_entropy`: ``forward(x, weight, target, bias=None)``.

    ``class_weight`` is registered as a buffer.
    """

    def __init__(
        self,
        class_weight: Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        reduction: str = "mean",
        return_z_loss: bool = False,
        chunk_bytes: int | None = None,
        max_chunk_tokens: int | None = None,
    ):
        super().__init__()
        op = "LckFusedLinearCrossEntropyLoss"
        check_loss_options(
            op,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale,
            softcap=softcap,
            reduction=reduction,
        )
        check_chunking(op, chunk_bytes, max_chunk_tokens)
        if class_weight is not None and not isinstance(class_weight, torch.Tensor):
            raise TypeError(f"{op}: class_weight must be None or a tensor, got {type(class_weight).__name__}")
        self.register_buffer("class_weight", class_weight)
        self.options = {
            "ignore_index": ignore_index,
            "label_smoothing": label_smoothing,
            "lse_square_scale": lse_square_scale,
            "softcap": softcap,
            "reduction": reduction,
            "return_z_loss": return_z_loss,
            "chunk_bytes": chunk_bytes,
            "max_chunk_tokens": max_chunk_tokens,
        }

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None):
        return fused_linear_cross_entropy(
            x, weight, target, bias, class_weight=self.class_weight, **self.options
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


__all__ = [
    "FusedLinearCrossEntropyFunction",
    "LckFusedLinearCrossEntropyLoss",
    "LinearCrossEntropyRecomputeFunction",
    "fused_linear_cross_entropy",
    "plan_chunk_tokens",
]
