"""Vocabulary-parallel (tensor-parallel) cross entropy over a process group.

Each rank of ``group`` holds a contiguous shard of the vocabulary: rank ``r`` of ``tp`` ranks holds the
logits of classes ``[r·V/tp, (r+1)·V/tp)`` (Megatron's split). The per-token loss equals
``torch.nn.functional.cross_entropy`` on the gathered ``[..., V]`` logits (``ignore_index``,
``label_smoothing``, reductions), and the gradient of each shard is that of the gathered logits restricted
to the shard. Compared with Megatron's ``vocab_parallel_cross_entropy`` (per-token losses, no ignore
index), ignored targets here give a loss of 0 and a zero gradient, and ``reduction="mean"`` divides by the
number of non-ignored targets, as torch does.

Communication (collective over ``group``, every rank must call with the same shapes and options):
1. one small all-reduce that checks the call agrees across ranks (token count, shard size, options, the
   targets themselves and their range, each rank's input validity) and ends in a host sync, so a mismatch
   raises the *same* error on every rank before anything is launched (inside CUDA-graph capture the
   shapes and options must have been agreed by an eager call before, and the target checks run on the
   device at each replay, giving a NaN loss instead of an error: ``_vocab_parallel_capture``; a group of
   one rank has nothing to agree on and checks the target range on the device the same way);
2. one all-reduce of the per-row shard statistics ``[tokens, tp, 5]`` (an all-gather written as a sum):
   through the runtime's FLSCE context (NVSHMEM when ``lck_runtime.configure(flsce=...)`` made one for this
   group; capacities checked against its ``FusedLinearCrossEntropyConfig`` first), or
   ``torch.distributed.all_reduce`` on ``group`` when the group has no context.
The backward needs no communication: the forward already produced each row's global log-sum-exp.

The group plumbing this op shares with the fused linear variant
(``vocab_parallel_fused_linear_scaled_cross_entropy``), :class:`TPGroup` and :func:`agree`, lives in
``_vocab_parallel_group``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lck_kernels import _vocab_parallel_kernels as K
from lck_kernels._common import check_choice, check_same_device, check_tensor, rows_view
from lck_kernels._vocab_parallel_group import Field, TPGroup, agree, check_target, group_name_of

OP = "vocab_parallel_cross_entropy"

# ---------------------------------------------------------------------------------------------------------
# The torch.library ops
# ---------------------------------------------------------------------------------------------------------


def _check_vocab_parallel_cross_entropy_inputs(
    logits: Any, target: Any, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(OP, "logits_shard", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"{OP}: logits_shard must be [..., local_vocab] with local_vocab >= 1, got {tuple(logits.shape)}"
        )
    z = rows_view(OP, "logits_shard", logits)
    t = check_target(OP, target, tuple(logits.shape[:-1]), "logits_shard")
    check_same_device(OP, logits_shard=logits, target=target)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{OP}: label_smoothing must be in [0, 1], got {label_smoothing}")
    return z, t


@torch.library.custom_op("lck::vp_cross_entropy_fwd", mutates_args=())
def _vp_cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, group_name: str, label_smoothing: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and log-sum-exp (float32, shaped like ``target``). Collective over the group."""
    tp = TPGroup.resolve(OP, group_name)
    error: BaseException | None = None
    try:
        z, t = _check_vocab_parallel_cross_entropy_inputs(logits, target, label_smoothing)
        if tp.ctx is not None and logits.device != tp.ctx.device:
            raise ValueError(
                f"{OP}: logits_shard is on {logits.device} but lck_runtime.configure prepared {tp.ctx.device}"
            )
    except (TypeError, ValueError) as exc:
        error, z, t = exc, None, None
    tokens, local_vocab = (z.shape[0], z.shape[1]) if z is not None else (0, 0)
    fields = [
        Field("the operation (every rank must call the same op)", 1),
        Field("the number of tokens (logits_shard's leading dimensions)", tokens),
        Field(
            "the local vocabulary size logits_shard.shape[-1] (every rank must hold an equal shard)",
            local_vocab,
        ),
        Field("label_smoothing", float(label_smoothing)),
        Field("ignore_index", int(ignore_index)),
        Field("whether the group has a runtime FLSCE context (lck_runtime.configure)", tp.ctx is not None),
    ]
    vocab = tp.size * local_vocab
    verdict = agree(
        OP,
        tp,
        fields,
        error=error,
        target=t,
        ignore_index=ignore_index,
        vocab_size=vocab,
        device=tp.comm_device(logits),
    )
    assert z is not None and t is not None
    tp.check_capacity(OP, tokens, local_vocab=local_vocab)
    stats = torch.zeros(tokens, tp.size, K.STATS, device=z.device, dtype=torch.float32)
    K.shard_stats(
        z,
        t,
        stats,
        vocab_start=tp.rank * local_vocab,
        scale=1.0,
        ignore_index=ignore_index,
        slot=tp.rank,
        smoothing=label_smoothing > 0.0,
        entropy=False,
    )
    tp.all_reduce_(stats.view(-1), "sum")
    loss, lse, _ = K.combine(
        stats, t, ignore_index=ignore_index, label_smoothing=label_smoothing, vocab_size=vocab
    )
    if verdict is not None:  # captured, or a group of one rank: NaN where an agreement would have raised
        loss.add_(verdict)
        lse.add_(verdict)
    return loss.view(target.shape), lse.view(target.shape)


