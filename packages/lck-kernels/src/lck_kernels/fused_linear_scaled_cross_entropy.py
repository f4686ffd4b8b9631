"""Fused linear *scaled* cross entropy (FLSCE): per-token NLL, log-sum-exp and entropy of tempered logits.

With ``z = inverse_temperature · (x @ weight.T (+ bias))`` over the vocabulary, per token::

    nll = lse(z) − z[target]        lse = log Σ exp(z)        entropy = −Σ softmax(z)·log softmax(z)
                                                                     = lse − Σ softmax(z)·z

which is what RL trainers consume: ``−nll`` is the token log-probability of a sampled action (policy
ratios, KL terms), ``entropy`` feeds an entropy bonus, ``lse`` a z-loss. The result is ``(nll, lse)`` or
``(nll, lse, entropy)`` (the layout of verl's fused linear-entropy kernel and of lck's vocabulary-parallel
op, which computes the same values at one rank), float32, shaped like ``target``; ``reduction`` applies to
``nll`` only (``"none"`` by default; ``"mean"`` divides by the non-ignored tokens). Tokens whose target is
``ignore_index`` give ``nll = lse = entropy = 0`` and no gradient.

Every output is differentiable w.r.t. ``x``, ``weight`` (and ``bias``) with arbitrary per-token upstream
gradients (advantages, masks, entropy coefficients): the backward computes, per token,
``∂/∂z = g_nll·(p − onehot) + g_lse·p + g_entropy·p·(E_p[z] − z)`` and multiplies by the inverse
temperature. Two schedules of ``lck_kernels._linear_cross_entropy_chunks``, with the same chunk budget:

- ``reduction="none"``, or no input needing a gradient: the per-token upstream gradients are known only in
  the backward, so the forward is one GEMM per token and the row statistics, and the backward recomputes
  the logits and runs the two gradient GEMMs (four GEMMs in all).
- ``reduction="sum"``/``"mean"`` with an input needing a gradient: the gradient of the reduced NLL is
  finished in the forward, chunk by chunk (three GEMMs in all, as ``fused_linear_cross_entropy``), kept
  until the backward and scaled there by the upstream scalar (on the device; no pass when it is 1). A
  gradient that also reaches ``lse`` or ``entropy`` (a z-loss, an entropy bonus) is computed by the
  recompute backward and added: three more GEMMs, so an objective that differentiates those outputs as
  well is cheaper with ``reduction="none"`` and the reduction done by the caller. The vocabulary-parallel
  op makes the same choice.
"""

from __future__ import annotations

import math

import torch

from lck_kernels._cross_entropy_checks import (
    check_chunking,
    check_flag,
    check_linear_inputs,
    check_loss_options,
    check_op_scalars,
    flatten_tokens,
    unpack_saved_gradient,
)
from lck_kernels._cross_entropy_launch import CEOptions
from lck_kernels._linear_cross_entropy import (
    LinearCrossEntropyRecomputeFunction,
    empty_grads,
    forward_with_grads,
    lce_bwd,
    lce_stats,
    needs_grads,
    plan_chunk_tokens,
)
from lck_kernels.fused_linear_cross_entropy import _flce_rescale_

Tensor = torch.Tensor
OP = "fused_linear_scaled_cross_entropy"


