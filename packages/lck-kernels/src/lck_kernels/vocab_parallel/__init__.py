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
   device at each replay, giving a NaN loss instead of an error: ``capture.py``; a group of
   one rank has nothing to agree on and checks the target range on the device the same way);
2. one all-reduce of the per-row shard statistics ``[tokens, tp, 5]`` (an all-gather written as a sum):
   through the runtime's FLSCE context (NVSHMEM when ``lck_runtime.configure(flsce=...)`` made one for this
   group; capacities checked against its ``FusedLinearCrossEntropyConfig`` first), or
   ``torch.distributed.all_reduce`` on ``group`` when the group has no context.
The backward needs no communication: the forward already produced each row's global log-sum-exp.
The group plumbing both ops share, :class:`TPGroup` and :func:`agree`, lives in ``group.py``.

Also here: ``vocab_parallel_fused_linear_scaled_cross_entropy`` (FLSCE over a tensor-parallel group).

``x [..., H]`` is replicated on every rank of ``group``; rank ``r`` of ``tp`` holds ``weight_shard
[V/tp, H]``, the rows ``[r·V/tp, (r+1)·V/tp)`` of the output projection (Megatron's
``ColumnParallelLinear`` split). With ``z = inverse_temperature · (x @ Wᵀ)`` over the whole vocabulary the op
returns, per token, ``nll = lse(z) − z[target]``, ``lse = logsumexp(z)`` and optionally the entropy
``−Σ softmax(z)·log softmax(z)`` — what RL trainers need for log-probabilities, z-losses and entropy
bonuses — without materialising more than one ``[chunk, V/tp]`` block of logits per rank.

Forward (collective over ``group``): the call-agreement all-reduce (shapes, options, targets, see
``group.agree``), then per token chunk one cuBLAS GEMM into a reused logits buffer and
the shard-statistics kernel; one all-reduce of all chunks' statistics ``[tokens, tp, 5]`` (fp32) through the
runtime's FLSCE context (NVSHMEM) or torch.distributed; one combine kernel.

Gradients (collective over ``group`` when ``x`` needs one: the partial ``grad_x = dz W_shard`` of every
rank is summed across the group in one fp32 all-reduce of ``[tokens, H]``, within the configured capacity
``max_tokens · hidden``; ``grad_W_shard = dzᵀ x`` is local). Two modes:

- ``reduction="none"``: upstream gradients of nll, lse and entropy are arbitrary per-token tensors
  (policy-gradient weights, masks), unknown in the forward. The backward recomputes each chunk's logits
  (no statistics collective: the forward's global LSE and entropy are saved), writes ``dz`` in place over
  them and runs the two gradient GEMMs. One GEMM forward, three backward, each over ``V/tp``.
- ``reduction="sum"`` / ``"mean"`` with an input requiring grad: the forward computes the gradient of the
  reduced NLL chunk by chunk right after each chunk's statistics (the all-reduce then runs per chunk),
  keeps ``grad_x`` and ``grad_W_shard`` until backward and the backward only scales them by the upstream
  scalar — on the device, skipping the pass when it is 1. Three GEMMs in all: the training fast path, at
  the price of holding the two gradients between forward and backward. Gradients reaching lse/entropy in
  this mode go through the recompute path and are added.

Ignored targets give nll = lse = entropy = 0 and no gradient. The single-GPU op is

The family's files: ``kernels.py`` (Triton), ``launch.py``, ``checks.py``, ``ops.py`` (the CE's
``torch.library`` ops and autograd), ``flsce_ops.py`` (the FLSCE's), ``group.py`` (the group, its agreement
and its runtime context), ``capture.py`` (agreement inside CUDA-graph capture) and ``digest.py`` (target
digests); this module holds the functional API and the modules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lck_kernels._common import check_choice
from lck_kernels.cross_entropy.checks import check_loss_dtype
from lck_kernels.vocab_parallel.checks import FLSCE_OP
from lck_kernels.vocab_parallel.flsce_ops import _vp_flsce_fwd, chunk_rows
from lck_kernels.vocab_parallel.group import group_name_of
from lck_kernels.vocab_parallel.ops import _vp_cross_entropy_fwd

OP = "vocab_parallel_cross_entropy"
REDUCTIONS = ("none", "sum", "mean")
# Logits block per chunk: large enough that the chunk GEMMs run near cuBLAS peak (thousands of rows),
# small enough that the working set stays a fraction of a GB at V/tp = 64k.
DEFAULT_CHUNK_BYTES = 256 << 20

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "LckVocabParallelCrossEntropy",
    "LckVocabParallelFusedLinearScaledCrossEntropy",
    "chunk_rows",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_scaled_cross_entropy",
]


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
    loss_dtype: torch.dtype = torch.float32,
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
        loss_dtype: ``torch.float32`` (default) or ``logits_shard.dtype`` to have the loss rounded to it.

    Returns the loss in ``loss_dtype`` (computed in float32), equal to
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
    loss_dtype = check_loss_dtype(OP, loss_dtype, logits_shard.dtype)
    loss, _ = _vp_cross_entropy_fwd(logits_shard, target, name, float(label_smoothing), int(ignore_index))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / (target != ignore_index).sum()
    return loss.to(loss_dtype)


