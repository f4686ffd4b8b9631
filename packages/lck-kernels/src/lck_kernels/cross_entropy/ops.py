"""The ``torch.library`` ops behind ``cross_entropy``, and the ``torch.autograd.Function``s wiring them.

Ops (``triton_op`` on GPUs, so ``torch.compile(fullgraph=True)`` traces into them): ``lck::cross_entropy_fwd``
(loss, z-loss, lse and optionally the gradient), ``lck::cross_entropy_fwd_`` (gradient into the logits),
``lck::cross_entropy_rescale_`` (the sum/mean backward), ``lck::cross_entropy_bwd`` and
``lck::cross_entropy_bwd_`` (the ``none`` backward, into a new buffer or the logits).

Every op validates its inputs before it launches anything; ``cross_entropy`` runs the same
``check_cross_entropy_inputs`` and ``check_loss_options`` before autograd. The ``torch.autograd.Function``s wiring the ops are at the end.
"""

from __future__ import annotations

import torch

from lck_kernels._common import check_tensor
from lck_kernels._eager import define_op, define_op_pair, direct, fast_apply
from lck_kernels.cross_entropy.checks import (
    check_cross_entropy_inputs,
    check_loss_options,
    unpack_saved_gradient,
)
from lck_kernels.cross_entropy.launch import (
    CEOptions,
    finalize_loss,
    launch_bwd,
    launch_fwd,
    launch_reduction,
    launch_rescale_rows,
)

# ---------------------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------------------


def _check_inputs(op: str, logits, target, weight, opts: CEOptions, reduction: str) -> None:
    check_cross_entropy_inputs(op, logits, target, weight)
    softcap = opts.softcap or None  # the ops take 0 for no cap
    check_loss_options(op, opts.ignore_index, opts.label_smoothing, opts.lse_square_scale, softcap, reduction)


def _forward(logits, target, weight, opts: CEOptions, reduction: str, grad):
    n, v = logits.shape
    red = launch_reduction(target, weight, v, opts.ignore_index, mean=reduction == "mean", wrap=True)
    ce = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    zl = torch.empty(n, dtype=torch.float32, device=logits.device) if opts.lse_square_scale > 0 else None
    applied = torch.empty(n if grad is not None else 0, dtype=torch.float32, device=logits.device)
    launch_fwd(
        logits, target, weight, red, opts, loss=ce, lse=lse, zloss=zl, grad=grad,
        applied=applied if grad is not None else None, wrap=True,
    )  # fmt: skip
    loss, z = finalize_loss(ce, zl, red, reduction, wrap=True)
    return loss, z, lse, applied


def _fwd_impl(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z_loss, lse, grad, applied); ``grad``/``applied`` are empty unless ``compute_grad``."""
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    if not direct():  # a direct call comes from cross_entropy or its autograd, after the same check
        _check_inputs("lck::cross_entropy_fwd", logits, target, weight, opts, reduction)
    grad = torch.empty(logits.shape if compute_grad else (0,), dtype=logits.dtype, device=logits.device)
    loss, z, lse, applied = _forward(logits, target, weight, opts, reduction, grad if compute_grad else None)
    return loss, z, lse, grad, applied


def _loss_fakes(logits: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z_loss, lse) shapes: float32, 0-D or one per row; lse one per row."""
    shape = (logits.shape[0],) if reduction == "none" else ()
    f32 = torch.float32
    return (
        logits.new_empty(shape, dtype=f32),
        logits.new_empty(shape, dtype=f32),
        logits.new_empty((logits.shape[0],), dtype=f32),
    )


def _fwd_fake(
    logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, compute_grad
):
    n = logits.shape[0]
    return (
        *_loss_fakes(logits, reduction),
        logits.new_empty(logits.shape if compute_grad else (0,)),
        logits.new_empty((n if compute_grad else 0,), dtype=torch.float32),
    )


cross_entropy_fwd = define_op("lck::cross_entropy_fwd", _fwd_impl, fake=_fwd_fake)


def _check_overwritable(op: str, logits: torch.Tensor) -> None:
    if logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]:
        raise ValueError(
            f"{op}: logits rows overlap (row stride {logits.stride(0)}); cannot write the gradient"
        )


def _fwd_inplace_impl(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z_loss, lse, applied); ``logits`` is overwritten with the gradient."""
    op = "lck::cross_entropy_fwd_"
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
    if not direct():
        _check_inputs(op, logits, target, weight, opts, reduction)
    _check_overwritable(op, logits)
    return _forward(logits, target, weight, opts, reduction, logits)


def _fwd_inplace_fake(
    logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction
):
    return (*_loss_fakes(logits, reduction), logits.new_empty((logits.shape[0],), dtype=torch.float32))


cross_entropy_fwd_ = define_op(
    "lck::cross_entropy_fwd_", _fwd_inplace_impl, mutates_args=("logits",), fake=_fwd_inplace_fake
)


def _rescale_impl(grad: torch.Tensor, applied: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``grad`` rows ← rows × ``grad_output / applied`` (0-D or one value per row); ``applied`` ← it."""
    op = "lck::cross_entropy_rescale_"
    if not direct():  # a direct call comes from CrossEntropyFunction.backward, on what its forward made
        _check_rescale_inputs(op, grad, applied, grad_output)
    launch_rescale_rows(grad, applied, grad_output, wrap=True)


