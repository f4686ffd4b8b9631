"""Per-token cross entropy of ``x @ Wᵀ`` without ``[tokens, vocab]`` logits, as Megatron's loss needs it.

Megatron's language models return the per-token loss and let the caller weight it (a loss mask, a division
by the token count), so the upstream gradient reaches the loss one value per token. lck's fused linear
cross entropy has two schedules (``lck_kernels.fused_linear_scaled_cross_entropy`` and its vocab-parallel
form): with ``reduction="none"`` the backward recomputes the logits (four GEMMs per token); with a reduced
loss every gradient is finished in the forward (three GEMMs). :class:`PreparedLinearCrossEntropy` takes the
three-GEMM schedule for a per-token loss:

- forward: the reduced op gives the gradients of ``Σ_t loss_t`` and each token's log-sum-exp; the loss is
  ``lse_t − z_t`` with ``z_t = x_t · W[target_t]`` computed as one dot per token (rounded to ``x``'s dtype,
  as the fused op rounds its logits), summed over the tensor-parallel group where the vocabulary is split;
- backward with per-token gradients ``g``: ``grad_x`` row ``t`` is ``g_t`` times the prepared row (exact for
  any ``g``); ``grad_W = Σ_t g_t ∂loss_t/∂W`` equals ``g·`` the prepared ``grad_W`` only when ``g`` is the
  same for every token, which is what a mean, a sum or an all-ones loss mask give. Whether it is costs one
  host read of one flag (agreed over the group). When it is not (a loss mask with zeros), ``grad_W`` is
  recomputed for that call and later calls through the same output layer take the recompute schedule
  from the start; the switch is logged once.

Under CUDA-graph capture (no host read possible) and for ``torch.compile`` the recompute schedule runs.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from lck_megatron._support import LogOnce

IGNORE_INDEX = -100  # lck's default; Megatron's labels are vocabulary ids, never negative


class ScheduleChoice:
    """Which schedule an output layer's calls take: output layers that saw a per-token gradient differ
    between tokens switch to the recompute schedule for good (held weakly, by module)."""

    def __init__(self) -> None:
        self._recompute: weakref.WeakSet[Any] = weakref.WeakSet()
        self.log = LogOnce()

    def recompute(self, key: Any) -> bool:
        return key in self._recompute

    def switch_to_recompute(self, key: Any) -> None:
        self._recompute.add(key)
        self.log(
            "lck: linear cross entropy: the loss gradient differs between tokens (a loss mask?); this output "
            "layer now recomputes its logits in the backward (four GEMMs per token instead of three)"
        )


def _tp(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _op(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: Any, reduction: str) -> Any:
    import lck_kernels

    if _tp(group) == 1:
        return lck_kernels.fused_linear_scaled_cross_entropy(x, weight, target, reduction=reduction)
    return lck_kernels.vocab_parallel_fused_linear_scaled_cross_entropy(
        x, weight, target, group, reduction=reduction
    )


def target_logits(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
    """``x_t · W[target_t]`` per token, float32 holding a value rounded to ``x.dtype`` (the fused op's
    logits are); over a tensor-parallel group each rank adds the targets its vocabulary shard holds."""
    local = weight.shape[0]
    start = 0 if group is None else dist.get_rank(group) * local
    rel = target - start
    mine = (rel >= 0) & (rel < local)
    rows = weight.index_select(0, rel.clamp(0, local - 1))
    z = torch.bmm(x.unsqueeze(1), rows.unsqueeze(2)).view(-1).float()  # fp32 accumulation, one rounding
    z = torch.where(mine, z, 0.0)
    if _tp(group) > 1:
        dist.all_reduce(z, group=group)
    return z


class PreparedLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[N]`` (float32) of ``x [N, H] @ weight [V(/tp), H]ᵀ`` against ``target [N]``, with the
    gradients prepared in the forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, target, group, choice, key):  # type: ignore[override]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad():
            xd = x.detach().requires_grad_(need_x)
            wd = weight.detach().requires_grad_(need_w)
            nll_sum, lse = _op(xd, wd, target, group, "sum")
            wanted = [t for t, need in ((xd, need_x), (wd, need_w)) if need]
            grads = list(torch.autograd.grad(nll_sum, wanted)) if wanted else []
        gx = grads.pop(0) if need_x else None
        gw = grads.pop(0) if need_w else None
        z = target_logits(x, weight, target, group)
        loss = torch.where(target != IGNORE_INDEX, lse.detach() - z, 0.0)
        ctx.save_for_backward(x, weight, target)
        ctx.prepared = (gx, gw)
        ctx.group, ctx.choice, ctx.key = group, choice, key
        return loss

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight, target = ctx.saved_tensors
        gx, gw = ctx.prepared
        ctx.prepared = None  # a second backward finds nothing to scale: autograd raises first (freed graph)
        g = g.float()
        # One host read: is g the same for every token (then its value), agreed over the group.
        first = g[:1]
        uneven = (g != first).any().float().view(1)
        if _tp(ctx.group) > 1:
            dist.all_reduce(uneven, op=dist.ReduceOp.MAX, group=ctx.group)
        flag, value = torch.cat([uneven, first]).tolist() if g.numel() else (0.0, 1.0)
        if gx is not None:
            if flag:
                gx.mul_(g.unsqueeze(1))  # row t scaled by g_t: exact for any g
            elif value != 1.0:
                gx.mul_(value)
        if gw is not None:
            if not flag:
                if value != 1.0:
                    gw.mul_(value)
            else:
                ctx.choice.switch_to_recompute(ctx.key)
                with torch.enable_grad():
                    wd = weight.detach().requires_grad_(True)
                    nll = _op(x.detach(), wd, target, ctx.group, "none")[0]
                    (gw,) = torch.autograd.grad(nll, wd, g)
        return gx, gw, None, None, None, None


class GatherSequence(torch.autograd.Function):
    """Sequence-parallel hidden states ``[s/tp, ...]`` → ``[s, ...]`` on every rank of ``group``; the backward
    keeps this rank's chunk of the incoming gradient, which the fused loss has already summed over the group
    (so Megatron's gather, whose backward reduce-scatters, would count it ``tp`` times)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        tp = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
        if x.is_cuda:
            dist.all_gather_into_tensor(out, x, group=group)
        else:  # gloo: the list form
            dist.all_gather(list(out.chunk(tp)), x, group=group)
        ctx.group, ctx.rows = group, x.shape[0]
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        start = dist.get_rank(ctx.group) * ctx.rows
        return g[start : start + ctx.rows], None


def per_token_loss(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: Any, choice: ScheduleChoice, key: Any
) -> torch.Tensor:
    """The per-token loss ``[N]`` float32 of ``x [N, H]`` through ``weight`` against ``target [N]``; collective
    over ``group`` (``None``: one rank) when it has more than one rank."""
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not grads:
        with torch.no_grad():
            return _op(x, weight, target, group, "none")[0]
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or choice.recompute(key) or torch.compiler.is_compiling():
        return _op(x, weight, target, group, "none")[0]
    return PreparedLinearCrossEntropy.apply(x, weight, target, group, choice, key)
