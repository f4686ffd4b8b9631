"""Input validation shared by the cross-entropy ops (plain, fused linear, scaled).

Every check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong value, shape, device or
layout) with a message that starts with the op's name and names the argument, before anything is
allocated or launched.
"""

from __future__ import annotations

import math

import torch

from lck_kernels._common import check_choice, check_same_device, check_tensor, dtype_name, rows_view

Tensor = torch.Tensor
REDUCTIONS = ("none", "sum", "mean")
TARGET_DTYPES = (torch.int64, torch.int32)


def check_loss_options(
    op: str,
    *,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    reduction: str,
) -> None:
    """The scalar options shared by the cross-entropy ops."""
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__}")
    for name, value in (("label_smoothing", label_smoothing), ("lse_square_scale", lse_square_scale)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(lse_square_scale) and lse_square_scale >= 0.0):
        raise ValueError(f"{op}: lse_square_scale must be finite and >= 0, got {lse_square_scale}")
    if softcap is not None:
        if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
            raise TypeError(f"{op}: softcap must be None or a float, got {type(softcap).__name__}")
        if not (math.isfinite(softcap) and softcap > 0.0):
            raise ValueError(f"{op}: softcap must be None or finite and > 0, got {softcap}")
    check_choice(op, "reduction", reduction, REDUCTIONS)


def check_target(op: str, target: torch.Tensor, rows: int, *, expected: str = "[tokens]") -> None:
    check_tensor(op, "target", target, dtypes=TARGET_DTYPES, ndim=1)
    if target.shape[0] != rows:
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)} but {expected} has {rows} rows; expected ({rows},)"
        )
    if target.shape[0] > 1 and target.stride(0) != 1:
        raise ValueError(
            f"{op}: target must be contiguous, got stride {target.stride(0)}; call .contiguous()"
        )


def check_class_weight(
    op: str, name: str, weight: torch.Tensor | None, vocab: int, ref: torch.Tensor
) -> None:
    if weight is None:
        return
    check_tensor(op, name, weight, ndim=1, contiguous=True)
    check_same_device(op, logits=ref, **{name: weight})
    if weight.shape[0] != vocab:
        raise ValueError(f"{op}: {name} has shape {tuple(weight.shape)}; expected ({vocab},), one per class")
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: {name} must not require grad (its gradient is not computed, as in torch)")


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


def unpack_saved_gradient(ctx, op: str) -> tuple[torch.Tensor, ...]:
    """``ctx.saved_tensors``, with a clear error when a buffer saved by the forward was modified since."""
    try:
        return ctx.saved_tensors
    except RuntimeError as exc:
        if "modified by an inplace operation" not in str(exc):
            raise
        raise RuntimeError(
            f"{op}: a buffer saved by the forward was modified before this backward. Either backward ran a "
            f"second time over the same graph (retain_graph=True), which {op} does not support where its "
            f"backward updates a saved buffer in place (the gradient computed in the forward for "
            f"reduction='sum'/'mean', or the logits with in_place=True): run the forward again; or an "
            f"in-place op wrote into the inputs {op} saved after its forward."
        ) from exc
