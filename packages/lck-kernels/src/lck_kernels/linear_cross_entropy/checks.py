"""Input checks of the fused linear cross-entropy ops: ``TypeError`` / ``ValueError`` naming the argument."""

from __future__ import annotations

import math

import torch

from lck_kernels._common import check_same_device, check_tensor, dtype_name, rows_view
from lck_kernels.cross_entropy.checks import (
    TARGET_DTYPES,
    check_class_weight,
    check_loss_options,
    check_target,
)

Tensor = torch.Tensor


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


def check_op_scalars(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_tokens):
    check_loss_options(op, ignore_index, label_smoothing, lse_square_scale, softcap or None, reduction)
    if chunk_tokens < 1:
        raise ValueError(f"{op}: chunk_tokens must be >= 1, got {chunk_tokens}")


def check_inverse_temperature(op: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{op}: inverse_temperature must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{op}: inverse_temperature must be finite and > 0, got {value}")
