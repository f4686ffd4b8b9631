"""LckDotProductAttention against Megatron's DotProductAttention, and the ``attention`` patch."""

from __future__ import annotations

import importlib
import logging
import math
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from _helpers import assert_close, build_gpt, transformer_config

from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron
from lck_megatron._support import LogOnce

pytestmark = pytest.mark.megatron

SQ, B, HN = 12, 2, 8


class _CpuBuffer:
    def get_tensor(
        self, shape: Any, dtype: torch.dtype, name: str, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


class _NoForkTracker:
    def fork(self, *args: Any, **kwargs: Any) -> Any:
        return nullcontext()


@pytest.fixture
def on_cpu(megatron_tp1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's attention on the CPU: its scores buffer, default masks and dropout RNG tracker allocate on
    CUDA, so the test points them at the CPU (Megatron's math is unchanged); a fresh log-once record."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions import fused_softmax

    import lck_megatron.attention as attention

    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: _CpuBuffer())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: _NoForkTracker())
    monkeypatch.setattr(
        fused_softmax, "get_default_causal_mask", lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    )

    def window_mask(sq: int, sk: int, window: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, sk, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=sk - sq - window[0]), diagonal=sk - sq + window[1])

    monkeypatch.setattr(fused_softmax, "get_sliding_window_causal_mask", window_mask)
    monkeypatch.setattr(attention, "_log", LogOnce())


def _stock_class() -> type:
    from lck_megatron._bindings import original

    return original("megatron.core.transformer.dot_product_attention", "DotProductAttention")


def _pair(config: Any, mask: str, layer_number: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """Megatron's DotProductAttention and LckDotProductAttention built alike (as Megatron's ``Attention``
    builds them, softmax_scale from the config), in training mode."""
    from megatron.core.transformer.enums import AttnMaskType

    from lck_megatron.attention import LckDotProductAttention

    mask_type = getattr(AttnMaskType, mask)
    kwargs.setdefault("softmax_scale", config.softmax_scale)
    stock = _stock_class()(config, layer_number, mask_type, "self", **kwargs)
    lck = LckDotProductAttention(config, layer_number, mask_type, "self", **kwargs)
    lck.load_state_dict(stock.state_dict())
    return stock, lck


def _qkv(
    sq: int, sk: int, heads: int, groups: int, dtype=torch.float32, device="cpu", hn: int = HN
) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(sq * 131 + sk * 7 + heads + groups)
    shapes = [(sq, B, heads, hn), (sk, B, groups, hn), (sk, B, groups, hn)]
    return [torch.randn(s, generator=g, device=device, dtype=dtype) for s in shapes]


def _run(module: Any, qkv: list[torch.Tensor], dout: torch.Tensor, *args: Any, **kwargs: Any) -> dict:
    leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    out = module(*leaves, *args, **kwargs)
    out.backward(dout)
    return {"output": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}


def _reference(qkv: list[torch.Tensor], dout: torch.Tensor, scale: float, causal: bool) -> dict:
    """Attention in float64 from plain torch: softmax(q kᵀ · scale, causal) v, heads grouped like Megatron."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in qkv)
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (
        t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))
    )
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ vh).permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)
    out.backward(dout.double())
    return {"output": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _compare(got: dict, want: dict, dtype: torch.dtype, what: str, scale: float = 1.0) -> None:
    for name in want:
        assert_close(got[name], want[name], dtype, name=f"{what} {name}", scale=scale)


@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize(
    "mask,sk,layer_number,cfg",
    [
        ("causal", SQ, 1, {}),
        ("no_mask", SQ, 1, {}),
        ("no_mask", 20, 1, {}),  # cross-attention lengths
        ("causal", SQ, 3, {"apply_query_key_layer_scaling": True}),
        ("causal", SQ, 2, {"softmax_scale": 0.3}),
        ("causal", SQ, 3, {"softmax_scale": 0.3, "apply_query_key_layer_scaling": True}),
    ],
    ids=["causal", "no_mask", "no_mask-sk20", "qk_layer_scaling", "softmax_scale", "both_scalings"],
)
def test_matches_megatron_and_float64(on_cpu: None, mask, sk, layer_number, cfg, groups) -> None:
    config = transformer_config(num_query_groups=groups, kv_channels=HN, **cfg)
    stock, lck = _pair(config, mask, layer_number)
    qkv = _qkv(SQ, sk, config.num_attention_heads, groups)
    dout = torch.randn(SQ, B, config.num_attention_heads * HN)
    got, want = _run(lck, qkv, dout, None), _run(stock, qkv, dout, None)
    assert lck.calls == {"lck": 1, "megatron": 0}, (lck.calls, lck.fallback_reasons)
    assert got["output"].is_contiguous() and got["output"].dtype == torch.float32
    scale = cfg.get("softmax_scale") or 1 / math.sqrt(HN)
    assert lck.net_softmax_scale() == pytest.approx(scale)
    _compare(got, want, torch.float32, "lck vs megatron")
    _compare(got, _reference(qkv, dout, scale, mask == "causal"), torch.float32, "lck vs float64")


def test_single_query_decodes_without_a_mask(on_cpu: None) -> None:
    """Megatron's causal softmax leaves sq == 1 (a KV-cache step) unmasked over every key."""
    stock, lck = _pair(transformer_config(), "causal")
    qkv = _qkv(1, 9, 4, 4)
    dout = torch.randn(1, B, 4 * HN)
    _compare(_run(lck, qkv, dout, None), _run(stock, qkv, dout, None), torch.float32, "sq=1")
    assert lck.calls == {"lck": 1, "megatron": 0}


def test_dropout_in_training_only(on_cpu: None) -> None:
    stock, lck = _pair(transformer_config(attention_dropout=0.5), "causal")
    qkv = _qkv(SQ, SQ, 4, 4)
    lck.eval()
    stock.eval()
    torch.testing.assert_close(lck(*qkv, None), stock(*qkv, None), rtol=1e-5, atol=1e-5)
    lck.train()
    torch.manual_seed(0)
    dropped = lck(*qkv, None)
    assert torch.isfinite(dropped).all()
    assert not torch.allclose(dropped, stock.eval()(*qkv, None)), "training mode must drop probabilities"
    assert lck.calls == {"lck": 2, "megatron": 0}


def _padding_mask() -> torch.Tensor:
    mask = torch.zeros(B, 1, SQ, SQ, dtype=torch.bool)
    mask[1, :, :, SQ - 3 :] = True  # the second sequence's last three keys are padding
    return mask


def _causal_mask() -> torch.Tensor:
    return torch.ones(SQ, SQ, dtype=torch.bool).triu(1).view(1, 1, SQ, SQ)


@pytest.mark.parametrize(
    "mask_type,mask",
    [("padding", _padding_mask()), ("causal", _causal_mask()), ("causal", _causal_mask() | _padding_mask())],
    ids=["padding", "causal-type-with-causal-mask", "causal-and-padding"],
)
def test_explicit_boolean_masks_match_megatron(on_cpu: None, mask_type: str, mask: torch.Tensor) -> None:
    """Megatron-LM's data loader hands every layer a boolean mask (True = masked); Megatron's unfused softmax
    applies it instead of the mask type, and so does lck (as SDPA's additive mask, built once per mask)."""
    from lck_megatron import attention

    stock, lck = _pair(transformer_config(), mask_type)
    qkv = _qkv(SQ, SQ, 4, 4)
    dout = torch.randn(SQ, B, 4 * HN)
    want = _run(stock, qkv, dout, mask)
    got = _run(lck, qkv, dout, mask)
    _compare(got, want, torch.float32, "lck vs megatron")
    assert lck.calls == {"lck": 1, "megatron": 0}
    cached = attention.additive_mask(mask, torch.float32)
    assert cached is attention.additive_mask(mask, torch.float32), "one additive mask per mask tensor"
    assert torch.equal(cached, torch.zeros(mask.shape).masked_fill(mask, -10000.0))
    del mask, cached
    assert attention._additive[0] is not None  # the parametrize list still holds the mask object


@pytest.mark.parametrize(
    "mask,cfg,args,reason",
    [
        ("causal", {}, (_causal_mask().view(SQ, SQ),), "attention_mask is not a boolean"),
        ("causal", {"window_size": (4, 0)}, (None,), "sliding-window"),
        ("causal", {"softmax_type": "off-by-one"}, (None,), "softmax_type"),
    ],
    ids=["2-d-mask", "sliding-window", "off-by-one"],
)
def test_what_lck_does_not_take_runs_megatron(
    on_cpu: None, monkeypatch: pytest.MonkeyPatch, caplog, mask, cfg, args, reason
) -> None:
    caplog.set_level(logging.INFO, logger="lck_megatron")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where off-by-one keeps its offsets
    stock, lck = _pair(transformer_config(**cfg), mask)
    qkv = _qkv(SQ, SQ, 4, 4)
    dout = torch.randn(SQ, B, 4 * HN)
    want = _run(stock, qkv, dout, *args)
    for _ in range(2):  # Megatron's own forward on the same inputs: the same numbers, exactly
        got = _run(lck, qkv, dout, *args)
        assert all(torch.equal(got[n], want[n]) for n in want), reason
    assert lck.calls == {"lck": 0, "megatron": 2}
    logged = [r.getMessage() for r in caplog.records if "LckDotProductAttention" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0], logged
    assert any(reason in r for r in lck.fallback_reasons)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"packed_seq_params": object()}, AssertionError),
        ({"attention_bias": torch.zeros(1)}, AssertionError),
        ({"newer_option": 1}, TypeError),
    ],
    ids=["packed_seq_params", "attention_bias", "unknown-keyword"],
)
def test_unsupported_arguments_get_megatrons_answer(on_cpu: None, caplog, kwargs, error) -> None:
    """Megatron's DotProductAttention rejects these itself; lck hands them over and logs why, once."""
    caplog.set_level(logging.INFO, logger="lck_megatron")
    stock, lck = _pair(transformer_config(), "causal")
    qkv = _qkv(SQ, SQ, 4, 4)
    for module in (stock, lck, lck):
        with pytest.raises(error):
            module(*qkv, None, **kwargs)
    assert lck.calls == {"lck": 0, "megatron": 2}
    name = next(iter(kwargs))
    assert len([r for r in caplog.records if name in r.getMessage()]) == 1


