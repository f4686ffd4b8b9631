"""Cross-entropy benchmark suite: lck against torch eager, torch.compile and Liger-Kernel, bf16.

Modes: ``fwd`` is the loss without a gradient (``torch.no_grad``; lck then reads the logits once), ``fwd_bwd``
the training step: the mean loss and its gradient w.r.t. the logits through ``torch.autograd.grad``
(nothing accumulates between iterations). Providers:

- ``lck``: gradient written by the forward into a new buffer; the backward is a device-side rescale.
- ``lck_in_place``: the same, writing the gradient over the logits (``in_place=True``; fwd_bwd only).
- ``torch``: ``F.cross_entropy(logits.float(), target)``, the upcast most model code does before the loss;
  ``torch_bf16``: ``F.cross_entropy`` on the bf16 logits directly; ``torch_compile``: the upcast version
  under ``torch.compile``.
- ``liger``: ``LigerCrossEntropyLoss`` (writes its gradient over its input in the forward, like
  ``lck_in_place``; from the second iteration on it runs on that gradient, which costs the same).

Shapes: Llama 3 (8192 × 128256), Qwen (8192 × 151936), Gemma (4096 × 262144) and a sweep over vocabulary
sizes at 8192 tokens; ``quick``: two small shapes. ``bytes``: the floor, logits read once (fwd) plus the
gradient written once (fwd_bwd); peak memory is measured above the inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lck_kernels.bench._harness import Case, compiled, have


def _upcast_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def _closures(loss_fn, inputs: dict[str, Any], *, with_fwd: bool = True):
    logits, target = inputs["logits"], inputs["target"]

    def fwd():
        with torch.no_grad():
            return loss_fn(logits, target)

    def fwd_bwd():
        return torch.autograd.grad(loss_fn(logits, target), logits)

    return (fwd if with_fwd else None), fwd_bwd


def _providers() -> dict[str, Any]:
    from lck_kernels.cross_entropy import cross_entropy

    providers = {
        "lck": lambda inp: _closures(cross_entropy, inp),
        "lck_in_place": lambda inp: _closures(
            lambda x, t: cross_entropy(x, t, in_place=True), inp, with_fwd=False
        ),
        "torch": lambda inp: _closures(_upcast_ce, inp),
        "torch_bf16": lambda inp: _closures(F.cross_entropy, inp),
        "torch_compile": lambda inp: _closures(compiled(_upcast_ce), inp),
    }
    if have("liger_kernel"):

        def liger(inp):
            from liger_kernel.transformers import LigerCrossEntropyLoss

            module = LigerCrossEntropyLoss()

            def loss_fn(x, t):
                out = module(x, t)
                return out.loss if hasattr(out, "loss") else out  # newer releases may return a struct

            return _closures(loss_fn, inp)

        providers["liger"] = liger
    return providers


def _case(tokens: int, vocab: int, dtype: torch.dtype = torch.bfloat16) -> Case:
    es = torch.finfo(dtype).bits // 8

    def make_inputs() -> dict[str, Any]:
        gen = torch.Generator("cuda").manual_seed(tokens * 7 + vocab)
        logits = (torch.randn(tokens, vocab, device="cuda", generator=gen) * 2).to(dtype).requires_grad_(True)
        target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        target[::97] = -100  # a few padding tokens, as in real batches
        return {"logits": logits, "target": target}

    logits_bytes = tokens * vocab * es
    return Case(
        bench="cross_entropy",
        shape=f"{tokens}x{vocab}",
        dtype=dtype,
        make_inputs=make_inputs,
        providers=_providers(),
        bytes={"fwd": logits_bytes + 8 * tokens, "fwd_bwd": 2 * logits_bytes + 8 * tokens},
        iters=30,
        warmup=5,
    )


def cases(quick: bool) -> list[Case]:
    if quick:
        return [_case(2048, 32000), _case(1024, 128256)]
    shapes = [(8192, 128256), (8192, 151936), (4096, 262144)]
    shapes += [(8192, v) for v in (32000, 50304, 100352, 201088)]
    return [_case(n, v) for n, v in shapes]
