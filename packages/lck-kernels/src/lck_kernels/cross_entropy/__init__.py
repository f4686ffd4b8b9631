"""Cross entropy over ``[tokens, vocab]`` logits, with the gradient computed in the forward where that pays.

``cross_entropy(logits, target, ...)`` matches ``torch.nn.functional.cross_entropy`` on 2-D logits for
``weight``, ``ignore_index``, ``label_smoothing`` and ``reduction``, and adds a z-loss and a soft cap:

- soft cap: ``z = softcap · tanh(logits / softcap)`` is applied first; everything below uses ``z``.
- per non-ignored row ``i`` with target ``t`` (``w`` the class weights, 1 without them, ``W = Σ_c w_c``,
  ``ε`` the label smoothing, ``V`` the vocabulary)::

      ce_i = (1 − ε)·w_t·(lse_i − z_t) + (ε/V)·(W·lse_i − Σ_c w_c·z_c)       (torch's formula)
      zl_i = lse_square_scale · lse_i²

  Ignored rows contribute 0 (and get a zero gradient). Class weights scale the target term by ``w_t`` and
  the smoothing term class by class, exactly as torch combines them; the z-loss is not weighted.
- ``reduction="mean"`` divides ``Σ ce`` by ``Σ w_t`` over non-ignored rows (the number of them without
  weights), as torch does, and ``Σ zl`` by the number of non-ignored rows (the per-token mean z-loss, as in
  Liger-Kernel). Every target ignored gives NaN, like torch; ``"sum"`` sums; ``"none"`` returns
  ``ce_i + zl_i`` per row.
- A target outside ``[0, V)`` that is not ``ignore_index`` makes its row's loss and gradient NaN (checking
  it on the host would cost a device sync per call).

How it is fast. For ``reduction="sum"``/``"mean"`` (a scalar incoming gradient), when ``logits`` requires
grad, one kernel reads each row twice (the second read meant to hit L2) and writes both the loss and
``∂loss/∂logits`` (already normalised for ``mean``) into a new buffer, or into ``logits`` itself with
``in_place=True``. The backward then only multiplies by the incoming gradient, on the device and in place:
each gradient row remembers the factor applied so far, so the usual ``grad_output == 1`` exits at once (one
launch instead of a pass over the gigabytes of logits). For ``reduction="none"`` the incoming gradient has
one value per row (masks, per-token weights), so computing the gradient in the forward would not save the
backward's pass: the forward reads the logits once and keeps each row's lse, and the backward reads them
again and writes the gradient (into ``logits`` with ``in_place=True``). Without grad the forward reads the
logits once. No fp32 copy of the logits is ever made (256k vocabularies are tiled), no host sync happens,
and all row offsets are 64-bit.

Plain eager calls on CUDA tensors run C++ autograd Functions (``csrc/host.h``, built by ``lck_kernels._host``)
that launch the same kernels with the same plans and finish the loss with the same ATen ops, so neither the
forward nor the backward runs Python per call; ``torch.compile``, fake tensors, modes, tuning overrides and
anything the C++ entry does not take keep the Python Functions (``ops.py``), with the same results.

``in_place=True`` overwrites ``logits`` with the gradient (in the forward for sum/mean, in the backward for
none): use it only when nothing else reads ``logits`` afterwards (autograd raises if an op saved them for its
backward, because the ops bump their version counter). It saves a ``[tokens, vocab]`` buffer in eager
mode; under ``torch.compile`` it stays correct, but functionalisation may copy the buffer, so the saving is
not guaranteed there. A second backward over a retained graph raises where a saved buffer is updated in
place (sum/mean, or ``in_place=True``).

The family's files: ``kernels.py``, ``rows.py`` and ``split.py`` (Triton), ``cuda.py`` (the opt-in CUDA
cluster kernel), ``launch.py`` (launch configuration and launchers), ``checks.py``, ``ops.py`` (the
``torch.library`` ops ``lck::cross_entropy_*`` and the autograd wiring); this module holds ``cross_entropy``
and ``LckCrossEntropyLoss``.
"""

from __future__ import annotations

import torch

