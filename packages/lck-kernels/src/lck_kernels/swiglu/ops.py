"""The ``torch.library`` ops of both SwiGLU forms (namespace ``lck::``) and their ``torch.autograd.Function``s."""

from __future__ import annotations

import torch

from lck_kernels._common import rows_view
from lck_kernels._eager import define_op, direct, fast_apply
from lck_kernels.swiglu.checks import (
    check_swiglu_bwd_inputs,
    check_swiglu_inputs,
    check_swiglu_packed_bwd_inputs,
    check_swiglu_packed_inputs,
)
from lck_kernels.swiglu.launch import _halves, launch_bwd, launch_fwd

# ---------------------------------------------------------------------------------------------------------
# torch.library ops (namespace lck::)
# ---------------------------------------------------------------------------------------------------------


def _rows(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    # In a direct call (from the autograd functions) the inputs were checked already: just the view.
    return t.view(-1, t.shape[-1]) if direct() else rows_view(op, name, t)


def _fwd_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    op = "lck::swiglu_fwd"
    if not direct():  # a direct call comes from SwiGLUFunction, after swiglu checked the inputs
        check_swiglu_inputs(op, a, b)
    c = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    launch_fwd(_rows(op, "a", a), _rows(op, "b", b), c.view(-1, a.shape[-1]))
    return c


def _fwd_fake(a, b):
    check_swiglu_inputs("lck::swiglu_fwd", a, b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


_swiglu_fwd = define_op("lck::swiglu_fwd", _fwd_impl, fake=_fwd_fake)


def _bwd_impl(a: torch.Tensor, b: torch.Tensor, dc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    op = "lck::swiglu_bwd"
    if not direct():
        check_swiglu_bwd_inputs(op, a, b, dc)
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    db = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    n = a.shape[-1]
    launch_bwd(_rows(op, "a", a), _rows(op, "b", b), _rows(op, "dc", dc), da.view(-1, n), db.view(-1, n))
    return da, db


def _bwd_fake(a, b, dc):
    check_swiglu_bwd_inputs("lck::swiglu_bwd", a, b, dc)
    return (
        torch.empty_like(a, memory_format=torch.contiguous_format),
        torch.empty_like(a, memory_format=torch.contiguous_format),
    )


_swiglu_bwd = define_op("lck::swiglu_bwd", _bwd_impl, fake=_bwd_fake)


# ---------------------------------------------------------------------------------------------------------
# Autograd, functional API, module
# ---------------------------------------------------------------------------------------------------------


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wiring of ``lck::swiglu_fwd`` / ``lck::swiglu_bwd``."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _swiglu_fwd(a, b)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        if not dc.is_contiguous():
            dc = dc.contiguous()
        da, db = _swiglu_bwd(a, b, dc)
        return da, db


# ---------------------------------------------------------------------------------------------------------
# torch.library ops (namespace lck::)
# ---------------------------------------------------------------------------------------------------------


def _packed_fwd_impl(y: torch.Tensor) -> torch.Tensor:
    op = "lck::swiglu_packed_fwd"
    if not direct():  # a direct call comes from SwiGLUPackedFunction, after swiglu_packed checked y
        check_swiglu_packed_inputs(op, y)
    n = y.shape[-1] // 2
    out = torch.empty((*y.shape[:-1], n), dtype=y.dtype, device=y.device)
    gate, up = _halves(op, y)
    launch_fwd(gate, up, out.view(-1, n))
    return out


def _packed_fwd_fake(y):
    check_swiglu_packed_inputs("lck::swiglu_packed_fwd", y)
    return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))


_swiglu_packed_fwd = define_op("lck::swiglu_packed_fwd", _packed_fwd_impl, fake=_packed_fwd_fake)


def _packed_bwd_impl(y: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    op = "lck::swiglu_packed_bwd"
    if not direct():
        check_swiglu_packed_bwd_inputs(op, y, dout)
    n = y.shape[-1] // 2
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    gate, up = _halves(op, y)
    dy2 = dy.view(-1, 2 * n)
    launch_bwd(gate, up, _rows(op, "dout", dout), dy2[:, :n], dy2[:, n:])
    return dy


def _packed_bwd_fake(y, dout):
    check_swiglu_packed_bwd_inputs("lck::swiglu_packed_bwd", y, dout)
    return torch.empty_like(y, memory_format=torch.contiguous_format)


_swiglu_packed_bwd = define_op("lck::swiglu_packed_bwd", _packed_bwd_impl, fake=_packed_bwd_fake)


def _packed_bwd_inplace_impl(y: torch.Tensor, dout: torch.Tensor) -> None:
    """Overwrites ``y`` with the gradient of ``silu(gate) * up`` with respect to ``y``."""
    op = "lck::swiglu_packed_bwd_"
    if not direct():
        check_swiglu_packed_bwd_inputs(op, y, dout)
    gate, up = _halves(op, y)
    if gate.shape[0] > 1 and gate.stride(0) < 2 * gate.shape[1]:
        raise ValueError(
            f"{op}: y rows overlap (row stride {gate.stride(0)}); cannot write the gradient into it"
        )
    launch_bwd(gate, up, _rows(op, "dout", dout), gate, up)


def _packed_bwd_inplace_fake(y, dout):
    check_swiglu_packed_bwd_inputs("lck::swiglu_packed_bwd_", y, dout)


_swiglu_packed_bwd_ = define_op(
    "lck::swiglu_packed_bwd_", _packed_bwd_inplace_impl, mutates_args=("y",), fake=_packed_bwd_inplace_fake
)


# ---------------------------------------------------------------------------------------------------------
# Autograd and functional API
# ---------------------------------------------------------------------------------------------------------

_SECOND_BACKWARD = (
    "swiglu_packed(in_place=True): backward already ran through this graph and overwrote the input buffer "
    "with its gradient, so a second backward (retain_graph=True, or autograd.grad twice) would read a gradient "
    "as the activation. Recompute the forward, or use in_place=False where the graph is differentiated twice."
)


class SwiGLUPackedFunction(torch.autograd.Function):
    """Autograd wiring of ``lck::swiglu_packed_fwd`` / ``_bwd`` (``_bwd_`` when ``in_place``)."""

    @staticmethod
    def forward(ctx, y, in_place):
        out = _swiglu_packed_fwd(y)
        ctx.save_for_backward(y)
        ctx.in_place = in_place
        ctx.consumed = False
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.in_place and ctx.consumed:
            raise RuntimeError(_SECOND_BACKWARD)
        (y,) = ctx.saved_tensors
        if not dout.is_contiguous():
            dout = dout.contiguous()
        if not ctx.in_place:
            return _swiglu_packed_bwd(y, dout), None
        ctx.consumed = True
        _swiglu_packed_bwd_(y, dout)
        return y, None


swiglu_apply = fast_apply(SwiGLUFunction)
swiglu_packed_apply = fast_apply(SwiGLUPackedFunction)
