"""Megatron's output layer and loss as lck's fused linear cross entropy, against Megatron's own path.

On the CPU the part of ``GPTModel`` that this feature replaces (``_postprocess``: output layer + loss) runs
for real on hidden states, stock and patched, on the same weights; TP=2 runs in ``test_tensor_parallel.py``.
The whole model (its attention needs CUDA) is compared on the GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _helpers import assert_close, build_gpt, kernel_device, run_postprocess, transformer_config

from lck_megatron import apply_lck_to_megatron
from lck_megatron.patch import linear_cross_entropy_route

pytestmark = pytest.mark.megatron

S, B, VOCAB = 8, 2, 96


def build_model(tied: bool, dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides):
    model = build_gpt(transformer_config(dtype, **overrides), vocab_size=VOCAB, seq=S, tied=tied)
    return model.to(device=device, dtype=dtype)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_postprocess_matches_megatron(megatron_tp1: None, tied: bool) -> None:
    device = kernel_device()
    torch.manual_seed(11)
    model = build_model(tied, device=device.type)
    hidden = torch.randn(S, B, model.config.hidden_size, device=device)
    labels = torch.randint(0, VOCAB, (B, S), device=device)
    uniform = torch.full((B, S), 1.0 / (B * S), device=device)  # loss.mean()
    masked = (torch.rand(B, S, device=device) > 0.3).float()  # a loss mask with zeros
    stock = {
        name: run_postprocess(model, hidden, labels, g) for name, g in (("mean", uniform), ("mask", masked))
    }

    apply_lck_to_megatron(rms_norm=False, linear_cross_entropy=True)
    route = linear_cross_entropy_route()
    # mean: gradients prepared in the forward; mask: grad_W recomputed, and the layer switches schedule;
    # mean again: the recompute schedule from the start.
    for step, (name, g) in enumerate((("mean", uniform), ("mask", masked), ("mean", uniform))):
        out = run_postprocess(model, hidden, labels, g, positional=step != 1)
        assert out["loss"].shape == (B, S) and out["loss"].dtype == torch.float32
        for key, ref in stock[name].items():
            assert_close(out[key], ref, torch.float32, name=f"step {step} ({name}) {key}")
        assert route.choice.recompute(model.output_layer) == (step > 0)
    assert route.calls == {"lck": 3, "megatron": 0}, route.calls


def test_fallbacks_keep_megatron_and_log_once(
    megatron_tp1: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(5)
    model = build_model(tied=False)
    hidden = torch.randn(S, B, model.config.hidden_size)
    labels = torch.randint(0, VOCAB, (B, S))
    stock_logits = model._postprocess(hidden, labels, labels, None, None, None, None)
    stock_loss = model._postprocess(hidden, labels, labels, labels, None, None, None)
    caplog.set_level(logging.INFO, logger="lck_megatron")
    apply_lck_to_megatron(rms_norm=False, linear_cross_entropy=True)
    route = linear_cross_entropy_route()

    class OwnLoss(GPTModel):
        def compute_language_model_loss(self, labels, logits):
            return super().compute_language_model_loss(labels, logits)

    own = build_model(tied=False)
    own.__class__ = OwnLoss
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors then have no kernel to run on
    for _ in range(2):
        torch.testing.assert_close(
            model._postprocess(hidden, labels, labels, None, None, None, None), stock_logits
        )
        assert own._postprocess(hidden, labels, labels, labels, None, None, None).shape == (B, S)
        torch.testing.assert_close(
            model._postprocess(hidden, labels, labels, labels, None, None, None), stock_loss
        )
    assert route.calls == {"lck": 0, "megatron": 6}, route.calls
    reasons = [r.getMessage() for r in caplog.records if "handled by Megatron" in r.getMessage()]
    assert len(reasons) == 3, reasons  # one line per reason, not per call
    for needle in ("without labels", "overrides compute_language_model_loss", "TRITON_INTERPRET"):
        assert sum(needle in r for r in reasons) == 1, (needle, reasons)


def test_labels_shape_is_checked(megatron_tp1: None) -> None:
    device = kernel_device()
    model = build_model(tied=False, device=device.type)
    apply_lck_to_megatron(rms_norm=False, linear_cross_entropy=True)
    hidden = torch.randn(S, B, model.config.hidden_size, device=device)
    wrong = torch.zeros(S, B, dtype=torch.long, device=device)  # [s, b] instead of [b, s]
    with pytest.raises(ValueError, match="labels have shape"):
        model._postprocess(hidden, wrong, wrong, wrong, None, None, None)
    # The failed call left no instance override behind.
    assert "forward" not in vars(model.output_layer)
    assert "compute_language_model_loss" not in vars(model)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_whole_gpt_model_matches_megatron_cuda(megatron_tp1: None, dtype: torch.dtype, tied: bool) -> None:
    """A tiny GPTModel on CUDA: loss and every parameter's gradient, stock vs patched on the same weights,
    for a mean (gradients prepared in the forward) and then a masked loss (grad_W recomputed)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    model = build_model(tied, dtype, "cuda")
    tokens = torch.randint(0, VOCAB, (B, S + 1), device="cuda")
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(S, device="cuda").expand(B, S)
    mask = (torch.rand(B, S, device="cuda") > 0.2).float()
    objectives = {"mean": lambda loss: loss.mean(), "mask": lambda loss: (loss * mask).sum() / mask.sum()}

    def step(objective: str) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=labels)
        assert loss.shape == (B, S) and loss.dtype == torch.float32
        objectives[objective](loss).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return {"loss": loss.detach(), **grads}

    stock = {name: step(name) for name in objectives}
    apply_lck_to_megatron(rms_norm=False, linear_cross_entropy=True)
    route = linear_cross_entropy_route()
    for name in objectives:
        out = step(name)
        assert set(out) == set(stock[name])
        for key, ref in stock[name].items():
            assert_close(out[key], ref, dtype, name=f"{name}: {key} ({dtype})", scale=2.0)
    assert route.calls == {"lck": 2, "megatron": 0}, route.calls
    assert route.choice.recompute(model.output_layer)