def _check_inverse_temperature(op: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{op}: inverse_temperature must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{op}: inverse_temperature must be finite and > 0, got {value}")


# ---------------------------------------------------------------------------------------------------------
# Op and autograd: the reduced NLL's gradient finished in the forward
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("lck::fused_linear_scaled_cross_entropy_fwd", mutates_args=())
def _flsce_fwd(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    inverse_temperature: float,
    reduction: str,
    return_entropy: bool,
    need_x: bool,
    need_w: bool,
    need_b: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(nll, lse, entropy, grad_x, grad_w, grad_b, applied) for reduction sum/mean: the reduced NLL and
    the gradients of it; ``entropy`` is empty unless ``return_entropy``, unneeded gradients are empty."""
    op = "lck::fused_linear_scaled_cross_entropy_fwd"
    check_linear_inputs(op, x, weight, target, bias, None)
    check_op_scalars(op, ignore_index, 0.0, 0.0, 0.0, reduction, chunk_tokens)
    _check_inverse_temperature(op, inverse_temperature)
    if reduction == "none":
        raise ValueError(f"{op}: reduction='none' takes the recompute schedule (lck::linear_cross_entropy_*)")
    opts = CEOptions(ignore_index, 0.0, 0.0, 0.0, inverse_temperature)
    nll, _, lse, entropy, gx, gw, gb = forward_with_grads(
        x, weight, target, bias, None, opts, reduction, need_x, need_w, need_b, chunk_tokens, return_entropy
    )
    return nll, lse, entropy, gx, gw, gb, torch.ones(1, dtype=torch.float32, device=x.device)


@_flsce_fwd.register_fake
def _(x, weight, target, bias, ignore_index, inv_t, reduction, return_entropy, need_x, need_w, need_b, chunk):
    check_linear_inputs("lck::fused_linear_scaled_cross_entropy_fwd", x, weight, target, bias, None)
    n = x.shape[0]
    rows = x.new_empty((n,), dtype=torch.float32)
    entropy = x.new_empty((n if return_entropy else 0,), dtype=torch.float32)
    grads = empty_grads(x, weight, bias, need_x, need_w, need_b)
    return x.new_empty((), dtype=torch.float32), rows, entropy, *grads, x.new_empty((1,), dtype=torch.float32)


class FusedLinearScaledCrossEntropyFunction(torch.autograd.Function):
    """Reduced NLL with its gradient finished in the forward; the backward scales it in place, and
    recomputes the logits only for gradients that reach lse or entropy."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, ii, inv_t, reduction, ent, nx, nw, nb, chunk):
        nll, lse, entropy, gx, gw, gb, applied = _flsce_fwd(
            x, weight, target, bias, ii, inv_t, reduction, ent, nx, nw, nb, chunk
        )
        ctx.save_for_backward(x, weight, target, bias, lse, entropy, gx, gw, gb, applied)
        ctx.options = (ii, inv_t, reduction)
        ctx.needs = (nx, nw, nb, chunk, ent)
        ctx.set_materialize_grads(False)  # an output nobody differentiates costs nothing in the backward
        return nll, lse, entropy

    @staticmethod
    def backward(ctx, g_nll, g_lse, g_entropy):
        x, weight, target, bias, lse, entropy, gx, gw, gb, applied = unpack_saved_gradient(ctx, OP)
        nx, nw, nb, chunk, ent = ctx.needs
        ii, inv_t, reduction = ctx.options
        grads = [None, None, None]
        if g_nll is not None:
            _flce_rescale_(gx, gw, gb, applied, g_nll)
            grads = [gx, gw, gb]
        g_entropy = g_entropy if ent else None
        if g_lse is not None or g_entropy is not None:
            extra = lce_bwd(
                x, weight, target, bias, None, lse, entropy if ent else None, None, g_lse, g_entropy,
                ii, 0.0, 0.0, 0.0, inv_t, reduction, nx, nw, nb, chunk,
            )  # fmt: skip
            grads = [e if g is None else g + e for g, e in zip(grads, extra)]
        gx, gw, gb = grads
        return (gx if nx else None, gw if nw else None, None, gb if nb else None) + (None,) * 8


# ---------------------------------------------------------------------------------------------------------
# Functional API and module
# ---------------------------------------------------------------------------------------------------------


def fused_linear_scaled_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Tensor | None = None,
    inverse_temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    reduction: str = "none",
    chunk_bytes: int | None = None,
    max_chunk_tokens: int | None = None,
) -> tuple[Tensor, ...]:
    """Per-token NLL, lse (and entropy) of ``inverse_temperature · (x @ weight.T + bias)``, chunk by chunk.

    Args:
        x: ``[..., hidden]`` float32/float16/bfloat16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``) whose
            leading dimensions collapse into rows without a copy.
        weight: ``[vocab, hidden]`` of ``x``'s dtype and device.
        target: int64/int32 class indices of shape ``x.shape[:-1]``.
        bias: optional ``[vocab]`` of ``x``'s dtype (added before the temperature).
        inverse_temperature: finite and > 0.
        return_entropy: also return the per-token entropy (one more running sum in the forward).
        ignore_index: tokens with this target give zeros and no gradient.
        reduction: for ``nll`` only: ``"none"`` (per token), ``"sum"`` or ``"mean"`` (over non-ignored
            tokens; NaN when all are ignored, as in torch).
        chunk_bytes, max_chunk_tokens: the logits chunk budget, as in ``fused_linear_cross_entropy``.

    Returns ``(nll, lse)`` or ``(nll, lse, entropy)``, float32, ``lse``/``entropy`` shaped like ``target``.
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong dtype, device, shape or option.
    """
    x2, t1 = flatten_tokens(OP, x, target)
    check_linear_inputs(OP, x2, weight, t1, bias, None)
    check_loss_options(
        OP,
        ignore_index=ignore_index,
        label_smoothing=0.0,
        lse_square_scale=0.0,
        softcap=None,
        reduction=reduction,
    )
    _check_inverse_temperature(OP, inverse_temperature)
    check_flag(OP, "return_entropy", return_entropy)
    check_chunking(OP, chunk_bytes, max_chunk_tokens)
    chunk = plan_chunk_tokens(
        x2.shape[0],
        weight.shape[0],
        x.element_size(),
        chunk_bytes=chunk_bytes,
        max_chunk_tokens=max_chunk_tokens,
    )
    tau = float(inverse_temperature)
    args = (x2, weight, t1, bias, None, ignore_index, 0.0, 0.0, 0.0, tau, reduction)
    nx, nw, nb = needs_grads(x, weight, bias)
    if not (nx or nw or nb):
        nll, _, lse, entropy = lce_stats(*args, return_entropy, chunk)
    elif reduction == "none":
        nll, _, lse, entropy = LinearCrossEntropyRecomputeFunction.apply(
            *args, return_entropy, nx, nw, nb, chunk
        )
    else:
        nll, lse, entropy = FusedLinearScaledCrossEntropyFunction.apply(
            x2, weight, t1, bias, ignore_index, tau, reduction, return_entropy, nx, nw, nb, chunk
        )
    # lse and entropy do not depend on the target; zeroing ignored tokens (and so their gradients) keeps
    # padding out of z-losses and entropy bonuses, and matches the vocabulary-parallel op.
    valid = t1 != ignore_index
    lse = torch.where(valid, lse, 0.0).view(target.shape)
    if reduction == "none":
        nll = nll.view(target.shape)
    if not return_entropy:
        return nll, lse
    return nll, lse, torch.where(valid, entropy, 0.0).view(target.shape)


class LckFusedLinearScaledCrossEntropy(torch.nn.Module):
    """``nn.Module`` form of :func:`fused_linear_scaled_cross_entropy`: ``forward(x, weight, target, bias=None)``."""

    def __init__(
        self,
        *,
        inverse_temperature: float = 1.0,
        return_entropy: bool = False,
        ignore_index: int = -100,
        reduction: str = "none",
        chunk_bytes: int | None = None,
        max_chunk_tokens: int | None = None,
    ):
        super().__init__()
        op = "LckFusedLinearScaledCrossEntropy"
        _check_inverse_temperature(op, inverse_temperature)
        check_loss_options(
            op,
            ignore_index=ignore_index,
            label_smoothing=0.0,
            lse_square_scale=0.0,
            softcap=None,
            reduction=reduction,
        )
        check_flag(op, "return_entropy", return_entropy)
        check_chunking(op, chunk_bytes, max_chunk_tokens)
        self.options = {
            "inverse_temperature": inverse_temperature,
            "return_entropy": return_entropy,
            "ignore_index": ignore_index,
            "reduction": reduction,
            "chunk_bytes": chunk_bytes,
            "max_chunk_tokens": max_chunk_tokens,
        }

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None):
        return fused_linear_scaled_cross_entropy(x, weight, target, bias=bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


__all__ = [
    "FusedLinearScaledCrossEntropyFunction",
    "LckFusedLinearScaledCrossEntropy",
    "fused_linear_scaled_cross_entropy",
]
