"""Fused linear cross-entropy benchmark suite: lck against torch eager, torch.compile and Liger-Kernel, bf16.

``loss = cross_entropy(x @ W.T, target)`` with ``x [tokens, hidden]`` and ``W [vocab, hidden]``. Modes:
``fwd`` is the loss without gradients (``torch.no_grad``: one GEMM per token), ``fwd_bwd`` the training step:
the mean loss and its gradients w.r.t. ``x`` and ``W`` through ``torch.autograd.grad`` (three GEMMs per
token at best). ``flops`` counts those GEMMs (2·N·H·V each), so ``tflop_per_s`` reads as GEMM efficiency.

Providers: ``lck`` (default 512 MiB chunk budget), ``torch`` (``F.cross_entropy((x @ W.T).float(), t)``,
the usual eager code), ``torch_compile`` (the same under ``torch.compile``), ``liger``
(``LigerFusedLinearCrossEntropyLoss``).

Memory: ``peak_mib`` is everything allocated during the call above the inputs, *including the returned
gradients* (``W``: V·H·2 bytes, 1002 MiB at 128256 × 4096; ``x``: N·H·2 bytes). The working memory a
provider adds on top of its gradients is ``peak_mib`` minus those (lck's target: ≤ 0.6 GB at any token
count, which the 4096- and 16384-token cases show).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lck_kernels.bench._harness import Case, compiled, have


def _eager(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((x @ w.T).float(), t)


def _closures(loss_fn, inputs: dict[str, Any]):
    x, w, t = inputs["x"], inputs["w"], inputs["target"]

    def fwd():
        with torch.no_grad():
            return loss_fn(x, w, t)

    def fwd_bwd():
        return torch.autograd.grad(loss_fn(x, w, t), (x, w))

    return fwd, fwd_bwd


def _providers() -> dict[str, Any]:
    from lck_kernels.linear_cross_entropy import fused_linear_cross_entropy

    providers = {
        "lck": lambda inp: _closures(fused_linear_cross_entropy, inp),
        "torch": lambda inp: _closures(_eager, inp),
        "torch_compile": lambda inp: _closures(compiled(_eager), inp),
    }
    if have("liger_kernel"):

        def liger(inp):
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            module = LigerFusedLinearCrossEntropyLoss()

            def loss_fn(x, w, t):
                out = module(w, x, t)  # Liger's order: (lin_weight, input, target)
                return out.loss if hasattr(out, "loss") else out

            return _closures(loss_fn, inp)

        providers["liger"] = liger
    return providers


def _case(tokens: int, hidden: int, vocab: int, dtype: torch.dtype = torch.bfloat16) -> Case:
    def make_inputs() -> dict[str, Any]:
        gen = torch.Generator("cuda").manual_seed(tokens + hidden + vocab)
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype).requires_grad_(True)
        w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * (2.0 / hidden**0.5)).to(dtype)
        target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        target[::97] = -100
        return {"x": x, "w": w.requires_grad_(True), "target": target}

    gemm = 2.0 * tokens * hidden * vocab
    return Case(
        bench="fused_linear_cross_entropy",
        shape=f"{tokens}x{hidden}x{vocab}",
        dtype=dtype,
        make_inputs=make_inputs,
        providers=_providers(),
        flops={"fwd": gemm, "fwd_bwd": 3 * gemm},
        iters=10,
        warmup=3,
    )


def cases(quick: bool) -> list[Case]:
    if quick:
        return [_case(2048, 1024, 32000), _case(1024, 4096, 128256)]
    shapes = [(8192, 4096, 128256), (4096, 4096, 128256), (16384, 4096, 128256), (8192, 5120, 151936)]
    return [_case(*s) for s in shapes]
