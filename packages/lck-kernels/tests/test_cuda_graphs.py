"""Every single-GPU op captured into a CUDA graph, forward and backward, then replayed on fresh inputs.

Megatron captures transformer layers (its RMSNorm and SwiGLU slots, which lck patches) and users capture
whole steps, so an op that syncs with the host, allocates outside the graph's pool or keeps host-side
state between calls would break or silently reuse stale values there. Each case warms the op up on a side
stream, captures ``outputs = op(inputs)`` and ``grads = autograd.grad(outputs, inputs, cotangent)`` in
one graph, then for two fresh random inputs: copies them into the captured tensors, fills the captured
outputs and gradients with NaN, replays, and compares with an eager call on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _graphs import capture
from _tolerances import assert_close

from lck_kernels import (
    cross_entropy,
    fused_linear_cross_entropy,
    fused_linear_scaled_cross_entropy,
    rms_norm,
    swiglu,
    swiglu_packed,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
]

Inputs = Callable[[torch.Generator], list[torch.Tensor]]


def _graph_matches_eager(op: Callable[..., torch.Tensor], make: Inputs, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    static = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in make(gen)]
    wrt = [t for t in static if t.requires_grad]
    out_shape = op(*static).shape
    cot = torch.rand(out_shape, device="cuda", generator=gen, dtype=torch.float32) + 0.5  # not 1: rescales

    def step() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out = op(*static)
        return out, torch.autograd.grad(out, wrt, cot.to(out.dtype))

    graph, (out, grads) = capture(step, warmups=3)

    for seed in (1, 2):
        fresh = make(torch.Generator(device="cuda").manual_seed(seed))
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
            for t in (out, *grads):
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_in = [f.detach().clone().requires_grad_(f.is_floating_point()) for f in fresh]
        ref = op(*eager_in)
        ref_grads = torch.autograd.grad(ref, [t for t in eager_in if t.requires_grad], cot.to(ref.dtype))
        assert_close(out, ref, dtype, name=f"replay {seed}: output")
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            assert_close(g, r, dtype, name=f"replay {seed}: gradient {i}", scale=4.0)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def _targets(gen: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    t = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    t[torch.rand(n, device="cuda", generator=gen) < 0.1] = -100  # some ignored, different every draw
    return t


def _linear_inputs(tokens: int, bias: bool = False) -> Inputs:
    """A fused linear CE problem: x (tokens x 1024), a 32000 x 1024 weight (and a bias), some ignored targets."""

    def make(gen: torch.Generator) -> list[torch.Tensor]:
        x = _randn(gen, tokens, 1024, dtype=torch.bfloat16)
        w = _randn(gen, 32000, 1024, dtype=torch.bfloat16) * 0.05
        b = [_randn(gen, 32000, dtype=torch.bfloat16) * 0.1] if bias else []
        return [x, w, *b, _targets(gen, tokens, 32000)]

    return make


def test_rms_norm_in_a_cuda_graph() -> None:
    def make(gen):
        return [
            _randn(gen, 4096, 4096, dtype=torch.bfloat16),
            1.0 + 0.1 * _randn(gen, 4096, dtype=torch.bfloat16),
        ]

    _graph_matches_eager(lambda x, w: rms_norm(x, w, eps=1e-6), make, torch.bfloat16)


def test_swiglu_in_a_cuda_graph() -> None:
    def make(gen):
        return [_randn(gen, 2048, 5120, dtype=torch.bfloat16), _randn(gen, 2048, 5120, dtype=torch.bfloat16)]

    _graph_matches_eager(swiglu, make, torch.bfloat16)


def test_swiglu_packed_in_a_cuda_graph() -> None:
    def make(gen):
        return [_randn(gen, 1024, 2, 2 * 4096, dtype=torch.bfloat16)]

    _graph_matches_eager(swiglu_packed, make, torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_in_a_cuda_graph(reduction: str) -> None:
    def make(gen):
        return [_randn(gen, 4096, 32000, dtype=torch.bfloat16) * 3, _targets(gen, 4096, 32000)]

    def op(logits, target):
        return cross_entropy(logits, target, reduction=reduction, label_smoothing=0.05, lse_square_scale=1e-4)

    _graph_matches_eager(op, make, torch.bfloat16)


def test_fused_linear_cross_entropy_in_a_cuda_graph() -> None:
    # a 64 MiB budget: 1024-token chunks, so the graph holds several chunks and a partial one
    def op(x, w, target):
        return fused_linear_cross_entropy(x, w, target, reduction="mean", chunk_bytes=64 << 20)

    _graph_matches_eager(op, _linear_inputs(3000), torch.bfloat16)


def test_fused_linear_scaled_cross_entropy_in_a_cuda_graph() -> None:
    def op(x, w, target):
        nll, lse = fused_linear_scaled_cross_entropy(x, w, target, inverse_temperature=0.8)
        return nll + 0.1 * lse

    _graph_matches_eager(op, _linear_inputs(2048), torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_fused_linear_scaled_cross_entropy_in_a_cuda_graph(reduction: str) -> None:
    # The reduced path finishes the NLL's gradient inside the forward (divided by a device-side count of
    # valid tokens for "mean"); the lse term adds a recomputed gradient in the backward. Both must stay on
    # the device: a host read of the count would fail the capture.
    def op(x, w, b, target):
        nll, lse = fused_linear_scaled_cross_entropy(
            x, w, target, bias=b, inverse_temperature=1.25, reduction=reduction, chunk_bytes=64 << 20
        )
        return nll + 1e-3 * lse.sum()

    _graph_matches_eager(op, _linear_inputs(2500, bias=True), torch.bfloat16)