@_vp_cross_entropy_fwd.register_fake
def _(logits, target, group_name, label_smoothing, ignore_index):
    _check_vocab_parallel_cross_entropy_inputs(logits, target, label_smoothing)
    out = logits.new_empty(target.shape, dtype=torch.float32)
    return out, torch.empty_like(out)


@torch.library.custom_op("lck::vp_cross_entropy_bwd", mutates_args=())
def _vp_cross_entropy_bwd(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    group_name: str,
    label_smoothing: float,
    ignore_index: int,
) -> torch.Tensor:
    """``d loss / d logits_shard`` given the upstream per-token gradient. Local: no communication."""
    tp = TPGroup.resolve(OP, group_name)
    z = rows_view(OP, "logits_shard", logits)
    local_vocab = z.shape[1]
    grad = torch.empty(z.shape, device=z.device, dtype=z.dtype)
    g = grad_loss.reshape(-1)
    K.shard_grad(
        z,
        grad,
        target.reshape(-1),
        lse.reshape(-1).contiguous(),
        None,
        g_loss=g if g.dtype == torch.float32 else g.float(),
        vocab_start=tp.rank * local_vocab,
        vocab_size=tp.size * local_vocab,
        scale=1.0,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    return grad.view(logits.shape)


@_vp_cross_entropy_bwd.register_fake
def _(grad_loss, logits, target, lse, group_name, label_smoothing, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target, group_name, label_smoothing, ignore_index = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.options = (group_name, label_smoothing, ignore_index)


def _backward(ctx, grad_loss, grad_lse):
    logits, target, lse = ctx.saved_tensors
    grad = None
    if ctx.needs_input_grad[0]:
        grad = _vp_cross_entropy_bwd(grad_loss, logits, target, lse, *ctx.options)
    return grad, None, None, None, None


_vp_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)

# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "none",
) -> torch.Tensor:
    """Cross entropy of logits sharded over the vocabulary across ``group`` (collective over ``group``).

    Args:
        logits_shard: ``[..., V/tp]`` float32/float16/bfloat16, unit stride in the last dimension; rank
            ``r`` of ``group`` holds the classes ``[r·V/tp, (r+1)·V/tp)``. All ranks hold equal shards.
        target: ``[...]`` int64/int32 class indices into the *whole* vocabulary ``[0, V)``, the same on
            every rank, or ``ignore_index``.
        group: the tensor-parallel ``ProcessGroup``. Its reductions go through the runtime's FLSCE context
            when ``lck_runtime.configure(flsce=...)`` prepared one for it (capacities are then checked
            against that ``FusedLinearCrossEntropyConfig``), else through ``torch.distributed``.
        label_smoothing: in ``[0, 1]``, torch's definition (uniform over the whole vocabulary ``V``).
        ignore_index: targets equal to it give loss 0 and a zero gradient.
        reduction: ``"none"`` (per-token, shaped like ``target``), ``"sum"`` or ``"mean"`` (over the
            non-ignored targets; NaN when all are ignored, as in torch).

    Returns the loss in ``logits_shard.dtype`` (computed in float32), equal to
    ``F.cross_entropy(gathered_logits, target, ...)`` within rounding. Differentiable w.r.t.
    ``logits_shard``; the backward is local (no communication).

    Validation: local problems (dtype, device, shape, stride, option range) and disagreements between the
    ranks (token count, shard size, options, targets, target range, runtime context) raise the same
    ``TypeError``/``ValueError`` on every rank; so does exceeding the configured capacities. A group of one
    rank skips the agreement's host read (it would hold the host until the forward is done, once per call):
    a target outside the vocabulary makes the loss NaN there instead of raising, as ``cross_entropy`` does.

    CUDA graphs: the op can be captured once an eager call with the same shapes and options has run on
    the group (a warm-up; otherwise capture raises). At capture time the local problems and disagreements
    above (targets aside) still raise the same error on every rank, agreed through the host on a gloo group
    with the same members (made at the first eager call). The ranks cannot raise together at replay, so
    there a target that differs between ranks or lies outside the vocabulary makes the loss NaN instead.
    """
    name = group_name_of(OP, group)
    check_choice(OP, "reduction", reduction, ("none", "sum", "mean"))
    for arg, value in (("logits_shard", logits_shard), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{OP}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    loss, _ = _vp_cross_entropy_fwd(logits_shard, target, name, float(label_smoothing), int(ignore_index))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / (target != ignore_index).sum()
    return loss.to(logits_shard.dtype)


class LckVocabParallelCrossEntropy(torch.nn.Module):
    """``nn.Module`` form of :func:`vocab_parallel_cross_entropy` (``forward(logits_shard, target)``)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "none",
    ) -> None:
        super().__init__()
        check_choice(OP, "reduction", reduction, ("none", "sum", "mean"))
        self.group, self.label_smoothing, self.ignore_index, self.reduction = (
            group,
            label_smoothing,
            ignore_index,
            reduction,
        )

    def forward(self, logits_shard: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits_shard,
            target,
            self.group,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )
