"""apply_lck_to_megatron / revert_lck_from_megatron against the installed megatron-core (no stubs)."""

from __future__ import annotations

import importlib
import inspect
import logging

import pytest
import torch

from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron
from lck_megatron.patch import applied

pytestmark = pytest.mark.megatron

SWIGLU_CONSUMERS = (
    "megatron.core.fusions.fused_bias_swiglu",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.shared_experts",
)
CE_CONSUMERS = {
    "megatron.core.tensor_parallel.cross_entropy": "vocab_parallel_cross_entropy",
    "megatron.core.tensor_parallel": "vocab_parallel_cross_entropy",
    "megatron.core.fusions.fused_cross_entropy": "fused_vocab_parallel_cross_entropy",
    "megatron.core.models.common.language_module.language_module": "fused_vocab_parallel_cross_entropy",
}


def _mod(name: str):
    return importlib.import_module(name)


def _originals() -> dict[str, object]:
    return {
        "swiglu": _mod("megatron.core.fusions.fused_bias_swiglu").bias_swiglu_impl,
        "ce": _mod("megatron.core.tensor_parallel.cross_entropy").vocab_parallel_cross_entropy,
        "fused_ce": _mod("megatron.core.fusions.fused_cross_entropy").fused_vocab_parallel_cross_entropy,
        "norm": _mod("megatron.core.transformer.torch_norm").WrappedTorchNorm,
    }


def test_swiglu_patch_reaches_every_consumer_and_reverts() -> None:
    from lck_megatron.swiglu import LckMegatronSwiGLU

    orig = _originals()
    result = apply_lck_to_megatron(rms_norm=False, swiglu=True)
    assert set(result) == {"swiglu"}
    replacement = _mod(SWIGLU_CONSUMERS[0]).bias_swiglu_impl
    assert isinstance(replacement, LckMegatronSwiGLU)
    assert replacement.fallback_impl is orig["swiglu"], "the fallback must be Megatron's original"
    for name in SWIGLU_CONSUMERS:
        assert _mod(name).bias_swiglu_impl is replacement, f"{name}.bias_swiglu_impl was not patched"
        assert f"{name}.bias_swiglu_impl" in result["swiglu"]
    # Routed MoE experts use the weighted variant, which lck leaves alone.
    assert not isinstance(_mod("megatron.core.transformer.mlp").weighted_bias_swiglu_impl, LckMegatronSwiGLU)
    # Nothing else was touched.
    assert _mod("megatron.core.transformer.torch_norm").WrappedTorchNorm is orig["norm"]
    assert _mod("megatron.core.tensor_parallel").vocab_parallel_cross_entropy is orig["ce"]

    restored = revert_lck_from_megatron()
    for name in SWIGLU_CONSUMERS:
        assert _mod(name).bias_swiglu_impl is orig["swiglu"], f"{name}.bias_swiglu_impl not restored"
        assert f"{name}.bias_swiglu_impl" in restored
    assert revert_lck_from_megatron() == []
    assert applied() == {}


def test_cross_entropy_patch_keeps_signatures_and_reverts() -> None:
    from lck_megatron.cross_entropy import LckVocabParallelCrossEntropy

    orig = _originals()
    result = apply_lck_to_megatron(rms_norm=False, cross_entropy=True)
    for name, attr in CE_CONSUMERS.items():
        value = getattr(_mod(name), attr)
        assert isinstance(value, LckVocabParallelCrossEntropy), f"{name}.{attr} was not patched"
        assert f"{name}.{attr}" in result["cross_entropy"]
    tp = _mod("megatron.core.tensor_parallel")
    assert tp.vocab_parallel_cross_entropy.original is orig["ce"]
    assert inspect.signature(tp.vocab_parallel_cross_entropy) == inspect.signature(orig["ce"])
    fused = _mod("megatron.core.fusions.fused_cross_entropy").fused_vocab_parallel_cross_entropy
    assert inspect.signature(fused) == inspect.signature(orig["fused_ce"])
    revert_lck_from_megatron()
    for name, attr in CE_CONSUMERS.items():
        assert getattr(_mod(name), attr) in (orig["ce"], orig["fused_ce"]), f"{name}.{attr} not restored"
    assert tp.vocab_parallel_cross_entropy is orig["ce"]


