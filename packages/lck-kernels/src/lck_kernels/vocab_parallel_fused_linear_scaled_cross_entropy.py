"""Vocabulary-parallel fused linear scaled cross entropy (FLSCE) over a tensor-parallel group.

``x [..., H]`` is replicated on every rank of ``group``; rank ``r`` of ``tp`` holds ``weight_shard
[V/tp, H]``, the rows ``[r·V/tp, (r+1)·V/tp)`` of the output projection (Megatron's
``ColumnParallelLinear`` split). With ``z = inverse_temperature · (x @ Wᵀ)`` over the whole vocabulary the op
returns, per token, ``nll = lse(z) − z[target]``, ``lse = logsumexp(z)`` and optionally the entropy
``−Σ softmax(z)·log softmax(z)`` — what RL trainers need for log-probabilities, z-losses and entropy
bonuses — without materialising more than one ``[chunk, V/tp]`` block of logits per rank.

Forward (collective over ``group``): the call-agreement all-reduce (shapes, options, targets, see
``vocab_parallel_cross_entropy.agree``), then per token chunk one cuBLAS GEMM into a reused logits buffer and
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
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lck_kernels import _vocab_parallel_kernels as K
from lck_kernels._common import (
    FLOAT_DTYPES,
    check_choice,
    check_same_device,
    check_tensor,
    dtype_name,
    rows_view,
)
from lck_kernels.vocab_parallel_cross_entropy import Field, TPGroup, agree, check_target, group_name_of

OP = "vocab_parallel_fused_linear_scaled_cross_entropy"
REDUCTIONS = ("none", "sum", "mean")
# Logits block per chunk: large enough that the chunk GEMMs run near cuBLAS peak (thousands of rows),
# small enough that the working set stays a fraction of a GB at V/tp = 64k.
DEFAULT_CHUNK_BYTES = 256 << 20


def chunk_rows(tokens: int, local_vocab: int, element_size: int, chunk_bytes: int) -> int:
    """Tokens per chunk: as many rows of ``[local_vocab]`` logits as fit ``chunk_bytes``, a multiple of 256
    when at least 256 (whole GEMM tiles), at least 1 and at most ``tokens``."""
    rows = max(1, int(chunk_bytes) // max(1, local_vocab * element_size))
    if rows >= 256:
        rows -= rows % 256
    return max(1, min(int(tokens), rows))


def _check_vp_flsce_inputs(
    x: Any, weight: Any, target: Any, inverse_temperature: float, chunk_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(OP, "x", x, dtypes=FLOAT_DTYPES)
    check_tensor(OP, "weight_shard", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if x.dim() < 1:
        raise ValueError(f"{OP}: x must be [..., hidden], got a scalar")
    if weight.dtype != x.dtype:
        raise TypeError(
            f"{OP}: weight_shard has dtype {dtype_name(weight.dtype)} but x has {dtype_name(x.dtype)}; "
            f"they must match"
        )
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{OP}: weight_shard has shape {tuple(weight.shape)} but x's last dimension is {x.shape[-1]}; "
            f"expected [local_vocab, {x.shape[-1]}]"
        )
    if weight.shape[0] < 1:
        raise ValueError(
            f"{OP}: weight_shard must hold at least one vocabulary row, got {tuple(weight.shape)}"
        )
    x2 = rows_view(OP, "x", x)
    t = check_target(OP, target, tuple(x.shape[:-1]), "x")
    check_same_device(OP, x=x, weight_shard=weight, target=target)
    tau = float(inverse_temperature)
    if not math.isfinite(tau) or tau <= 0.0:
        raise ValueError(f"{OP}: inverse_temperature must be a finite number > 0, got {inverse_temperature}")
    if int(chunk_bytes) < 1:
        raise ValueError(f"{OP}: chunk_bytes must be >= 1, got {chunk_bytes}")
    return x2, t


def _agree_and_check(tp: TPGroup, x, weight, target, tau, ignore_index, chunk_bytes, grad_flags, reduction):
    """Local validation, the collective agreement and the capacity check; returns (x2, t, local_vocab)."""
    error: BaseException | None = None
    try:
        x2, t = _check_vp_flsce_inputs(x, weight, target, tau, chunk_bytes)
        if tp.ctx is not None and x.device != tp.ctx.device:
            raise ValueError(f"{OP}: x is on {x.device} but lck_runtime.configure prepared {tp.ctx.device}")
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
    agree(
        OP,
        tp,
        fields,
        error=error,
        target=t,
        ignore_index=ignore_index,
        vocab_size=tp.size * local_vocab,
        device=tp.comm_device(x),
    )
    assert x2 is not None and t is not None
    tp.check_capacity(OP, tokens, hidden=hidden, local_vocab=local_vocab)
    return x2, t, local_vocab


def _stats(tp, logits, t, stats, local_vocab, tau, ignore_index) -> None:
    K.shard_stats(
        logits,
        t,
        stats,
        vocab_start=tp.rank * local_vocab,
        scale=tau,
        ignore_index=ignore_index,
        slot=tp.rank,
    )


def _chunk_grads(
    tp, logits, x_c, weight, t_c, lse, ent, gs, gx_out, gw, first, local_vocab, tau, ignore_index
):
    """dz of the chunk in place over its logits, then ``gx_out = dz W`` and ``gw (+)= dzᵀ x_c`` (local)."""
    K.shard_grad(
        logits,
        logits,
        t_c,
        lse,
        ent,
        g_loss=gs[0],
        g_lse=gs[1],
        g_entropy=gs[2],
        vocab_start=tp.rank * local_vocab,
        vocab_size=tp.size * local_vocab,
        scale=tau,
        ignore_index=ignore_index,
    )
    if gx_out is not None:
        torch.mm(logits, weight, out=gx_out)
    if gw is not None:
        if first:
            torch.mm(logits.t(), x_c, out=gw)
        else:
            gw.addmm_(logits.t(), x_c)


def _sum_grad_x(tp: TPGroup, grad_x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # Each rank holds the contribution of its vocabulary shard; the gradient is their sum. fp32 on the
    # wire (the context's scratch is fp32; summing bf16 partials would add a rounding step).
    partial = grad_x if grad_x.dtype == torch.float32 else grad_x.float()
    tp.all_reduce_(partial, "sum")
    return (partial if partial.dtype == like.dtype else partial.to(like.dtype)).view(like.shape)


@torch.library.custom_op("lck::vp_flsce_fwd", mutates_args=())
def _vp_flsce_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group_name: str,
    inverse_temperature: float,
    ignore_index: int,
    chunk_bytes: int,
    grad_flags: int,
    reduction: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nll, lse, entropy, grad_x_pre, grad_weight_pre). Collective over the group.

    nll, lse, entropy: float32 shaped like ``target`` (nll a scalar for ``reduction`` 1 = sum, 2 = mean).
    ``grad_flags``: bit 0 x needs a gradient, bit 1 the weight does. With a reduction and a gradient
    needed, the gradients of the reduced NLL are computed here, chunk by chunk (the statistics all-reduce
    then runs per chunk: a chunk's gradient needs its global LSE) and returned as ``*_pre`` (empty
    otherwise) for the backward to scale.
    """
    tau = inverse_temperature
    tp = TPGroup.resolve(OP, group_name)
    x2, t, local_vocab = _agree_and_check(
        tp, x, weight, target, tau, ignore_index, chunk_bytes, grad_flags, reduction
    )
    tokens, hidden = x2.shape
    vocab = tp.size * local_vocab
    precompute = reduction != 0 and grad_flags != 0
    rows = chunk_rows(tokens, local_vocab, x.element_size(), chunk_bytes)
    buf = torch.empty(rows, local_vocab, device=x.device, dtype=x.dtype) if tokens else None
    if not precompute:
        # All chunks' statistics first, then one all-reduce and one combine for the whole call.
        stats = torch.zeros(tokens, tp.size, K.STATS, device=x.device, dtype=torch.float32)
        for a in range(0, tokens, rows):
            b = min(tokens, a + rows)
            logits = torch.mm(x2[a:b], weight.t(), out=buf[: b - a])
            _stats(tp, logits, t[a:b], stats[a:b], local_vocab, tau, ignore_index)
        del buf
        tp.all_reduce_(stats.view(-1), "sum")
        nll, lse, ent = K.combine(stats, t, ignore_index=ignore_index, label_smoothing=0.0, vocab_size=vocab)
        gx = gw = None
    else:
        nll, lse, ent = (torch.empty(tokens, device=x.device, dtype=torch.float32) for _ in range(3))
        valid = (t != ignore_index).sum()
        # d(sum nll)/d nll_i = 1, d(mean nll)/d nll_i = 1/n_valid: one device scalar, broadcast by stride 0.
        unit = torch.ones(1, device=x.device, dtype=torch.float32)
        unit = (unit / valid if reduction == 2 else unit).expand(tokens)
        gx = torch.empty(tokens, hidden, device=x.device, dtype=x.dtype) if grad_flags & 1 else None
        gw = torch.empty_like(weight, memory_format=torch.contiguous_format) if grad_flags & 2 else None
        stats = torch.empty(rows, tp.size, K.STATS, device=x.device, dtype=torch.float32)
        for a in range(0, tokens, rows):
            b = min(tokens, a + rows)
            x_c, st = x2[a:b], stats[: b - a]
            logits = torch.mm(x_c, weight.t(), out=buf[: b - a])
            st.zero_()
            _stats(tp, logits, t[a:b], st, local_vocab, tau, ignore_index)
            tp.all_reduce_(st.view(-1), "sum")
            out = K.combine(st, t[a:b], ignore_index=ignore_index, label_smoothing=0.0, vocab_size=vocab)
            for full, part in zip((nll, lse, ent), out):
                full[a:b].copy_(part)
            gs = (unit[a:b], None, None)
            g_rows = gx[a:b] if gx is not None else None
            _chunk_grads(
                tp,
                logits,
                x_c,
                weight,
                t[a:b],
                lse[a:b],
                ent[a:b],
                gs,
                g_rows,
                gw,
                a == 0,
                local_vocab,
                tau,
                ignore_index,
            )
        del buf
        if gw is not None and tokens == 0:
            gw.zero_()
        if gx is not None:
            gx = _sum_grad_x(tp, gx, x)
    shape = target.shape
    if reduction == 0:
        nll_out = nll.view(shape)
    else:
        nll_out = nll.sum() if reduction == 1 else nll.sum() / (t != ignore_index).sum()
    return (
        nll_out,
        lse.view(shape),
        ent.view(shape),
        (gx if gx is not None else x.new_empty(0)),  # distinct empties: outputs may not alias
        (gw if gw is not None else x.new_empty(0)),
    )


