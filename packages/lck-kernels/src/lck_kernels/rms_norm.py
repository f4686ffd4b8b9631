"""RMSNorm: ``y = x / sqrt(mean(x², -1) + eps) * (offset + weight)``, Triton forward and backward.

Casting modes (what is rounded where; reductions always accumulate in fp32, and ``offset + weight`` is
formed in fp32):

- ``"llama"`` (Hugging Face Llama): normalise in fp32, round the normalised row to ``x.dtype``, multiply by
  ``offset + weight`` in fp32, round the product to ``x.dtype``. With a weight in ``x.dtype`` and no
  offset this is the HF computation ``weight * (x.float() * rstd).to(x.dtype)`` (up to fp32 summation order).
- ``"gemma"`` (Hugging Face Gemma): everything in fp32, one rounding of the final product to ``x.dtype``:
  ``(x.float() * rstd * (offset + weight.float())).to(x.dtype)``.
- ``"none"``: no upcast of the elementwise steps, as eager code with every tensor in ``x.dtype``: ``rstd``
  (from the fp32 mean square), the normalised row, ``offset + weight`` and the product are each rounded to
  ``x.dtype``.

The output has ``x``'s dtype and shape (any rank ≥ 1; leading dimensions are rows). The backward is the
exact gradient of the unrounded function, computed in fp32 from ``x`` and the ``rstd`` saved by the forward.
The Triton kernels, their launch configuration and launches live in ``_rms_norm_kernels``; this module holds
the input checks, the ``torch.library`` ops, the autograd wiring, ``rms_norm`` and ``LckRMSNorm``.

``in_place=True`` writes ``dx`` into ``dy``'s buffer in the backward (no new activation-sized allocation).
Only use it when nothing else reads that gradient: a residual ``x + norm(x)`` hands the same gradient tensor
to both branches, and overwriting it can corrupt the other branch's gradient.
"""

from __future__ import annotations

import torch

from lck_kernels._common import (
    FLOAT_DTYPES,
    check_choice,
    check_float,
    check_same_device,
    check_tensor,
    define_op,
    rows_view,
)
from lck_kernels._rms_norm_kernels import MAX_BLOCK, bwd_config, fwd_config, launch_bwd, launch_fwd

CASTING_MODES = ("llama", "gemma", "none")  # the kernels' CASTING constexpr is the index: 0, 1, 2


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def _check_x_weight(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight, ndim=1)
    check_same_device(op, x=x, weight=weight)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)} but x's last dimension is {x.shape[-1]}"
        )
    if weight.shape[0] > 1 and weight.stride(0) != 1:
        raise ValueError(f"{op}: weight must be contiguous, got stride {weight.stride(0)}")
    rows_view(op, "x", x)


def _check_rms_norm_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> None:
    _check_x_weight(op, x, weight)
    check_float(op, "eps", eps, minimum=0.0)
    check_float(op, "offset", offset)
    check_choice(op, "casting_mode", casting_mode, CASTING_MODES)


def _check_rms_norm_bwd_inputs(
    op: str, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, casting_mode: str
) -> None:
    _check_x_weight(op, x, weight)
    check_tensor(op, "dy", dy, dtypes=(x.dtype,))
    check_tensor(op, "rstd", rstd, dtypes=(torch.float32,), ndim=1, contiguous=True)
    check_same_device(op, x=x, dy=dy, rstd=rstd)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy has shape {tuple(dy.shape)} but x has shape {tuple(x.shape)}")
    if rstd.shape[0] != x.numel() // x.shape[-1]:
        raise ValueError(f"{op}: rstd has {rstd.shape[0]} entries but x has {x.numel() // x.shape[-1]} rows")
    rows_view(op, "dy", dy)
    check_choice(op, "casting_mode", casting_mode, CASTING_MODES)


# ---------------------------------------------------------------------------------------------------------
# torch.library ops (namespace lck::)
# ---------------------------------------------------------------------------------------------------------


def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rms_norm_inputs("lck::rms_norm_fwd", x, weight, eps, offset, casting_mode)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, y2 = rows_view("lck::rms_norm_fwd", "x", x), y.view(-1, x.shape[-1])
    rstd = torch.empty((x2.shape[0],), dtype=torch.float32, device=x.device)
    if x2.shape[0] > 0:
        launch_fwd(x2, weight, y2, rstd, eps, offset, CASTING_MODES.index(casting_mode))
    return y, rstd


def _fwd_fake(x, weight, eps, offset, casting_mode):
    _check_rms_norm_inputs("lck::rms_norm_fwd", x, weight, eps, offset, casting_mode)
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        (rows,), dtype=torch.float32
    )