def test_rms_norm_patch_covers_spec_provider_and_final_norm_slots() -> None:
    from lck_megatron.rms_norm import LckWrappedTorchNorm

    orig = _originals()
    block = _mod("megatron.core.transformer.transformer_block")
    backends = _mod("megatron.core.models.backends")
    specs = _mod("megatron.core.models.gpt.gpt_layer_specs")
    before = {
        "block": block.LayerNormImpl,
        "backends": backends.LNImpl,
        "specs": specs.LNImpl,
    }
    result = apply_lck_to_megatron()  # rms_norm=True is the default
    assert set(result) == {"rms_norm"}
    assert _mod("megatron.core.transformer.torch_norm").WrappedTorchNorm is LckWrappedTorchNorm
    # The final-layernorm slot and the spec modules are patched only where they hold the torch norm:
    # TE and Apex norms (not installed here, but possible on GPU machines) stay as they are.
    for key, mod in (("block", block), ("backends", backends), ("specs", specs)):
        attr = "LayerNormImpl" if key == "block" else "LNImpl"
        if before[key] is orig["norm"]:
            assert getattr(mod, attr) is LckWrappedTorchNorm, f"{mod.__name__}.{attr} not patched"
        else:
            assert getattr(mod, attr) is before[key], f"{mod.__name__}.{attr} ({before[key]}) was touched"
    # The local spec provider hands out the patched norm, for RMSNorm and LayerNorm requests alike.
    provider = backends.LocalSpecProvider()
    assert provider.layer_norm(rms_norm=True, for_qk=False) is LckWrappedTorchNorm
    revert_lck_from_megatron()
    # layer_norm(rms_norm=True) re-assigned backends.LNImpl while patched: the revert catches that too.
    assert backends.LNImpl is orig["norm"]
    assert block.LayerNormImpl is before["block"]
    assert provider.layer_norm(rms_norm=True, for_qk=False) is orig["norm"]


def test_apply_is_idempotent_and_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lck_megatron import patch
    from lck_megatron._support import LogOnce

    monkeypatch.setattr(patch, "_log_once", LogOnce())  # forget what earlier tests logged
    caplog.set_level(logging.INFO, logger="lck_megatron")
    first = apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    impl = _mod("megatron.core.transformer.mlp").bias_swiglu_impl
    n_logged = len([r for r in caplog.records if "patched megatron-core" in r.getMessage()])
    second = apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    assert first == second
    assert _mod("megatron.core.transformer.mlp").bias_swiglu_impl is impl, "re-applying replaced the module"
    assert len([r for r in caplog.records if "patched megatron-core" in r.getMessage()]) == n_logged == 3


def test_changing_in_place_replaces_the_swiglu_module() -> None:
    orig = _originals()
    apply_lck_to_megatron(rms_norm=False, swiglu=True)
    assert _mod("megatron.core.transformer.mlp").bias_swiglu_impl.in_place is False
    apply_lck_to_megatron(rms_norm=False, swiglu=True, swiglu_in_place=True)
    impl = _mod("megatron.core.transformer.mlp").bias_swiglu_impl
    assert impl.in_place is True
    assert impl.fallback_impl is orig["swiglu"]
    for name in SWIGLU_CONSUMERS:
        assert _mod(name).bias_swiglu_impl is impl
    revert_lck_from_megatron()
    assert _mod("megatron.core.transformer.mlp").bias_swiglu_impl is orig["swiglu"]


