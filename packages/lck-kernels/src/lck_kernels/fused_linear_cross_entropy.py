"""Fused linear cross entropy: ``cross_entropy(x @ weight.T + bias, target)`` without ``[tokens, vocab]`` logits.

The loss options and their semantics are those of :func:`lck_kernels.cross_entropy.cross_entropy`
(``class_weight`` is its ``weight``); the chunked schedules, the chunk budget and the precision choices are
described in ``lck_kernels._linear_cross_entropy``. In short: for ``reduction="sum"``/``"mean"`` every
gradient is finished in the forward (three GEMMs per token) and the backward is a device-side rescale that
costs one launch when the incoming gradient is 1; for ``reduction="none"`` the forward keeps each token's
log-sum-exp and the backward recomputes the logits (four GEMMs per token). Inputs that do not require grad
skip their GEMMs; without any grad the forward is one GEMM per token. Extra memory is the logits chunk
(``chunk_bytes``, default 512 MiB) plus ``[tokens]`` float32 rows, at any token count.

Ops (opaque ``torch.library.custom_op``: they mix cuBLAS GEMMs and Triton launches over chunks):
``lck::fused_linear_cross_entropy_fwd`` and ``lck::fused_linear_cross_entropy_rescale_`` (gradients in the
forward), ``lck::linear_cross_entropy_stats`` and ``lck::linear_cross_entropy_bwd`` (the recompute schedule,
shared with :mod:`lck_kernels.fused_linear_scaled_cross_entropy`).
"""

from __future__ import annotations

import torch

from lck_kernels._common import check_same_device, check_tensor, dtype_name, rows_view
from lck_kernels._cross_entropy_launch import CEOptions, launch_rescale_flat
from lck_kernels._linear_cross_entropy import (
    backward_recompute,
    forward_stats,
    forward_with_grads,
    plan_chunk_tokens,
)
from lck_kernels.cross_entropy import (
    TARGET_DTYPES,
    check_class_weight,
    check_loss_options,
    check_target,
    unpack_saved_gradient,
)

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------------------
# Validation (shared with the scaled op)
# ---------------------------------------------------------------------------------------------------------


def flatten_tokens(op: str, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[..., H]`` → ``[N, H]`` view and ``target`` (shape ``x.shape[:-1]``) → contiguous ``[N]``."""
    check_tensor(op, "x", x)
    check_tensor(op, "target", target, dtypes=TARGET_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must be at least 1-D ([..., hidden]), got a scalar")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)}; expected x's leading shape {tuple(x.shape[:-1])}"
        )
    return rows_view(op, "x", x), target.reshape(-1)


def check_linear_inputs(
    op: str, x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, class_weight: Tensor | None
) -> None:
    """``x`` ``[N, H]``, ``weight`` ``[V, H]`` and ``bias`` ``[V]`` of one dtype, ``target`` ``[N]``, one device."""
    check_tensor(op, "x", x, ndim=2)
    check_tensor(op, "weight", weight, ndim=2)
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight has dtype {dtype_name(weight.dtype)} but x has {dtype_name(x.dtype)}")
    if weight.shape[1] != x.shape[1] or weight.shape[0] == 0:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)}; expected (vocab >= 1, {x.shape[1]}) for x of "
            f"shape {tuple(x.shape)}"
        )
    check_target(op, target, x.shape[0], expected="x")
    check_same_device(op, x=x, weight=weight, target=target)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1)
        if bias.dtype != x.dtype:
            raise TypeError(f"{op}: bias has dtype {dtype_name(bias.dtype)} but x has {dtype_name(x.dtype)}")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},)")
        check_same_device(op, x=x, bias=bias)
    check_class_weight(op, "class_weight", class_weight, weight.shape[0], x)


def check_chunking(op: str, chunk_bytes: int | None, max_chunk_tokens: int | None) -> None:
    for name, value in (("chunk_bytes", chunk_bytes), ("max_chunk_tokens", max_chunk_tokens)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be None or an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{op}: {name} must be >= 1, got {value}")


def check_flag(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def _check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens):
    check_loss_options(
        op,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap or None,
        reduction=reduction,
    )
    if chunk_tokens < 1:
        raise ValueError(f"{op}: chunk_tokens must be >= 1, got {chunk_tokens}")


def _empty_like_shapes(x, weight, bias, need_x, need_w, need_b):
    return (
        x.new_empty(x.shape if need_x else (0,)),
        weight.new_empty(weight.shape if need_w else (0,)),
        x.new_empty(
            (weight.shape[0],) if need_b else (0,), dtype=bias.dtype if bias is not None else torch.float32
        ),
    )


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
    _check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens)
    if reduction == "none":
        raise ValueError(f"{op}: reduction='none' takes the recompute schedule (lck::linear_cross_entropy_*)")
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    out = forward_with_grads(
        x, weight, target, bias, class_weight, opts, reduction, need_x, need_w, need_b, chunk_tokens
    )
    return (*out, torch.ones(1, dtype=torch.float32, device=x.device))


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
    grads = _empty_like_shapes(x, weight, bias, need_x, need_w, need_b)
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
# Ops: the recompute schedule (reduction="none" here; every call of the scaled op)
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("lck::linear_cross_entropy_stats", mutates_args=())
def _lce_stats(
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
    _check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens)
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap, inverse_temperature)
    return forward_stats(x, weight, target, bias, class_weight, opts, reduction, return_entropy, chunk_tokens)


@_lce_stats.register_fake
def _(x, weight, target, bias, class_weight, ii, ls, zs, softcap, inv_t, reduction, return_entropy, chunk):
    check_linear_inputs("lck::linear_cross_entropy_stats", x, weight, target, bias, class_weight)
    n = x.shape[0]
    shape = (n,) if reduction == "none" else ()
    rows = x.new_empty((n,), dtype=torch.float32)
    ent = x.new_empty((n if return_entropy else 0,), dtype=torch.float32)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.float32), rows, ent


@torch.library.custom_op("lck::linear_cross_entropy_bwd", mutates_args=())
def _lce_bwd(
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
    _check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens)
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


@_lce_bwd.register_fake
def _(x, weight, target, bias, class_weight, lse, entropy, g_loss, g_lse, g_entropy, *rest):
    need_x, need_w, need_b = rest[6:9]
    return _empty_like_shapes(x, weight, bias, need_x, need_w, need_b)


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
        loss, z, lse, entropy = _lce_stats(
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
        gx, gw, gb = _lce_bwd(
            x, weight, target, bias, class_weight, lse, entropy if ent else None, g_loss, g_lse,
            g_entropy if ent else None, *ctx.options, nx, nw, nb, chunk,
        )  # fmt: skip
        return (gx if nx else None, gw if nw else None, None, gb if nb else None) + (None,) * 12


# ---------------------------------------------------------------------------------------------------------
# Functional API and module
# ---------------------------------------------------------------------------------------------------------


def needs_grads(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[bool, bool, bool]:
    on = torch.is_grad_enabled()
    return on and x.requires_grad, on and weight.requires_grad, on and bias is not None and bias.requires_grad


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
        loss, z, _, _ = _lce_stats(x2, weight, t1, bias, class_weight, *options, 1.0, reduction, False, chunk)
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
