"""Input validation of the cross-entropy ops, shared by the fused linear ones (plain, scaled, vocab-parallel).

Every check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong value, shape, device or
layout) with a message that starts with the op's name and names the argument, before anything is
allocated or launched.
"""

from __future__ import annotations

import math

import torch

from lck_kernels._common import check_choice, check_same_device, check_tensor

Tensor = torch.Tensor
REDUCTIONS = ("none", "sum", "mean")
TARGET_DTYPES = (torch.int64, torch.int32)


def check_loss_dtype(op: str, loss_dtype: object, input_dtype: torch.dtype) -> torch.dtype:
    """``loss_dtype`` must be float32 (the default: the losses are computed in float32) or the input's dtype
    (rounding the loss to it, as lck returned it before float32 became the default)."""
    if not isinstance(loss_dtype, torch.dtype):
        raise TypeError(f"{op}: loss_dtype must be a torch.dtype, got {type(loss_dtype).__name__}")
    if loss_dtype not in (torch.float32, input_dtype):
        raise ValueError(
            f"{op}: loss_dtype must be torch.float32 or the input's dtype {input_dtype}, got {loss_dtype}"
        )
    return loss_dtype


def check_loss_options(
    op: str,
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


def check_cross_entropy_inputs(
    op: str, logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None
) -> None:
    """The tensors of ``cross_entropy`` and its ops; the scalar options go to :func:`check_loss_options`."""
    check_tensor(op, "logits", logits, ndim=2, last_dim_contiguous=True)
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits has shape {tuple(logits.shape)}; expected at least one class")
    check_target(op, target, logits.shape[0], expected="logits")
    check_same_device(op, logits=logits, target=target)
    check_class_weight(op, "weight", weight, logits.shape[1], logits)


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
