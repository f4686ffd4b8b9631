"""Input checks of ``rms_norm`` and its ops: ``TypeError`` / ``ValueError`` naming the argument."""

from __future__ import annotations

import torch

from lck_kernels._common import check_choice, check_float, check_same_device, check_tensor, rows_view

CASTING_MODES = ("llama", "gemma", "none")  # the kernels' CASTING constexpr is the index: 0, 1, 2


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


def check_rms_norm_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str
) -> None:
    _check_x_weight(op, x, weight)
    check_float(op, "eps", eps, minimum=0.0)
    check_float(op, "offset", offset)
    check_choice(op, "casting_mode", casting_mode, CASTING_MODES)


def check_rms_norm_bwd_inputs(
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
