"""Fused linear cross entropy: ``cross_entropy(x @ weight.T + bias, target)`` without ``[tokens, vocab]`` logits,
and its scaled variant (FLSCE): per-token NLL, log-sum-exp and entropy of tempered logits.

``fused_linear_cross_entropy``: the loss options and their semantics are those of
:func:`lck_kernels.cross_entropy` (``class_weight`` is its ``weight``); the chunked schedules, the chunk
budget and the precision choices are described in ``launch.py`` (the chunked engine). In short: for
``reduction="sum"``/``"mean"`` every gradient is finished in the forward (three GEMMs per token) and the
backward is a device-side rescale that costs one launch when the incoming gradient is 1; for
``reduction="none"`` the forward keeps each token's log-sum-exp and the backward recomputes the logits (four
GEMMs per token). Inputs that do not require grad skip their GEMMs; without any grad the forward is one GEMM
per token. Extra memory is the logits chunk (``chunk_bytes``, default 512 MiB) plus ``[tokens]`` float32
rows, at any token count. The loss is float32 (``loss_dtype=x.dtype`` rounds it to the input's precision).

``fused_linear_scaled_cross_entropy``: with ``z = inverse_temperature · (x @ weight.T (+ bias))`` over the
vocabulary, per token::

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
temperature. The same two schedules, with the same chunk budget:

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

Plain eager calls on CUDA tensors that take the fused schedule (sum/mean with an input needing a gradient) run C++
autograd Functions (``csrc/host.h``, built by ``lck_kernels._host``): the same GEMMs in the same order, the same
row kernels at the same plans and the same loss arithmetic, so the same bits, with neither the chunk loop nor
the backward running Python per call (a gradient reaching the scaled op's lse or entropy still runs the
recompute backward in Python). The recompute schedule, ``torch.compile``, fake tensors, modes, tuning overrides
and anything else the C++ entries do not take keep the Python Functions (``ops.py``).

The family's files: no Triton kernels of its own (the row kernels are those of ``lck_kernels.cross_entropy``);
``launch.py`` (the chunked engine), ``checks.py``, ``ops.py`` (``torch.library`` ops and autograd); this module
holds the functional API and the modules.
"""

from __future__ import annotations

import torch

from lck_kernels import _host
from lck_kernels.cross_entropy.checks import check_loss_dtype, check_loss_options
from lck_kernels.linear_cross_entropy.checks import (
    check_chunking,
    check_flag,
    check_inverse_temperature,
    check_linear_inputs,
    flatten_tokens,
)
from lck_kernels.linear_cross_entropy.launch import (
    CHUNK_ALIGN,
    DEFAULT_CHUNK_BYTES,
    needs_grads,
    plan_chunk_tokens,
)
from lck_kernels.linear_cross_entropy.ops import (
    FusedLinearCrossEntropyFunction,
    FusedLinearScaledCrossEntropyFunction,
    LinearCrossEntropyRecomputeFunction,
    flce_apply,
    flsce_apply,
    lce_recompute_apply,
    lce_stats,
)

Tensor = torch.Tensor
OP = "fused_linear_scaled_cross_entropy"

__all__ = [
    "CHUNK_ALIGN",
    "DEFAULT_CHUNK_BYTES",
    "FusedLinearCrossEntropyFunction",
    "FusedLinearScaledCrossEntropyFunction",
    "LckFusedLinearCrossEntropyLoss",
    "LckFusedLinearScaledCrossEntropy",
    "LinearCrossEntropyRecomputeFunction",
    "fused_linear_cross_entropy",
    "fused_linear_scaled_cross_entropy",
    "plan_chunk_tokens",
]

# ---------------------------------------------------------------------------------------------------------
# Functional API and module
# ---------------------------------------------------------------------------------------------------------


