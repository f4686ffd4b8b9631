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

Apply the patch on every rank before the model is built: modules built earlier keep what they were
built with (the norms), and functions already captured in closures are not reached.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any

from lck_megatron._support import LogOnce, logger

_SWIGLU_HOME = ("megatron.core.fusions.fused_bias_swiglu", "bias_swiglu_impl")
_CE_HOME = ("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy")
_FUSED_CE_HOME = ("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy")
_NORM_HOME = ("megatron.core.transformer.torch_norm", "WrappedTorchNorm")

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
}
FEATURES = tuple(_CONSUMERS)


@dataclass(frozen=True)
class Binding:
    """One rebinding made by the patch: ``module.attr`` held ``original`` and now holds ``replacement``."""

    module: str
    attr: str
    original: Any
    replacement: Any

    @property
    def site(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass
class _Applied:
    options: tuple[tuple[str, Any], ...]
    pairs: list[tuple[Any, Any]]  # (original, replacement)
    bindings: list[Binding]


_lock = threading.RLock()
_applied: dict[str, _Applied] = {}
_log_once = LogOnce(logger, logging.INFO)


def _megatron_modules() -> list[tuple[str, Any]]:
    return [
        (name, mod)
        for name, mod in list(sys.modules.items())
        if mod is not None and (name == "megatron" or name.startswith("megatron."))
    ]


def _import_consumers(feature: str) -> None:
    for name in _CONSUMERS[feature]:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # not every version or install has every consumer
            logger.debug("lck: %s not importable (%s); its bindings are not patched", name, exc)


def _rebind(pairs: list[tuple[Any, Any]]) -> list[Binding]:
    """Point every megatron global that is one of the originals at its replacement."""
    made = []
    for mod_name, mod in _megatron_modules():
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            for original, replacement in pairs:
                if value is original:
                    setattr(mod, attr, replacement)
                    made.append(Binding(mod_name, attr, original, replacement))
                    break
    return made


def _restore(state: _Applied) -> list[str]:
    restored = []
    for b in state.bindings:
        mod = sys.modules.get(b.module)
        if mod is None:
            continue
        current = getattr(mod, b.attr, None)
        if current is b.replacement:
            setattr(mod, b.attr, b.original)
            restored.append(b.site)
        elif current is not b.original:
            logger.warning(
                "lck: %s was changed by someone else after lck patched it; leaving it as it is", b.site
            )
    # Megatron may copy a patched object into another global after the patch (the local spec
    # provider assigns WrappedTorchNorm to backends.LNImpl when asked for an RMSNorm): restore those too.
    for mod_name, mod in _megatron_modules():
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            for original, replacement in state.pairs:
                if value is replacement:
                    setattr(mod, attr, original)
                    restored.append(f"{mod_name}.{attr}")
                    break
    return restored


def _home_value(home: tuple[str, str]) -> Any:
    return getattr(importlib.import_module(home[0]), home[1])


def original(module: str, attr: str) -> Any:
    """The object Megatron had at ``module.attr`` before lck's patch (the current value if unpatched)."""
    if not isinstance(module, str) or not isinstance(attr, str):
        raise TypeError("original: module and attr must be str")
    with _lock:
        for state in _applied.values():
            for b in state.bindings:
                if b.module == module and b.attr == attr:
                    return b.original
    return getattr(importlib.import_module(module), attr)


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
    raise AssertionError(feature)


def apply_lck_to_megatron(
    rms_norm: bool = True,
    cross_entropy: bool = False,
    swiglu: bool = False,
    *,
    swiglu_in_place: bool = False,
) -> dict[str, list[str]]:
    """Patch megatron-core so that its RMSNorm, cross-entropy and SwiGLU consumers run lck's kernels.

    Args:
        rms_norm: torch RMSNorm built through ``WrappedTorchNorm`` (local specs, final layernorm) →
            :class:`~lck_megatron.rms_norm.LckMegatronRMSNorm`. TE and Apex norms are left alone.
        cross_entropy: ``vocab_parallel_cross_entropy`` and ``fused_vocab_parallel_cross_entropy`` → lck.
        swiglu: ``bias_swiglu_impl`` → :class:`~lck_megatron.swiglu.LckMegatronSwiGLU`.
        swiglu_in_place: build that module with ``in_place=True`` (less activation memory; see its docs).

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
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply_lck_to_megatron: {name} must be a bool, got {value!r}")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"apply_lck_to_megatron: megatron-core is not importable ({exc})") from exc

    result: dict[str, list[str]] = {}
    with _lock:
        for feature in FEATURES:
            if not flags[feature]:
                continue
            options = {"swiglu_in_place": swiglu_in_place} if feature == "swiglu" else {}
            key = tuple(sorted(options.items()))
            state = _applied.get(feature)
            if state is not None and state.options != key:
                _restore(state)
                del _applied[feature]
                state = None
            _import_consumers(feature)
            if state is None:
                pairs = _make_pairs(feature, options)
                state = _Applied(key, pairs, _rebind(pairs))
                _applied[feature] = state
            else:
                state.bindings.extend(_rebind(state.pairs))
            sites = [b.site for b in state.bindings]
            result[feature] = sites
            opts = "".join(f", {k}={v}" for k, v in options.items())
            _log_once(f"lck: patched megatron-core {feature}{opts} at {len(sites)} sites: {', '.join(sites)}")
    return result


def revert_lck_from_megatron() -> list[str]:
    """Undo :func:`apply_lck_to_megatron`: every patched site gets its original object back.

    Safe to call when nothing is patched (returns ``[]``) and to call twice. Sites that someone else
    changed after lck patched them are left alone, with a warning. Models built while patched keep the
    modules they were built with. Returns the restored ``"module.attr"`` sites.
    """
    restored: list[str] = []
    with _lock:
        for feature in list(_applied):
            restored.extend(_restore(_applied.pop(feature)))
    if restored:
        logger.info("lck: restored megatron-core at %d sites", len(restored))
    return restored


def applied() -> dict[str, list[str]]:
    """``{feature: ["module.attr", ...]}`` for the features currently patched."""
    with _lock:
        return {f: [b.site for b in s.bindings] for f, s in _applied.items()}