ATTENTION_SITES = {
    "megatron.core.transformer.dot_product_attention": "DotProductAttention",
    "megatron.core.models.backends": "DotProductAttention",
    "megatron.core.models.bert.bert_model": "MCoreDotProductAttention",
    "megatron.core.models.bert.bert_layer_specs": "DotProductAttention",
    "megatron.core.models.T5.t5_spec": "DotProductAttention",
    "megatron.core.models.vision.vit_layer_specs": "DotProductAttention",
    "megatron.core.models.multimodal.llava_spec": "DotProductAttention",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs": "DotProductAttention",
    "megatron.core.post_training.modelopt.gpt.model_specs": "DotProductAttention",
}


def test_patch_reaches_every_local_spec_and_reverts() -> None:
    from lck_megatron.attention import LckDotProductAttention

    stock = _stock_class()
    sites = apply_lck_to_megatron(rms_norm=False, attention=True)["attention"]
    for module, attr in ATTENTION_SITES.items():
        assert getattr(importlib.import_module(module), attr) is LckDotProductAttention, module
        assert f"{module}.{attr}" in sites
    from megatron.core.models.backends import LocalSpecProvider

    assert LocalSpecProvider().core_attention() is LckDotProductAttention
    assert issubclass(LckDotProductAttention, stock)
    restored = revert_lck_from_megatron()
    assert sorted(set(restored)) == sorted(set(sites))
    for module, attr in ATTENTION_SITES.items():
        assert getattr(importlib.import_module(module), attr) is stock, module
    assert LocalSpecProvider().core_attention() is stock


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_gpt_model_with_patched_attention_matches_stock(on_cpu: None, groups: int) -> None:
    from lck_megatron.attention import LckDotProductAttention

    config = transformer_config(num_query_groups=groups)
    torch.manual_seed(0)
    stock = build_gpt(config)
    apply_lck_to_megatron(rms_norm=False, attention=True)
    patched = build_gpt(config)
    revert_lck_from_megatron()
    patched.load_state_dict(stock.state_dict())
    cores = [layer.self_attention.core_attention for layer in patched.decoder.layers]
    assert all(type(c) is LckDotProductAttention for c in cores), cores
    assert not any(isinstance(m, LckDotProductAttention) for m in stock.modules())

    tokens = torch.randint(0, 64, (B, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).expand(B, 16)
    results = []
    for model in (stock, patched):
        loss = model(tokens, pos, None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        results.append({"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}})
    assert [c.calls for c in cores] == [{"lck": 1, "megatron": 0}] * config.num_layers
    _compare(results[1], results[0], torch.float32, "patched GPTModel vs stock", scale=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["causal", "no_mask", "explicit"])
def test_bf16_on_gpu_matches_megatron_and_float64(megatron_tp1: None, mask: str, groups: int) -> None:
    """``explicit``: a causal module given Megatron-LM's boolean causal mask (the memory-efficient kernel)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)  # Megatron's dropout runs under the CUDA RNG tracker
    config = transformer_config(
        torch.bfloat16, num_attention_heads=8, num_query_groups=groups, kv_channels=64, hidden_size=512
    )
    stock, lck = (m.cuda() for m in _pair(config, "causal" if mask == "explicit" else mask))
    sq = 256
    given = torch.ones(sq, sq, dtype=torch.bool, device="cuda").triu(1).view(1, 1, sq, sq)
    explicit = given if mask == "explicit" else None
    qkv = _qkv(sq, sq, 8, groups, torch.bfloat16, "cuda", hn=64)
    dout = torch.randn(sq, B, 8 * 64, device="cuda", dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Without the math backend: a fused kernel must take the call (the scores are never materialised).
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused):
        got = _run(lck, qkv, dout, explicit)
    want = _run(stock, qkv, dout, explicit)
    assert lck.calls == {"lck": 1, "megatron": 0}
    assert got["output"].dtype == torch.bfloat16 and got["output"].shape == (sq, B, 512)
    ref = _reference([t.cpu() for t in qkv], dout.cpu(), 1 / 8, mask != "no_mask")
    _compare(got, ref, torch.bfloat16, "lck vs float64")
    _compare(want, ref, torch.bfloat16, "megatron vs float64")
    _compare(got, want, torch.bfloat16, "lck vs megatron", scale=2.0)