_rms_norm_fwd = define_op("lck::rms_norm_fwd", _fwd_impl, fake=_fwd_fake)


def _bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "lck::rms_norm_bwd"
    _check_rms_norm_bwd_inputs(op, dy, x, weight, rstd, casting_mode)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rstd.shape[0] == 0:
        return dx, torch.zeros_like(weight)
    dw = launch_bwd(
        rows_view(op, "dy", dy), rows_view(op, "x", x), weight, rstd, dx.view(-1, x.shape[-1]),
        offset, CASTING_MODES.index(casting_mode),
    )  # fmt: skip
    return dx, dw.to(weight.dtype)


def _bwd_fake(dy, x, weight, rstd, offset, casting_mode):
    _check_rms_norm_bwd_inputs("lck::rms_norm_bwd", dy, x, weight, rstd, casting_mode)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


_rms_norm_bwd = define_op("lck::rms_norm_bwd", _bwd_impl, fake=_bwd_fake)


def _bwd_inplace_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    casting_mode: str,
) -> torch.Tensor:
    """Writes ``dx`` into ``dy`` (which must not have overlapping rows); returns ``dweight``."""
    op = "lck::rms_norm_bwd_"
    _check_rms_norm_bwd_inputs(op, dy, x, weight, rstd, casting_mode)
    dy2 = rows_view(op, "dy", dy)
    if dy2.shape[0] > 1 and dy2.stride(0) < dy2.shape[1]:
        raise ValueError(
            f"{op}: dy rows overlap (row stride {dy2.stride(0)} < {dy2.shape[1]}); cannot write dx into it"
        )
    if rstd.shape[0] == 0:
        return torch.zeros_like(weight)
    dw = launch_bwd(dy2, rows_view(op, "x", x), weight, rstd, dy2, offset, CASTING_MODES.index(casting_mode))
    return dw.to(weight.dtype)


def _bwd_inplace_fake(dy, x, weight, rstd, offset, casting_mode):
    _check_rms_norm_bwd_inputs("lck::rms_norm_bwd_", dy, x, weight, rstd, casting_mode)
    return torch.empty_like(weight)


_rms_norm_bwd_ = define_op(
    "lck::rms_norm_bwd_", _bwd_inplace_impl, mutates_args=("dy",), fake=_bwd_inplace_fake
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


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale by ``offset + weight``.

    Args:
        x: ``[..., hidden]`` float32/float16/bfloat16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``); its
            leading dimensions must collapse into rows without a copy (contiguous, or a column slice).
        weight: ``[hidden]`` contiguous float tensor on ``x``'s device (any of the three float dtypes).
        eps: added to the mean square before the reciprocal square root (finite, ≥ 0).
        offset: added to ``weight`` (Gemma uses 1.0 with a zero-initialised weight).
        casting_mode: ``"llama"``, ``"gemma"`` or ``"none"`` (module docstring says exactly what each rounds).
        in_place: write ``dx`` into the incoming gradient's buffer in backward (see the module docstring
            for when that is unsafe).

    Returns ``y`` with ``x``'s shape and dtype (contiguous). Differentiable in ``x`` and ``weight``.
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong dtype, device, shape or stride.
    """
    _check_rms_norm_inputs("rms_norm", x, weight, eps, offset, casting_mode)
    if not isinstance(in_place, bool):
        raise TypeError(f"rms_norm: in_place must be a bool, got {type(in_place).__name__}")
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), casting_mode, in_place)


class LckRMSNorm(torch.nn.Module):
    """RMSNorm layer: ``rms_norm(x, self.weight, eps, offset, casting_mode, in_place)``.

    ``weight`` is ``[hidden_size]``, filled with ``init`` (1.0 for Llama; 0.0 with ``offset=1.0`` for Gemma).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        in_place: bool = False,
        init: float = 1.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"LckRMSNorm: hidden_size must be a positive int, got {hidden_size!r}")
        check_choice("LckRMSNorm", "casting_mode", casting_mode, CASTING_MODES)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"LckRMSNorm: dtype must be float32, float16 or bfloat16, got {dtype}")
        self.hidden_size, self.eps, self.offset = hidden_size, float(eps), float(offset)
        self.casting_mode, self.in_place = casting_mode, bool(in_place)
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), float(init), device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, self.casting_mode, self.in_place)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, "
            f"casting_mode={self.casting_mode!r}, in_place={self.in_place}"
        )


# MAX_BLOCK and the launch configs are re-exported: tests and the tuning script read them here.
__all__ = [
    "CASTING_MODES",
    "MAX_BLOCK",
    "LckRMSNorm",
    "RMSNormFunction",
    "bwd_config",
    "fwd_config",
    "rms_norm",
]
