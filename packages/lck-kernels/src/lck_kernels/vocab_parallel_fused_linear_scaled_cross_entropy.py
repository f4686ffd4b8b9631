"""Vocabulary-parallel fused linear scaled cross entropy (FLSCE) over a tensor-parallel group.

``x [..., H]`` is replicated on every rank of ``group``; rank ``r`` of ``tp`` holds ``weight_shard
[V/tp, H]``, the rows ``[r·V/tp, (r+1)·V/tp)`` of the output projection (Megatron's
``ColumnParallelLinear`` split). With ``z = inverse_temperature · (x @ Wᵀ)`` over the whole vocabulary the op
returns, per token, ``nll = lse(z) − z[target]``, ``lse = logsumexp(z)`` and optionally the entropy
``−Σ softmax(z)·log softmax(z)`` — what RL trainers need for log-probabilities, z-losses and entropy
bonuses — without materialising more than one ``[chunk, V/tp]`` block of logits per rank.

Forward (collective over ``group``): the call-agreement all-reduce (shapes, options, targets, see
``_vocab_parallel_group.agree``), then per token chunk one cuBLAS GEMM into a reused logits buffer and
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
``lck_kernels.fused_linear_scaled_cross_entropy``; at ``tp = 1`` this one computes the same values.

The input checks and the call agreement live in ``_vocab_parallel_flsce_checks``, the ``torch.library``
ops and their per-chunk pieces in ``_vocab_parallel_flsce_ops``; this module wires autograd to them and
holds the public API.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lck_kernels._common import check_choice
from lck_kernels._vocab_parallel_flsce_checks import OP
from lck_kernels._vocab_parallel_flsce_ops import _vp_flsce_bwd, _vp_flsce_fwd, _vp_scale_

# A redundant alias marks the re-export: the tests import chunk_rows from this module.
from lck_kernels._vocab_parallel_flsce_ops import chunk_rows as chunk_rows
from lck_kernels._vocab_parallel_group import group_name_of

REDUCTIONS = ("none", "sum", "mean")
# Logits block per chunk: large enough that the chunk GEMMs run near cuBLAS peak (thousands of rows),
# small enough that the working set stays a fraction of a GB at V/tp = 64k.
DEFAULT_CHUNK_BYTES = 256 << 20


def _setup_context(ctx, inputs, output):
    x, weight, target, group_name, tau, ignore_index, chunk_bytes, grad_flags, reduction = inputs
    _, lse, entropy, gx_pre, gw_pre = output
    ctx.save_for_backward(x, weight, target, lse, entropy, gx_pre, gw_pre)
    ctx.options = (group_name, tau, ignore_index, chunk_bytes)
    ctx.reduction, ctx.grad_flags, ctx.ignore_index = reduction, grad_flags, ignore_index
    ctx.mark_non_differentiable(gx_pre, gw_pre)
    ctx.set_materialize_grads(False)  # an unused output (say, the entropy) costs nothing in backward


def _scaled(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``t · s`` for a gradient prepared in the forward. Eager: in place, with no pass when ``s == 1``
    (decided on the device); a second backward through the graph then fails autograd's saved-tensor
    version check instead of scaling twice. Traced (AOT autograd, torch.compile), where mutating a forward
    output inside the backward graph cannot be partitioned: out of place."""
    if type(t) is torch.Tensor and type(s) is torch.Tensor:
        _vp_scale_(t, s)
        return t
    return t * s


def _backward(ctx, grad_nll, grad_lse, grad_entropy, _gx_pre, _gw_pre):
    x, weight, target, lse, entropy, gx_pre, gw_pre = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    nones = (None,) * 7
    if not (need_x or need_w):
        return (None, None, *nones)
    gx = gw = None
    if ctx.reduction != 0 and grad_nll is not None:
        covered = (not need_x or ctx.grad_flags & 1) and (not need_w or ctx.grad_flags & 2)
        if covered:  # the forward prepared d(reduced nll)/d(x, W): scale by the upstream scalar
            gx = _scaled(gx_pre, grad_nll) if need_x else None
            gw = _scaled(gw_pre, grad_nll) if need_w else None
            grad_nll = None
        else:  # not prepared for every input that needs it: recompute, per token
            per_token = grad_nll if ctx.reduction == 1 else grad_nll / (target != ctx.ignore_index).sum()
            grad_nll = per_token.expand(target.shape)
    if grad_nll is not None or grad_lse is not None or grad_entropy is not None:
        rx, rw = _vp_flsce_bwd(
            grad_nll, grad_lse, grad_entropy, x, weight, target, lse, entropy, *ctx.options, need_x, need_w
        )
        gx = rx if gx is None else gx + rx
        gw = rw if gw is None else gw + rw
    return (gx if need_x else None), (gw if need_w else None), *nones


_vp_flsce_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    name = group_name_of(OP, group)
    check_choice(OP, "reduction", reduction, REDUCTIONS)
    for arg, value in (("x", x), ("weight_shard", weight_shard), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{OP}: {arg} must be a torch.Tensor, got {type(value).__name__}")
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
        check_choice(OP, "reduction", reduction, REDUCTIONS)
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