def test_false_flags_do_not_unpatch() -> None:
    from lck_megatron.swiglu import LckMegatronSwiGLU

    apply_lck_to_megatron(rms_norm=False, swiglu=True)
    apply_lck_to_megatron(rms_norm=True, swiglu=False)
    assert isinstance(_mod("megatron.core.transformer.mlp").bias_swiglu_impl, LckMegatronSwiGLU)
    assert set(applied()) == {"swiglu", "rms_norm"}


def _model_methods() -> dict[str, object]:
    """What each class of linear_cross_entropy.HOMES defines itself (an inherited method is not a site)."""
    from lck_megatron.linear_cross_entropy import HOMES

    found = {}
    for module, cls_name, attr in HOMES:
        try:
            cls = getattr(_mod(module), cls_name)
        except (ImportError, AttributeError):
            continue
        if attr in vars(cls):
            found[f"{module}.{cls_name}.{attr}"] = vars(cls)[attr]
    return found


def test_linear_cross_entropy_wraps_model_methods_and_reverts() -> None:
    from lck_megatron.patch import linear_cross_entropy_route

    before = _model_methods()
    gpt = "megatron.core.models.gpt.gpt_model.GPTModel._postprocess"
    assert gpt in before
    orig = _originals()
    result = apply_lck_to_megatron(rms_norm=False, linear_cross_entropy=True)
    route = linear_cross_entropy_route()
    assert route is not None
    assert sorted(result["linear_cross_entropy"]) == sorted(before)
    wrapped = _model_methods()
    for site, fn in wrapped.items():
        assert fn is not before[site] and fn.lck_route is route, site
        assert fn.__wrapped__ is before[site], site
        assert inspect.signature(fn) == inspect.signature(before[site]), site
    # Applying again keeps the same wrappers and sites; nothing else was touched.
    assert apply_lck_to_megatron(rms_norm=False, linear_cross_entropy=True) == result
    assert _model_methods() == wrapped
    assert _mod("megatron.core.tensor_parallel").vocab_parallel_cross_entropy is orig["ce"]
    assert _mod("megatron.core.transformer.torch_norm").WrappedTorchNorm is orig["norm"]

    restored = revert_lck_from_megatron()
    assert sorted(restored) == sorted(before)
    after = _model_methods()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert linear_cross_entropy_route() is None and applied() == {}


@pytest.mark.parametrize(
    "flag", ["rms_norm", "cross_entropy", "swiglu", "swiglu_in_place", "linear_cross_entropy", "attention"]
)
def test_flags_must_be_bool(flag: str) -> None:
    orig = _originals()
    with pytest.raises(TypeError, match=flag):
        apply_lck_to_megatron(**{flag: 1})
    assert applied() == {}, "a rejected call must not patch anything"
    assert _mod("megatron.core.transformer.mlp").bias_swiglu_impl is orig["swiglu"]


def test_models_built_while_patched_use_lck_norms(megatron_tp1: None) -> None:
    from _helpers import build_gpt, transformer_config

    from lck_megatron.rms_norm import LckMegatronRMSNorm

    apply_lck_to_megatron()
    model = build_gpt(transformer_config())
    norms = {
        n: type(m)
        for n, m in model.named_modules()
        if n.endswith(("input_layernorm", "pre_mlp_layernorm", "final_layernorm"))
    }
    assert len(norms) == 5, norms  # 2 layers × 2 + the final norm
    assert all(t is LckMegatronRMSNorm for t in norms.values()), norms
    # A LayerNorm model is built by Megatron's own factory, unchanged.
    ln_model = build_gpt(transformer_config(normalization="LayerNorm"))
    assert type(ln_model.decoder.final_layernorm) is torch.nn.LayerNorm
    revert_lck_from_megatron()
    stock = build_gpt(transformer_config())
    assert type(stock.decoder.final_layernorm) is torch.nn.RMSNorm
    assert type(stock.decoder.layers[0].input_layernorm) is torch.nn.RMSNorm
    # Same parameters and state-dict keys either way: checkpoints move between stock and patched models.
    assert list(stock.state_dict()) == list(model.state_dict())
