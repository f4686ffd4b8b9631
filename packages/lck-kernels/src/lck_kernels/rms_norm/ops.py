"""The ``torch.library`` ops of ``rms_norm`` (namespace ``lck::``) and its ``torch.autograd.Function``."""

from __future__ import annotations

import torch

from lck_kernels._common import rows_view
from lck_kernels._eager import define_op, define_op_pair, direct, fast_apply
from lck_kernels.rms_norm.checks import CASTING_MODES, check_rms_norm_bwd_inputs, check_rms_norm_inputs
from lck_kernels.rms_norm.launch import launch_bwd, launch_fwd

# ---------------------------------------------------------------------------------------------------------
# torch.library ops (namespace lck::)
# ---------------------------------------------------------------------------------------------------------


def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if not direct():  # a direct call comes from RMSNormFunction, after rms_norm checked the inputs
        check_rms_norm_inputs("lck::rms_norm_fwd", x, weight, eps, offset, casting_mode)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, y2 = x.view(-1, x.shape[-1]), y.view(-1, x.shape[-1])
    rstd = torch.empty((x2.shape[0],), dtype=torch.float32, device=x.device)
    if x2.shape[0] > 0:
        launch_fwd(x2, weight, y2, rstd, eps, offset, CASTING_MODES.index(casting_mode))
    return y, rstd


def _fwd_fake(x, weight, eps, offset, casting_mode):
    check_rms_norm_inputs("lck::rms_norm_fwd", x, weight, eps, offset, casting_mode)
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        (rows,), dtype=torch.float32
    )


_rms_norm_fwd = define_op("lck::rms_norm_fwd", _fwd_impl, fake=_fwd_fake)


def _bwd_body(name: str, in_place: bool):
    """``lck::rms_norm_bwd`` (``dx`` into a new buffer; returns ``(dx, dweight)``) or, ``in_place``,
    ``lck::rms_norm_bwd_`` (``dx`` over ``dy``, whose rows must not overlap; returns ``dweight``)."""

    def impl(
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        rstd: torch.Tensor,
        offset: float,
        casting_mode: str,
    ):
        # A direct call comes from RMSNormFunction's backward, on tensors the forward checked.
        if not direct():
            check_rms_norm_bwd_inputs(name, dy, x, weight, rstd, casting_mode)
        n = x.shape[-1]
        if in_place:
            dy2 = rows_view(name, "dy", dy)
            if dy2.shape[0] > 1 and dy2.stride(0) < dy2.shape[1]:
                raise ValueError(
                    f"{name}: dy rows overlap (row stride {dy2.stride(0)} < {dy2.shape[1]}); "
                    "cannot write dx into it"
                )
            dx = dx2 = dy2
        else:
            dy2 = dy.view(-1, n)
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            dx2 = dx.view(-1, n)
        if rstd.shape[0] == 0:
            dw = torch.zeros_like(weight)
        else:
            dw = launch_bwd(dy2, x.view(-1, n), weight, rstd, dx2, offset, CASTING_MODES.index(casting_mode))
        return dw if in_place else (dx, dw)

    return impl


def _bwd_fake(name: str, in_place: bool):
    def fake(dy, x, weight, rstd, offset, casting_mode):
        check_rms_norm_bwd_inputs(name, dy, x, weight, rstd, casting_mode)
        dw = torch.empty_like(weight)
        return dw if in_place else (torch.empty_like(x, memory_format=torch.contiguous_format), dw)

    return fake


_rms_norm_bwd, _rms_norm_bwd_ = define_op_pair(
    "lck::rms_norm_bwd",
    _bwd_body,
    _bwd_fake,
    mutates="dy",
    returns=("tuple[torch.Tensor, torch.Tensor]", "torch.Tensor"),
)


# ---------------------------------------------------------------------------------------------------------
# Autograd, functional API, module
# ---------------------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """Autograd wiring of ``lck::rms_norm_fwd`` / ``lck::rms_norm_bwd`` (``_bwd_`` when ``in_place``)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place):
        y, rstd = _rms_norm_fwd(x, weight, eps, offset, casting_mode)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if not dy.is_contiguous():  # e.g. an expanded gradient of a sum: give the kernel real rows
            dy = dy.contiguous()
        if ctx.in_place:
            dw = _rms_norm_bwd_(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
            dx = dy
        else:
            dx, dw = _rms_norm_bwd(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None, None


rms_norm_apply = fast_apply(RMSNormFunction)
