"""Input checks of the vocabulary-parallel ops, and the call agreement of
``vocab_parallel_fused_linear_scaled_cross_entropy``.

``_check_vp_flsce_inputs`` validates one rank's inputs (also run by the op's fake, so ``torch.compile``
sees the same errors); ``_agree_and_check`` adds the collective agreement over the group (see
``group.agree``) and the capacity check, so every rank raises the same error.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lck_kernels._common import FLOAT_DTYPES, check_same_device, check_tensor, dtype_name, rows_view
from lck_kernels.vocab_parallel.group import Field, TPGroup, agree, check_target

FLSCE_OP = "vocab_parallel_fused_linear_scaled_cross_entropy"
CE_OP = "vocab_parallel_cross_entropy"


def _check_vp_flsce_inputs(
    x: Any, weight: Any, target: Any, inverse_temperature: float, chunk_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(FLSCE_OP, "x", x, dtypes=FLOAT_DTYPES)
    check_tensor(FLSCE_OP, "weight_shard", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if x.dim() < 1:
        raise ValueError(f"{FLSCE_OP}: x must be [..., hidden], got a scalar")
    if weight.dtype != x.dtype:
        raise TypeError(
            f"{FLSCE_OP}: weight_shard has dtype {dtype_name(weight.dtype)} but x has {dtype_name(x.dtype)}; "
            f"they must match"
        )
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{FLSCE_OP}: weight_shard has shape {tuple(weight.shape)} but x's last dimension is {x.shape[-1]}; "
            f"expected [local_vocab, {x.shape[-1]}]"
        )
    if weight.shape[0] < 1:
        raise ValueError(
            f"{FLSCE_OP}: weight_shard must hold at least one vocabulary row, got {tuple(weight.shape)}"
        )
    x2 = rows_view(FLSCE_OP, "x", x)
    t = check_target(FLSCE_OP, target, tuple(x.shape[:-1]), "x")
    check_same_device(FLSCE_OP, x=x, weight_shard=weight, target=target)
    tau = float(inverse_temperature)
    if not math.isfinite(tau) or tau <= 0.0:
        raise ValueError(
            f"{FLSCE_OP}: inverse_temperature must be a finite number > 0, got {inverse_temperature}"
        )
    if int(chunk_bytes) < 1:
        raise ValueError(f"{FLSCE_OP}: chunk_bytes must be >= 1, got {chunk_bytes}")
    return x2, t


def _agree_and_check(tp: TPGroup, x, weight, target, tau, ignore_index, chunk_bytes, grad_flags, reduction):
    """Local validation, the collective agreement and the capacity check; returns (x2, t, local_vocab,
    verdict), ``verdict`` None, or inside CUDA-graph capture the 0-D tensor (0.0 or NaN) to add to the loss
    (see ``group.agree``)."""
    error: BaseException | None = None
    try:
        x2, t = _check_vp_flsce_inputs(x, weight, target, tau, chunk_bytes)
        tp.check_device(FLSCE_OP, "x", x)
    except (TypeError, ValueError) as exc:
        error, x2, t = exc, None, None
    tokens, hidden = (x2.shape[0], x2.shape[1]) if x2 is not None else (0, 0)
    local_vocab = weight.shape[0] if error is None else 0
    fields = [
        Field("the operation (every rank must call the same op)", 2),
        Field("the number of tokens (x's leading dimensions)", tokens),
        Field("the hidden size x.shape[-1]", hidden),
        Field(
            "the local vocabulary size weight_shard.shape[0] (every rank must hold an equal shard)",
            local_vocab,
        ),
        Field("the dtype of x and weight_shard", FLOAT_DTYPES.index(x.dtype) if error is None else -1),
        Field("inverse_temperature", float(tau)),
        Field("ignore_index", int(ignore_index)),
        Field("which of x and weight_shard require gradients", int(grad_flags)),
        Field("reduction", int(reduction)),
        Field("whether the group has a runtime FLSCE context (lck_runtime.configure)", tp.ctx is not None),
    ]
    verdict = agree(
        FLSCE_OP,
        tp,
        fields,
        error=error,
        target=t,
        ignore_index=ignore_index,
        vocab_size=tp.size * local_vocab,
        device=tp.comm_device(x),
    )
    assert x2 is not None and t is not None
    tp.check_capacity(FLSCE_OP, tokens, hidden=hidden, local_vocab=local_vocab)
    return x2, t, local_vocab, verdict


def check_vocab_parallel_cross_entropy_inputs(
    logits: Any, target: Any, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(CE_OP, "logits_shard", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"{CE_OP}: logits_shard must be [..., local_vocab] with local_vocab >= 1, got {tuple(logits.shape)}"
        )
    z = rows_view(CE_OP, "logits_shard", logits)
    t = check_target(CE_OP, target, tuple(logits.shape[:-1]), "logits_shard")
    check_same_device(CE_OP, logits_shard=logits, target=target)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{CE_OP}: label_smoothing must be in [0, 1], got {label_smoothing}")
    return z, t