class LckVocabParallelCrossEntropy(torch.nn.Module):
    """``nn.Module`` form of :func:`vocab_parallel_cross_entropy` (``forward(logits_shard, target)``)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "none",
        loss_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        check_choice(OP, "reduction", reduction, ("none", "sum", "mean"))
        self.group = group
        self.label_smoothing = label_smoothing
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.loss_dtype = loss_dtype

    def forward(self, logits_shard: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits_shard,
            target,
            self.group,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            loss_dtype=self.loss_dtype,
        )


def vocab_parallel_fused_linear_scaled_cross_entropy(
    x: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    inverse_temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    reduction: str = "none",
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Cross entropy of ``inverse_temperature · (x @ Wᵀ)`` with ``W`` sharded over the vocabulary across
    ``group`` (collective over ``group``; the backward too when ``x`` requires a gradient).

    Args:
        x: ``[..., H]`` float32/float16/bfloat16, the same on every rank, unit stride in the last dimension.
        weight_shard: ``[V/tp, H]``, same dtype as ``x``; rank ``r`` holds vocabulary rows
            ``[r·V/tp, (r+1)·V/tp)``; every rank holds an equal shard.
        target: ``[...]`` int64/int32 indices into the whole vocabulary ``[0, V)`` or ``ignore_index``, the
            same on every rank.
        group: the tensor-parallel ``ProcessGroup``. Reductions go through the runtime's FLSCE context when
            ``lck_runtime.configure(flsce=...)`` prepared one for it (NVSHMEM on GPU; tokens, hidden size and
            local vocabulary are then checked against its ``FusedLinearCrossEntropyConfig``), else through
            ``torch.distributed``.
        inverse_temperature: finite, > 0; logits are multiplied by it before the softmax.
        ignore_index: targets equal to it give nll = lse = entropy = 0 and no gradient.
        return_entropy: also return the per-token entropy.
        reduction: applied to the NLL only: ``"none"`` (per token, shaped like ``target``), ``"sum"``, or
            ``"mean"`` over non-ignored tokens (NaN when all are ignored, as torch). lse and entropy stay per
            token. ``"sum"``/``"mean"`` compute the NLL gradient during the forward (three GEMMs in all
            instead of four; see the module docstring).
        chunk_bytes: logits working-set budget per chunk (default 256 MiB).

    Returns ``(nll, lse)`` or ``(nll, lse, entropy)``: float32; all differentiable w.r.t. ``x`` and
    ``weight_shard``, with any per-token upstream gradients.

    Validation: local problems (dtype, device, shape, stride, options) and disagreements between the ranks
    (tokens, hidden size, shard size, dtype, options, which inputs need gradients, targets and their range,
    runtime context) raise the same ``TypeError``/``ValueError`` on every rank; so does exceeding the
    configured capacities, before any kernel runs. A group of one rank skips the agreement's host read: a
    target outside the vocabulary makes nll and lse NaN there instead of raising.

    CUDA graphs: forward and backward can be captured once an eager call with the same shapes and options
    has run on the group (a warm-up; otherwise capture raises). At capture time the local problems and
    disagreements above (targets aside) still raise the same error on every rank, agreed through the host
    on a gloo group with the same members (made at the first eager call). The ranks cannot raise together
    at replay, so there a target that differs between ranks or lies outside the vocabulary makes nll and
    lse NaN.
    """
    name = group_name_of(FLSCE_OP, group)
    check_choice(FLSCE_OP, "reduction", reduction, REDUCTIONS)
    for arg, value in (("x", x), ("weight_shard", weight_shard), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{FLSCE_OP}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    grad_on = torch.is_grad_enabled()
    flags = int(grad_on and x.requires_grad) | (int(grad_on and weight_shard.requires_grad) << 1)
    nll, lse, entropy, _, _ = _vp_flsce_fwd(
        x,
        weight_shard,
        target,
        name,
        float(inverse_temperature),
        int(ignore_index),
        int(DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes),
        flags,
        REDUCTIONS.index(reduction),
    )
    return (nll, lse, entropy) if return_entropy else (nll, lse)


class LckVocabParallelFusedLinearScaledCrossEntropy(torch.nn.Module):
    """``nn.Module`` form: ``forward(x, weight_shard, target)`` with the group and options fixed."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        inverse_temperature: float = 1.0,
        ignore_index: int = -100,
        return_entropy: bool = False,
        reduction: str = "none",
        chunk_bytes: int | None = None,
    ) -> None:
        super().__init__()
        check_choice(FLSCE_OP, "reduction", reduction, REDUCTIONS)
        self.group = group
        self.options = dict(
            inverse_temperature=inverse_temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            reduction=reduction,
            chunk_bytes=chunk_bytes,
        )

    def forward(
        self, x: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return vocab_parallel_fused_linear_scaled_cross_entropy(
            x, weight_shard, target, self.group, **self.options
        )