def fused_linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    class_weight: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_z_loss: bool = False,
    chunk_bytes: int | None = None,
    max_chunk_tokens: int | None = None,
    loss_dtype: torch.dtype = torch.float32,
) -> Tensor | tuple[Tensor, Tensor]:
    """``cross_entropy(x @ weight.T + bias, target, ...)`` computed chunk by chunk.

    Args:
        x: ``[..., hidden]`` float32/float16/bfloat16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``) whose
            leading dimensions collapse into rows without a copy.
        weight: ``[vocab, hidden]`` of ``x``'s dtype and device (any strides).
        target: int64/int32 class indices of shape ``x.shape[:-1]``.
        bias: optional ``[vocab]`` of ``x``'s dtype.
        class_weight: optional ``[vocab]`` float class weights (``weight`` of ``F.cross_entropy``).
        ignore_index, label_smoothing, lse_square_scale, softcap, reduction, return_z_loss: as in
            :func:`lck_kernels.cross_entropy.cross_entropy`.
        chunk_bytes: budget of the logits chunk buffer in bytes (default 512 MiB; smaller
            budgets cost time, see ``launch.DEFAULT_CHUNK_BYTES``).
        max_chunk_tokens: an upper bound on tokens per chunk (e.g. for tests or tuning).
        loss_dtype: ``torch.float32`` (default; the loss is computed in float32) or ``x.dtype`` to have it
            rounded to the input's precision.

    Returns the loss in ``loss_dtype`` (0-D, or ``target``'s shape for ``"none"``), or ``(loss, z_loss)``.
    Differentiable w.r.t. ``x``, ``weight`` and ``bias``. Raises ``TypeError``/``ValueError`` naming the
    argument for a wrong dtype, device, shape, stride or option.
    """
    if (
        getattr(x, "is_cuda", False)
        and (host := _host.ready(x, weight, target, bias, class_weight)) is not None
    ):
        # The C++ autograd Function of the fused schedule: it checks every argument itself and answers None
        # for anything else, which then gets the checks (and their errors) and the Python path below.
        out = host.fused_linear_cross_entropy(
            x, weight, target, bias, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap,
            reduction, return_z_loss, chunk_bytes, max_chunk_tokens, loss_dtype,
        )  # fmt: skip
        if out is not None:
            return out
    op = "fused_linear_cross_entropy"
    x2, t1 = flatten_tokens(op, x, target)
    check_linear_inputs(op, x2, weight, t1, bias, class_weight)
    check_loss_options(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    check_chunking(op, chunk_bytes, max_chunk_tokens)
    check_flag(op, "return_z_loss", return_z_loss)
    loss_dtype = check_loss_dtype(op, loss_dtype, x.dtype)
    chunk = plan_chunk_tokens(
        x2.shape[0],
        weight.shape[0],
        x.element_size(),
        chunk_bytes=chunk_bytes,
        max_chunk_tokens=max_chunk_tokens,
    )
    options = (ignore_index, float(label_smoothing), float(lse_square_scale), float(softcap or 0.0))
    nx, nw, nb = needs_grads(x, weight, bias)
    if not (nx or nw or nb):
        loss, z, _, _ = lce_stats(x2, weight, t1, bias, class_weight, *options, 1.0, reduction, False, chunk)
    elif reduction == "none":
        loss, z, _, _ = lce_recompute_apply(
            x2, weight, t1, bias, class_weight, *options, 1.0, reduction, False, nx, nw, nb, chunk
        )
    else:
        loss, z = flce_apply(x2, weight, t1, bias, class_weight, *options, reduction, nx, nw, nb, chunk)
    if reduction == "none":
        loss, z = loss.view(target.shape), z.view(target.shape)
    loss = loss.to(loss_dtype)
    return (loss, z.to(loss_dtype)) if return_z_loss else loss


class LckFusedLinearCrossEntropyLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`fused_linear_cross_entropy`: ``forward(x, weight, target, bias=None)``.

    ``class_weight`` is registered as a buffer.
    """

    def __init__(
        self,
        class_weight: Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        reduction: str = "mean",
        return_z_loss: bool = False,
        chunk_bytes: int | None = None,
        max_chunk_tokens: int | None = None,
        loss_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        op = "LckFusedLinearCrossEntropyLoss"
        check_loss_options(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
        check_chunking(op, chunk_bytes, max_chunk_tokens)
        if class_weight is not None and not isinstance(class_weight, torch.Tensor):
            raise TypeError(f"{op}: class_weight must be None or a tensor, got {type(class_weight).__name__}")
        self.register_buffer("class_weight", class_weight)
        self.options = {
            "ignore_index": ignore_index,
            "label_smoothing": label_smoothing,
            "lse_square_scale": lse_square_scale,
            "softcap": softcap,
            "reduction": reduction,
            "return_z_loss": return_z_loss,
            "chunk_bytes": chunk_bytes,
            "max_chunk_tokens": max_chunk_tokens,
            "loss_dtype": loss_dtype,
        }

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None):
        return fused_linear_cross_entropy(
            x, weight, target, bias, class_weight=self.class_weight, **self.options
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


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
    if getattr(x, "is_cuda", False) and (host := _host.ready(x, weight, target, bias)) is not None:
        out = host.fused_linear_scaled_cross_entropy(
            x, weight, target, bias, inverse_temperature, return_entropy, ignore_index, reduction, chunk_bytes,
            max_chunk_tokens,
        )  # fmt: skip
        if out is not None:  # the fused schedule in C++, as in fused_linear_cross_entropy
            return out
    x2, t1 = flatten_tokens(OP, x, target)
    check_linear_inputs(OP, x2, weight, t1, bias, None)
    check_loss_options(OP, ignore_index, 0.0, 0.0, None, reduction)
    check_inverse_temperature(OP, inverse_temperature)
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
        nll, _, lse, entropy = lce_recompute_apply(*args, return_entropy, nx, nw, nb, chunk)
    else:
        nll, lse, entropy = flsce_apply(
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
        check_inverse_temperature(op, inverse_temperature)
        check_loss_options(op, ignore_index, 0.0, 0.0, None, reduction)
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