@_vp_flsce_fwd.register_fake
def _(x, weight, target, group_name, inverse_temperature, ignore_index, chunk_bytes, grad_flags, reduction):
    _check_vp_flsce_inputs(x, weight, target, inverse_temperature, chunk_bytes)
    lse = x.new_empty(target.shape, dtype=torch.float32)
    nll = torch.empty_like(lse) if reduction == 0 else x.new_empty((), dtype=torch.float32)
    precompute = reduction != 0 and grad_flags != 0
    gx = (
        torch.empty_like(x, memory_format=torch.contiguous_format)
        if precompute and grad_flags & 1
        else x.new_empty(0)
    )
    gw = (
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if precompute and grad_flags & 2
        else x.new_empty(0)
    )
    return nll, lse, torch.empty_like(lse), gx, gw


@torch.library.custom_op("lck::vp_flsce_bwd", mutates_args=())
def _vp_flsce_bwd(
    grad_nll: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    group_name: str,
    inverse_temperature: float,
    ignore_index: int,
    chunk_bytes: int,
    need_grad_x: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight_shard) for per-token upstream gradients, recomputing each chunk's logits from
    the saved global LSE/entropy; an empty tensor for one not needed. Collective iff ``need_grad_x``."""
    tp = TPGroup.resolve(OP, group_name)
    x2 = rows_view(OP, "x", x)
    t = target.reshape(-1)
    tokens, hidden = x2.shape
    local_vocab = weight.shape[0]
    flat = [None if g is None else g.reshape(-1).float() for g in (grad_nll, grad_lse, grad_entropy)]
    lse1, ent1 = lse.reshape(-1).contiguous(), entropy.reshape(-1).contiguous()
    gx = torch.empty(tokens, hidden, device=x.device, dtype=x.dtype) if need_grad_x else None
    gw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_grad_weight else None
    rows = chunk_rows(tokens, local_vocab, x.element_size(), chunk_bytes)
    buf = torch.empty(rows, local_vocab, device=x.device, dtype=x.dtype) if tokens else None
    for a in range(0, tokens, rows):
        b = min(tokens, a + rows)
        x_c = x2[a:b]
        logits = torch.mm(x_c, weight.t(), out=buf[: b - a])
        gs = tuple(None if g is None else g[a:b] for g in flat)
        g_rows = gx[a:b] if gx is not None else None
        _chunk_grads(
            tp,
            logits,
            x_c,
            weight,
            t[a:b],
            lse1[a:b],
            ent1[a:b],
            gs,
            g_rows,
            gw,
            a == 0,
            local_vocab,
            inverse_temperature,
            ignore_index,
        )
    del buf
    if gw is not None and tokens == 0:
        gw.zero_()
    if gx is not None:
        gx = _sum_grad_x(tp, gx, x)
    return (gx if gx is not None else x.new_empty(0)), (gw if gw is not None else x.new_empty(0))


@_vp_flsce_bwd.register_fake
def _(
    grad_nll,
    grad_lse,
    grad_entropy,
    x,
    weight,
    target,
    lse,
    entropy,
    group_name,
    inverse_temperature,
    ignore_index,
    chunk_bytes,
    need_grad_x,
    need_grad_weight,
):
    gx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_grad_x else x.new_empty(0)
    gw = (
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if need_grad_weight
        else x.new_empty(0)
    )
    return gx, gw


@torch.library.custom_op("lck::vp_scale_", mutates_args=("t",))
def _vp_scale_(t: torch.Tensor, s: torch.Tensor) -> None:
    """``t *= s`` (``s`` a one-element tensor) in place; no pass over ``t`` when ``s == 1``."""
    K.scale_(t, s.reshape(1).float())


@_vp_scale_.register_fake
def _(t, s):
    return None


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
    configured capacities, before any kernel runs.
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