from lck_kernels import _host
from lck_kernels.cross_entropy.checks import check_cross_entropy_inputs, check_loss_dtype, check_loss_options
from lck_kernels.cross_entropy.ops import (
    CrossEntropyFunction,
    CrossEntropyRowsFunction,
    cross_entropy_apply,
    cross_entropy_fwd,
    cross_entropy_rows_apply,
)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_z_loss: bool = False,
    in_place: bool = False,
    loss_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy of ``logits`` against class indices ``target`` (semantics in the module docstring).

    Args:
        logits: ``[tokens, vocab]`` float32/float16/bfloat16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``)
            with unit stride along the vocabulary (any row stride).
        target: ``[tokens]`` int64 or int32, contiguous, on the same device.
        weight: optional ``[vocab]`` contiguous float class weights (not differentiated, as in torch).
        ignore_index: rows whose target equals it add nothing and get a zero gradient.
        label_smoothing: ε in ``[0, 1]``.
        lse_square_scale: z-loss coefficient (≥ 0); 0 disables it.
        softcap: ``None`` or the cap ``c > 0`` of ``c·tanh(logits/c)``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        return_z_loss: also return the z-loss term alone (reduced the same way; not differentiable, for
            logging; it is already included in the loss).
        in_place: write the gradient into ``logits`` (see the module docstring).
        loss_dtype: ``torch.float32`` (default; the loss is computed in float32, as torch computes it from
            upcast logits) or ``logits.dtype`` to have it rounded to the logits' precision.

    Returns the loss in ``loss_dtype`` (0-D, or ``[tokens]`` for ``"none"``), or ``(loss, z_loss)``.
    Differentiable w.r.t. ``logits``. Raises ``TypeError``/``ValueError`` naming the argument for a wrong
    dtype, device, shape, stride or option.
    """
    if getattr(logits, "is_cuda", False) and (host := _host.ready(logits, target, weight)) is not None:
        # The C++ autograd Functions: they check every argument themselves and answer None for anything
        # they do not take, which then gets the checks (and their errors) and the Python path below.
        out = host.cross_entropy(
            logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
            return_z_loss, in_place, loss_dtype,
        )  # fmt: skip
        if out is not None:
            return out
    op = "cross_entropy"
    check_cross_entropy_inputs(op, logits, target, weight)
    check_loss_options(op, ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    for name, flag in (("return_z_loss", return_z_loss), ("in_place", in_place)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {type(flag).__name__}")
    loss_dtype = check_loss_dtype(op, loss_dtype, logits.dtype)
    args = (logits, target, weight, ignore_index, float(label_smoothing), float(lse_square_scale))
    args += (float(softcap) if softcap is not None else 0.0, reduction)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        loss, z, _, _, _ = cross_entropy_fwd(*args, False)
    elif reduction == "none":
        loss, z = cross_entropy_rows_apply(*args[:-1], in_place)
    else:
        loss, z = cross_entropy_apply(*args, in_place)
    loss = loss.to(loss_dtype)
    return (loss, z.to(loss_dtype)) if return_z_loss else loss


class LckCrossEntropyLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`cross_entropy`: ``forward(logits, target)``; options as keywords.

    ``weight`` (class weights) is registered as a buffer, so it follows ``.to(device)``.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        reduction: str = "mean",
        return_z_loss: bool = False,
        in_place: bool = False,
        loss_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        check_loss_options(
            "LckCrossEntropyLoss", ignore_index, label_smoothing, lse_square_scale, softcap, reduction
        )
        if weight is not None and not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"LckCrossEntropyLoss: weight must be None or a tensor, got {type(weight).__name__}"
            )
        self.register_buffer("weight", weight)
        self.ignore_index, self.label_smoothing, self.lse_square_scale = (
            ignore_index,
            label_smoothing,
            lse_square_scale,
        )
        self.softcap, self.reduction, self.return_z_loss, self.in_place = (
            softcap,
            reduction,
            return_z_loss,
            in_place,
        )
        self.loss_dtype = loss_dtype

    def forward(self, logits: torch.Tensor, target: torch.Tensor):
        return cross_entropy(
            logits,
            target,
            weight=self.weight,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale,
            softcap=self.softcap,
            reduction=self.reduction,
            return_z_loss=self.return_z_loss,
            in_place=self.in_place,
            loss_dtype=self.loss_dtype,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
            f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, reduction={self.reduction!r}"
        )


__all__ = ["CrossEntropyFunction", "CrossEntropyRowsFunction", "LckCrossEntropyLoss", "cross_entropy"]