def _check_rescale_inputs(
    op: str, grad: torch.Tensor, applied: torch.Tensor, grad_output: torch.Tensor
) -> None:
    check_tensor(op, "grad", grad, ndim=2, last_dim_contiguous=True)
    check_tensor(op, "applied", applied, dtypes=(torch.float32,), ndim=1, contiguous=True)
    check_tensor(op, "grad_output", grad_output, ndim=(0, 1))
    if applied.shape[0] != grad.shape[0] or (
        grad_output.dim() == 1 and grad_output.shape[0] != grad.shape[0]
    ):
        raise ValueError(
            f"{op}: grad {tuple(grad.shape)}, applied {tuple(applied.shape)} and grad_output "
            f"{tuple(grad_output.shape)} disagree on the number of rows"
        )


def _rescale_fake(grad, applied, grad_output):
    return None


cross_entropy_rescale_ = define_op(
    "lck::cross_entropy_rescale_", _rescale_impl, mutates_args=("grad", "applied"), fake=_rescale_fake
)


def _check_backward_inputs(op, logits, target, weight, lse, grad_output, opts: CEOptions) -> None:
    _check_inputs(op, logits, target, weight, opts, "none")
    n = logits.shape[0]
    check_tensor(op, "lse", lse, dtypes=(torch.float32,), ndim=1)
    check_tensor(op, "grad_output", grad_output, ndim=1)
    if lse.shape[0] != n or grad_output.shape[0] != n:
        raise ValueError(
            f"{op}: lse {tuple(lse.shape)} and grad_output {tuple(grad_output.shape)} must have one value per "
            f"row of logits {tuple(logits.shape)}"
        )


def _bwd_body(name: str, in_place: bool):
    """``lck::cross_entropy_bwd`` (the gradient into a new buffer) or, ``in_place``, ``lck::cross_entropy_bwd_``
    (the gradient over ``logits``)."""

    def impl(
        logits: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        lse: torch.Tensor,
        grad_output: torch.Tensor,
        ignore_index: int,
        label_smoothing: float,
        lse_square_scale: float,
        softcap: float,
    ):
        """``∂(Σ grad_output·loss)/∂logits`` for ``reduction="none"`` from the saved per-row lse."""
        if in_place:
            _check_overwritable(name, logits)
        opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap)
        if not direct():  # a direct call comes from CrossEntropyRowsFunction.backward, on what it saved
            _check_backward_inputs(name, logits, target, weight, lse, grad_output, opts)
        grad = logits if in_place else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        red = launch_reduction(target, weight, logits.shape[1], ignore_index, mean=False, wrap=True)
        launch_bwd(
            logits, grad, target, weight, red, opts, lse=lse, entropy=None, g_loss=grad_output, g_lse=None,
            g_entropy=None, wrap=True,
        )  # fmt: skip
        return None if in_place else grad

    return impl


def _bwd_fake(name: str, in_place: bool):
    def fake(logits, *rest):
        return None if in_place else torch.empty_like(logits, memory_format=torch.contiguous_format)

    return fake


cross_entropy_bwd, cross_entropy_bwd_ = define_op_pair(
    "lck::cross_entropy_bwd", _bwd_body, _bwd_fake, mutates="logits", returns=("torch.Tensor", "None")
)


# ---------------------------------------------------------------------------------------------------------
# Autograd, functional API, module
# ---------------------------------------------------------------------------------------------------------


class CrossEntropyFunction(torch.autograd.Function):
    """sum/mean: the forward computes loss and gradient; the backward rescales the gradient in place."""

    @staticmethod
    def forward(
        ctx,
        logits,
        target,
        weight,
        ignore_index,
        label_smoothing,
        lse_square_scale,
        softcap,
        reduction,
        in_place,
    ):
        args = (logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
        if in_place:
            loss, z, _, applied = cross_entropy_fwd_(*args)
            grad = logits
        else:
            loss, z, _, grad, applied = cross_entropy_fwd(*args, True)
        ctx.save_for_backward(grad, applied)
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, grad_loss, grad_z):
        grad, applied = unpack_saved_gradient(ctx, "cross_entropy")
        cross_entropy_rescale_(grad, applied, grad_loss)
        return grad, None, None, None, None, None, None, None, None


class CrossEntropyRowsFunction(torch.autograd.Function):
    """none: the forward keeps each row's lse; the backward writes the gradient (into the logits if asked)."""

    @staticmethod
    def forward(
        ctx, logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, in_place
    ):
        options = (ignore_index, label_smoothing, lse_square_scale, softcap)
        loss, z, lse, _, _ = cross_entropy_fwd(logits, target, weight, *options, "none", False)
        ctx.save_for_backward(logits, target, weight, lse)
        ctx.options, ctx.in_place = options, in_place
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, grad_loss, grad_z):
        logits, target, weight, lse = unpack_saved_gradient(ctx, "cross_entropy")
        if ctx.in_place:
            cross_entropy_bwd_(logits, target, weight, lse, grad_loss, *ctx.options)
            grad = logits
        else:
            grad = cross_entropy_bwd(logits, target, weight, lse, grad_loss, *ctx.options)
        return grad, None, None, None, None, None, None, None


cross_entropy_apply = fast_apply(CrossEntropyFunction)
cross_entropy_rows_apply = fast_apply(CrossEntropyRowsFunction)
