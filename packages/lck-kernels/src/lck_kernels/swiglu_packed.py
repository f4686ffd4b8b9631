"""Fused gate-up SwiGLU on one packed buffer: ``y[..., :n]`` is the gate, ``y[..., n:]`` the up projection,
``out = silu(gate) * up`` of shape ``[..., n]``.

This is the layout Megatron-Core's fused MLP produces (one GEMM into ``[tokens, 2n]`` or ``[seq, batch,
2n]``). Both halves are read straight from the packed buffer (row stride ``2n``, no ``torch.chunk`` copies);
numerics are those of :func:`lck_kernels.swiglu` (fp32 math, one rounding per output), and the Triton
kernels are the same.

``in_place=True`` makes the backward write the input gradient ``[..., 2n]`` into ``y`` itself instead of a new
buffer: the largest activation-sized allocation of the MLP backward disappears (about 20% of this block's
activation memory). ``y`` then holds the gradient, so the graph can be differentiated only once; a second
backward (``retain_graph=True``) raises ``RuntimeError`` instead of silently using a gradient as input.
Under ``torch.compile`` the in-place write is functionalised (a fresh buffer is used, gradients stay correct);
the memory saving applies to eager execution.
"""

from __future__ import annotations

import torch

from lck_kernels._common import check_tensor, define_op, rows_view
from lck_kernels.swiglu import launch_bwd, launch_fwd

# ---------------------------------------------------------------------------------------------------------
# Validation and launches (the Triton kernels live in lck_kernels.swiglu)
# ---------------------------------------------------------------------------------------------------------


def _check_swiglu_packed_inputs(op: str, y: torch.Tensor) -> None:
    check_tensor(op, "y", y)
    if y.dim() == 0 or y.shape[-1] == 0 or y.shape[-1] % 2:
        raise ValueError(
            f"{op}: y must be [..., 2n] with an even, non-zero last dimension (gate then up), got shape {tuple(y.shape)}"
        )
    rows_view(op, "y", y)


def _check_swiglu_packed_bwd_inputs(op: str, y: torch.Tensor, dout: torch.Tensor) -> None:
    _check_swiglu_packed_inputs(op, y)
    check_tensor(op, "dout", dout, dtypes=(y.dtype,))
    want = (*y.shape[:-1], y.shape[-1] // 2)
    if tuple(dout.shape) != want:
        raise ValueError(
            f"{op}: dout has shape {tuple(dout.shape)}; expected {want} for y of shape {tuple(y.shape)}"
        )
    if dout.device != y.device:
        raise ValueError(f"{op}: dout is on {dout.device} but y is on {y.device}")
    rows_view(op, "dout", dout)


def _halves(op: str, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up views ``[rows, n]`` of ``y`` (row stride that of ``y``, no copy)."""
    y2 = rows_view(op, "y", y)
    n = y2.shape[1] // 2
    return y2[:, :n], y2[:, n:]


# ---------------------------------------------------------------------------------------------------------
# torch.library ops (namespace lck::)
# ---------------------------------------------------------------------------------------------------------


def _fwd_impl(y: torch.Tensor) -> torch.Tensor:
    op = "lck::swiglu_packed_fwd"
    _check_swiglu_packed_inputs(op, y)
    n = y.shape[-1] // 2
    out = torch.empty((*y.shape[:-1], n), dtype=y.dtype, device=y.device)
    gate, up = _halves(op, y)
    launch_fwd(gate, up, out.view(-1, n))
    return out


def _fwd_fake(y):
    _check_swiglu_packed_inputs("lck::swiglu_packed_fwd", y)
    return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))


_swiglu_packed_fwd = define_op("lck::swiglu_packed_fwd", _fwd_impl, fake=_fwd_fake)


def _bwd_impl(y: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    op = "lck::swiglu_packed_bwd"
    _check_swiglu_packed_bwd_inputs(op, y, dout)
    n = y.shape[-1] // 2
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    gate, up = _halves(op, y)
    dy2 = dy.view(-1, 2 * n)
    launch_bwd(gate, up, rows_view(op, "dout", dout), dy2[:, :n], dy2[:, n:])
    return dy


def _bwd_fake(y, dout):
    _check_swiglu_packed_bwd_inputs("lck::swiglu_packed_bwd", y, dout)
    return torch.empty_like(y, memory_format=torch.contiguous_format)


_swiglu_packed_bwd = define_op("lck::swiglu_packed_bwd", _bwd_impl, fake=_bwd_fake)


def _bwd_inplace_impl(y: torch.Tensor, dout: torch.Tensor) -> None:
    """Overwrites ``y`` with the gradient of ``silu(gate) * up`` with respect to ``y``."""
    op = "lck::swiglu_packed_bwd_"
    _check_swiglu_packed_bwd_inputs(op, y, dout)
    gate, up = _halves(op, y)
    if gate.shape[0] > 1 and gate.stride(0) < 2 * gate.shape[1]:
        raise ValueError(
            f"{op}: y rows overlap (row stride {gate.stride(0)}); cannot write the gradient into it"
        )
    launch_bwd(gate, up, rows_view(op, "dout", dout), gate, up)


def _bwd_inplace_fake(y, dout):
    _check_swiglu_packed_bwd_inputs("lck::swiglu_packed_bwd_", y, dout)


_swiglu_packed_bwd_ = define_op(
    "lck::swiglu_packed_bwd_", _bwd_inplace_impl, mutates_args=("y",), fake=_bwd_inplace_fake
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


def swiglu_packed(y: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``silu(y[..., :n]) * y[..., n:]`` for a packed gate-up buffer ``y`` of shape ``[..., 2n]``.

    ``y`` is a float32/float16/bfloat16 tensor on the kernel device (CUDA; CPU under ``TRITON_INTERPRET=1``)
    with an even last dimension of unit stride and leading dimensions that collapse into rows without a copy
    (2-D ``[tokens, 2n]`` and Megatron's 3-D ``[seq, batch, 2n]`` both qualify). Returns a contiguous
    ``[..., n]`` tensor in ``y``'s dtype. With ``in_place=True`` the backward writes the gradient into ``y``
    (``y``'s contents are lost; a second backward through the graph raises ``RuntimeError``).
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong dtype, device, shape or stride.
    """
    _check_swiglu_packed_inputs("swiglu_packed", y)
    if not isinstance(in_place, bool):
        raise TypeError(f"swiglu_packed: in_place must be a bool, got {type(in_place).__name__}")
    return SwiGLUPackedFunction.apply(y, in_place)


class LckSwiGLUPacked(torch.nn.Module):
    """The fused gate-up activation as a module: ``swiglu_packed(y, in_place)`` on ``[..., 2n]`` input.

    For models whose first projection emits gate and up in one buffer (Megatron's ``linear_fc1``, a fused
    ``gate_up_proj``). ``in_place=True`` writes the backward's gradient into that buffer (the buffer is not
    kept for anything else; a second backward through the graph raises). No parameters.
    """

    def __init__(self, in_place: bool = False):
        super().__init__()
        if not isinstance(in_place, bool):
            raise TypeError(f"LckSwiGLUPacked: in_place must be a bool, got {type(in_place).__name__}")
        self.in_place = in_place

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu_packed(y, in_place=self.in_place)

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"
