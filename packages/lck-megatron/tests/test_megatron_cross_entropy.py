"""Megatron's vocab-parallel cross entropy (plain and fused) routed to lck, at TP=1 in this process.

References: a float64 loss with Megatron's label-smoothing definition, and Megatron's own functions on
the same inputs. TP=2 runs in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _helpers import assert_close, build_gpt, kernel_device, transformer_config

from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron
from lck_megatron.cross_entropy import LckVocabParallelCrossEntropy

pytestmark = pytest.mark.megatron


def megatron_ce_reference(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Per-token loss in float64, Megatron's definition: smoothing mass alpha/(K-1) on each wrong class."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if smoothing == 0.0:
        return nll
    k = logits.shape[-1]
    s = smoothing * k / (k - 1)
    return (1.0 - s) * nll - s * logp.mean(-1)


def _original(name: str):
    mod, attr = {
        "plain": ("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy"),
        "fused": ("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy"),
    }[name]
    return getattr(importlib.import_module(mod), attr)


def _call(fn, kind: str, logits, target, smoothing: float):
    if kind == "plain":
        return fn(logits, target, smoothing) if smoothing else fn(logits, target)
    from megatron.core import parallel_state

    return fn(logits, target, parallel_state.get_tensor_model_parallel_group())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("kind", "smoothing"),
    [("plain", 0.0), ("plain", 0.1), ("fused", 0.0)],
    ids=["plain", "smoothed", "fused"],
)
def test_route_matches_megatron_and_float64(megatron_tp1: None, kind: str, smoothing: float, dtype) -> None:
    _check_route(kind, smoothing, dtype, kernel_device(), (6, 3, 80))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_route_matches_megatron_and_float64_cuda(megatron_tp1: None, dtype) -> None:
    for kind, smoothing in (("plain", 0.0), ("plain", 0.1), ("fused", 0.0)):
        _check_route(kind, smoothing, dtype, torch.device("cuda"), (512, 4, 32000))


def _check_route(
    kind: str, smoothing: float, dtype, device: torch.device, shape: tuple[int, int, int]
) -> None:
    s, b, v = shape
    torch.manual_seed(7)
    logits = (torch.randn(s, b, v, device=device) * 3).to(dtype)
    target = torch.randint(0, v, (s, b), device=device)
    dloss = torch.rand(s, b, device=device)
    original = _original(kind)
    route = LckVocabParallelCrossEntropy(original)

    results = {}
    for name, fn in (("megatron", original), ("lck", route)):
        x = logits.detach().clone().requires_grad_(True)
        loss = _call(fn, kind, x, target, smoothing)
        assert loss.shape == (s, b) and loss.dtype == torch.float32, (name, loss.shape, loss.dtype)
        loss.backward(dloss)
        results[name] = (loss.detach(), x.grad)
    assert route.calls == {"lck": 1, "fallback": 0}, route.calls

    x64 = logits.detach().double().requires_grad_(True)
    ref = megatron_ce_reference(x64, target, smoothing)
    ref.backward(dloss.double())
    for name, (loss, grad) in results.items():
        # Both compute the loss in float32 from the (rounded) logits and return it in float32. Megatron's
        # fused variant always returns a bfloat16 gradient.
        loss_dtype = torch.float32
        grad_dtype = torch.bfloat16 if (name == "megatron" and kind == "fused") else dtype
        assert_close(loss, ref, loss_dtype, name=f"{name} {kind} loss")
        assert_close(grad, x64.grad, grad_dtype, name=f"{name} {kind} logits gradient")


@pytest.mark.parametrize("fusion", [False, True], ids=["plain", "fused"])
def test_language_model_loss_goes_through_lck(megatron_tp1: None, fusion: bool) -> None:
    """The real consumer: GPTModel.compute_language_model_loss with the patch applied before the build."""
    device = kernel_device()
    torch.manual_seed(3)
    cfg = dict(cross_entropy_loss_fusion=fusion)
    if fusion:
        cfg["cross_entropy_fusion_impl"] = "native"
    stock_model = build_gpt(transformer_config(**cfg), vocab_size=64)
    apply_lck_to_megatron(rms_norm=False, cross_entropy=True)
    model = build_gpt(transformer_config(**cfg), vocab_size=64)
    labels = torch.randint(0, 64, (2, 5), device=device)  # [b, s]
    logits = torch.randn(5, 2, 64, device=device, requires_grad=True)  # [s, b, V]
    loss = model.compute_language_model_loss(labels, logits)
    assert loss.shape == (2, 5)
    name = "fused_vocab_parallel_cross_entropy" if fusion else "vocab_parallel_cross_entropy"
    mod = "megatron.core.fusions.fused_cross_entropy" if fusion else "megatron.core.tensor_parallel"
    route = getattr(importlib.import_module(mod), name)
    assert isinstance(route, LckVocabParallelCrossEntropy) and route.calls["lck"] >= 1
    revert_lck_from_megatron()
    ref = stock_model.compute_language_model_loss(labels, logits.detach())
    assert_close(loss, ref, torch.float32, name="patched vs stock language-model loss")


def test_cpu_without_interpreter_falls_back(megatron_tp1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    original = _original("plain")
    route = LckVocabParallelCrossEntropy(original)
    logits, target = torch.randn(4, 2, 16), torch.randint(0, 16, (4, 2))
    # Megatron's function shifts fp32 logits in place: give each call its own copy.
    torch.testing.assert_close(route(logits.clone(), target), original(logits.clone(), target))
    assert route.calls == {"lck": 0, "fallback": 1}
    assert any("TRITON_INTERPRET" in r for r in route.fallback_reasons)


def test_validation_names_the_argument(megatron_tp1: None) -> None:
    route = LckVocabParallelCrossEntropy(_original("plain"))
    logits = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="target has shape"):
        route(logits, torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="target must hold integer"):
        route(logits, torch.zeros(4, 2))
    with pytest.raises(TypeError, match=r"vocab_parallel_logits must be a torch\.Tensor"):
        route([1.0], torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        route(logits, torch.zeros(4, 2, dtype=torch.long), 1.5)
    with pytest.raises(TypeError, match="routed by lck"):
        route(logits)  # missing target: the original signature decides
