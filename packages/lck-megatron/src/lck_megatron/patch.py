"""``apply_lck_to_megatron`` / ``revert_lck_from_megatron``: one-line, reversible Megatron-Core patching.

Megatron modules bind the functions and classes they use at import time
(``from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl``), so replacing the symbol in
its defining module alone changes nothing for its users. The patch therefore imports the known
consumer modules, then walks every loaded ``megatron.*`` module and rebinds each global that *is* the
original object (identity, not name), recording ``(module, attribute, original)`` for an exact revert.

- SwiGLU: ``bias_swiglu_impl`` → one :class:`~lck_megatron.swiglu.LckMegatronSwiGLU` (consumers:
  ``fusions.fused_bias_swiglu``, ``transformer.mlp``, ``transformer.moe.shared_experts``). MoE routed
  experts use ``weighted_bias_swiglu_impl``, which is left alone.
- Cross entropy: ``tensor_parallel.vocab_parallel_cross_entropy`` and
  ``fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy`` → lck routes (consumers include
  the ``tensor_parallel`` package and ``language_module``).
- RMSNorm: ``transformer.torch_norm.WrappedTorchNorm`` → :class:`~lck_megatron.rms_norm.LckWrappedTorchNorm`
  wherever it is bound: the local spec provider's norm (``models.backends``), the final-layernorm
  slot (``transformer.transformer_block.LayerNormImpl`` and ``gpt_layer_specs.LNImpl`` when they are the
  torch norm), and the other local specs. TE and Apex norms are different objects and stay as they are.
- Attention: ``transformer.dot_product_attention.DotProductAttention`` (the local specs' unfused core
  attention) → :class:`~lck_megatron.attention.LckDotProductAttention` wherever it is bound: the local spec
  provider (``models.backends``), the BERT, T5, ViT, LLaVA, heterogeneous-GPT and ModelOpt local specs, and
  ``bert_model``'s spec check. ``TEDotProductAttention`` is a different object and stays as it is.
- Linear cross entropy: ``GPTModel._postprocess`` (and ``HybridModel.forward`` / ``MambaModel.forward`` where
  the installed version defines them) are wrapped on their class; see :mod:`lck_megatron.linear_cross_entropy`.
- MoE: ``MoELayer.__init__`` is wrapped on its class and ``moe_layer``'s dispatcher names become switches, so
  supported layers get lck's token dispatcher and grouped experts; see :mod:`lck_megatron.moe`.

The record of patched sites (and Megatron's originals) lives in :mod:`lck_megatron._bindings`.

Apply the patch on every rank before the model is built: modules built earlier keep what they were
built with (the norms), and functions already captured in closures are not reached.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from lck_megatron._bindings import (
    Applied,
    Binding,
    applied_features,
    lock,
    original,
    rebind,
    restore,
)
from lck_megatron._support import LogOnce, logger

_SWIGLU_HOME = ("megatron.core.fusions.fused_bias_swiglu", "bias_swiglu_impl")
_CE_HOME = ("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy")
_FUSED_CE_HOME = ("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy")
_NORM_HOME = ("megatron.core.transformer.torch_norm", "WrappedTorchNorm")
_ATTENTION_HOME = ("megatron.core.transformer.dot_product_attention", "DotProductAttention")

# Imported before the sweep so that their bindings exist; a module missing from a version is skipped.
_CONSUMERS = {
    "swiglu": (
        "megatron.core.fusions.fused_bias_swiglu",
        "megatron.core.transformer.mlp",
        "megatron.core.transformer.moe.shared_experts",
    ),
    "cross_entropy": (
        "megatron.core.tensor_parallel.cross_entropy",
        "megatron.core.tensor_parallel",
        "megatron.core.fusions.fused_cross_entropy",
        "megatron.core.models.common.language_module.language_module",
    ),
    "rms_norm": (
        "megatron.core.transformer.torch_norm",
        "megatron.core.transformer.torch_layer_norm",
        "megatron.core.transformer.transformer_block",
        "megatron.core.models.backends",
        "megatron.core.models.gpt.gpt_layer_specs",
    ),
    "attention": (
        "megatron.core.transformer.dot_product_attention",
        "megatron.core.models.backends",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
        "megatron.core.models.bert.bert_layer_specs",
        "megatron.core.models.bert.bert_model",
        "megatron.core.models.T5.t5_spec",
        "megatron.core.models.vision.vit_layer_specs",
        "megatron.core.models.multimodal.llava_spec",
        "megatron.core.post_training.modelopt.gpt.model_specs",
        "megatron.core.post_training.modelopt.mamba.model_specs",  # 0.16
        "megatron.core.post_training.modelopt.hybrid.model_specs",  # 0.19
    ),
    # Class methods, patched on the class that defines them (see lck_megatron.linear_cross_entropy).
    "linear_cross_entropy": (
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.models.hybrid.hybrid_model",
        "megatron.core.models.mamba.mamba_model",
    ),
    # MoELayer.__init__ and the dispatcher names of moe_layer (see lck_megatron.moe).
    "moe": ("megatron.core.transformer.moe.moe_layer",),
}
FEATURES = tuple(_CONSUMERS)
__all__ = ["FEATURES", "Binding", "applied", "apply_lck_to_megatron", "original", "revert_lck_from_megatron"]

_log_once = LogOnce(logger, logging.INFO)


def _import_consumers(feature: str) -> None:
    for name in _CONSUMERS[feature]:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # not every version or install has every consumer
            logger.debug("lck: %s not importable (%s); its bindings are not patched", name, exc)


def _home_value(home: tuple[str, str]) -> Any:
    return getattr(importlib.import_module(home[0]), home[1])


def _make_pairs(feature: str, options: dict[str, Any]) -> list[tuple[Any, Any]]:
    if feature == "swiglu":
        from lck_megatron.swiglu import LckMegatronSwiGLU

        fn = _home_value(_SWIGLU_HOME)
        return [(fn, LckMegatronSwiGLU(fallback_impl=fn, in_place=options["swiglu_in_place"]))]
    if feature == "cross_entropy":
        from lck_megatron.cross_entropy import LckVocabParallelCrossEntropy

        pairs = []
        for home in (_CE_HOME, _FUSED_CE_HOME):
            try:
                fn = _home_value(home)
            except (ImportError, AttributeError) as exc:
                logger.debug("lck: %s.%s not available (%s)", home[0], home[1], exc)
                continue
            pairs.append((fn, LckVocabParallelCrossEntropy(fn)))
        return pairs
    if feature == "rms_norm":
        from lck_megatron.rms_norm import LckWrappedTorchNorm

        return [(_home_value(_NORM_HOME), LckWrappedTorchNorm)]
    if feature == "attention":
        from lck_megatron.attention import LckDotProductAttention

        return [(_home_value(_ATTENTION_HOME), LckDotProductAttention)]
    raise AssertionError(feature)


def _patch_classes(route: Any) -> list[Binding]:
    """Wrap each model method of ``linear_cross_entropy.HOMES`` that its class defines (not inherited) and
    that takes ``labels``; methods already wrapped are left as they are."""
    from lck_megatron.linear_cross_entropy import HOMES

    made = []
    for module, cls_name, attr in HOMES:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError) as exc:
            logger.debug("lck: %s.%s not available (%s)", module, cls_name, exc)
            continue
        fn = vars(cls).get(attr)
        if fn is None or getattr(fn, "lck_route", None) is not None:
            continue
        wrapper = route.wrap(fn)
        if wrapper is None:
            logger.debug("lck: %s.%s.%s takes no labels; left alone", module, cls_name, attr)
            continue
        setattr(cls, attr, wrapper)
        made.append(Binding(f"{module}.{cls_name}", attr, fn, wrapper, owner=cls))
    return made


def apply_lck_to_megatron(
    rms_norm: bool = True,
    cross_entropy: bool = False,
    swiglu: bool = False,
    *,
    swiglu_in_place: bool = False,
    linear_cross_entropy: bool = False,
    moe: bool = False,
    attention: bool = False,
) -> dict[str, list[str]]:
    """Patch megatron-core so that its RMSNorm, cross-entropy, SwiGLU, output-layer and attention consumers
    run lck.

    Args:
        rms_norm: torch RMSNorm built through ``WrappedTorchNorm`` (local specs, final layernorm) →
            :class:`~lck_megatron.rms_norm.LckMegatronRMSNorm`. TE and Apex norms are left alone.
        cross_entropy: ``vocab_parallel_cross_entropy`` and ``fused_vocab_parallel_cross_entropy`` → lck.
        swiglu: ``bias_swiglu_impl`` → :class:`~lck_megatron.swiglu.LckMegatronSwiGLU`.
        swiglu_in_place: build that module with ``in_place=True`` (less activation memory; see its docs).
        linear_cross_entropy: a language model called with labels (``GPTModel``, ``HybridModel``,
            ``MambaModel``) computes its output projection and loss as lck's fused linear cross entropy,
            never materialising the logits (:mod:`lck_megatron.linear_cross_entropy`). Takes precedence
            over ``cross_entropy`` for those calls; calls it does not take keep Megatron's path (and so
            ``cross_entropy``'s route, when that is patched too).
        moe: Megatron MoE layers built afterwards route their tokens through ``lck_ep.Buffer`` and run their
            local-spec experts (``SequentialMLP``) as lck's grouped experts, keeping Megatron's parameters;
            configurations lck does not take stay Megatron's with one logged reason (:mod:`lck_megatron.moe`).
        attention: the local specs' ``DotProductAttention`` → :class:`~lck_megatron.attention.LckDotProductAttention`
            for layers built afterwards: torch's ``scaled_dot_product_attention`` (flash / cuDNN /
            memory-efficient kernels on a GPU), same parameters and results; calls it does not take (an
            explicit mask, packed sequences, attention bias, sliding window, a non-vanilla softmax) run
            Megatron's forward with one logged reason. TE attention is left alone.

    A flag set to False leaves that part as it is (it does not undo an earlier patch; use
    :func:`revert_lck_from_megatron`). Idempotent: applying the same patch again rebinds only consumer
    modules imported since; applying it with a different ``swiglu_in_place`` replaces the SwiGLU module.
    Call it on every rank before building the model. Not collective. Logs what it patched once.

    Returns:
        ``{feature: [patched "module.attr" sites]}`` for the features requested, listing every site
        currently patched by lck for that feature.

    Raises:
        TypeError: a flag is not a bool.
        ImportError: megatron-core is not importable.
    """
    flags = {
        "rms_norm": rms_norm,
        "cross_entropy": cross_entropy,
        "swiglu": swiglu,
        "swiglu_in_place": swiglu_in_place,
        "linear_cross_entropy": linear_cross_entropy,
        "moe": moe,
        "attention": attention,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply_lck_to_megatron: {name} must be a bool, got {value!r}")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"apply_lck_to_megatron: megatron-core is not importable ({exc})") from exc

    result: dict[str, list[str]] = {}
    with lock:
        for feature in FEATURES:
            if not flags[feature]:
                continue
            options = {"swiglu_in_place": swiglu_in_place} if feature == "swiglu" else {}
            key = tuple(sorted(options.items()))
            state = applied_features.get(feature)
            if state is not None and state.options != key:
                restore(state)
                del applied_features[feature]
                state = None
            _import_consumers(feature)
            if feature == "linear_cross_entropy":
                if state is None:
                    from lck_megatron.linear_cross_entropy import LinearCrossEntropyRoute

                    state = Applied(key, [], [], route=LinearCrossEntropyRoute())
                    applied_features[feature] = state
                state.bindings.extend(_patch_classes(state.route))
            elif feature == "moe":
                from lck_megatron.moe import MoERoute, apply_moe

                if state is None:
                    state = Applied(key, [], [], route=MoERoute())
                    applied_features[feature] = state
                state.bindings.extend(apply_moe(state.route))
            elif state is None:
                pairs = _make_pairs(feature, options)
                state = Applied(key, pairs, rebind(pairs))
                applied_features[feature] = state
            else:
                state.bindings.extend(rebind(state.pairs))
            sites = [b.site for b in state.bindings]
            result[feature] = sites
            opts = "".join(f", {k}={v}" for k, v in options.items())
            _log_once(f"lck: patched megatron-core {feature}{opts} at {len(sites)} sites: {', '.join(sites)}")
    return result


def revert_lck_from_megatron() -> list[str]:
    """Undo :func:`apply_lck_to_megatron`: every patched site gets its original object back.

    Safe to call when nothing is patched (returns ``[]``) and to call twice. Sites that someone else
    changed after lck patched them are left alone, with a warning. Models built while patched keep the
    modules they were built with (their norms and attention); the output-layer route is gone for every model. Returns
    the restored ``"module.attr"`` sites.
    """
    restored: list[str] = []
    with lock:
        for feature in list(applied_features):
            restored.extend(restore(applied_features.pop(feature)))
    if restored:
        logger.info("lck: restored megatron-core at %d sites", len(restored))
    return restored


def applied() -> dict[str, list[str]]:
    """``{feature: ["module.attr", ...]}`` for the features currently patched."""
    with lock:
        return {f: [b.site for b in s.bindings] for f, s in applied_features.items()}


def linear_cross_entropy_route() -> Any:
    """The active :class:`~lck_megatron.linear_cross_entropy.LinearCrossEntropyRoute` (its ``calls`` and
    ``fallback_reasons``), or None when ``linear_cross_entropy`` is not patched."""
    with lock:
        state = applied_features.get("linear_cross_entropy")
        return None if state is None else state.route


def moe_route() -> Any:
    """The active :class:`~lck_megatron.moe.MoERoute` (``layers`` built through lck or left to Megatron, and
    ``fallback_reasons``), or None when ``moe`` is not patched."""
    with lock:
        state = applied_features.get("moe")
        return None if state is None else state.route
