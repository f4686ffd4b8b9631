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
temperature. Because those upstream gradients are known only in the backward, this op always takes the
recompute schedule of ``lck_kernels._linear_cross_entropy`` (forward: one GEMM per token and the row
statistics; backward: the logits again, then the two gradient GEMMs), with the same chunk budget.
"""

from __future__ import annotations

import math

import torch

from lck_kernels._cross_entropy_checks import (
    check_chunking,
    check_flag,
    check_linear_inputs,
    check_loss_options,
    flatten_tokens,
)
from lck_kernels._linear_cross_entropy import (
    LinearCrossEntropyRecomputeFunction,
    lce_stats,
    needs_grads,
    plan_chunk_tokens,
)

Tensor = torch.Tensor
OP = "fused_linear_scaled_cross_entropy"


def _check_inverse_temperature(op: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{op}: inverse_temperature must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{op}: inverse_temperature must be finite and > 0, got {value}")


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
    args = (x2, weight, t1, bias, None, ignore_index, 0.0, 0.0, 0.0, float(inverse_temperature), reduction)
    nx, nw, nb = needs_grads(x, weight, bias)
    if nx or nw or nb:
        nll, _, lse, entropy = LinearCrossEntropyRecomputeFunction.apply(
            *args, return_entropy, nx, nw, nb, chunk
        )
    else:
        nll, _, lse, entropy = lce_stats(*args, return_entropy, chunk)
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


__all__ = ["LckFusedLinearScaledCrossEntropy", "fused_linear_scaled_cross_entropy"]
