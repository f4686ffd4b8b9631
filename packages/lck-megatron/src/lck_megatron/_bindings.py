"""The record of what lck's patch changed in megatron-core, and how to undo it.

Kept apart from :mod:`lck_megatron.patch` so that the adapters which need Megatron's own objects while the
patch is applied (``rms_norm`` asks for the original ``WrappedTorchNorm``) depend on this record, not on
the patch that imports them.

Two kinds of sites:
- module globals (``megatron.core.transformer.mlp.bias_swiglu_impl``): Megatron binds functions and
  classes at import time, so every global that *is* the original object is rebound (found by identity);
- class attributes (``GPTModel._postprocess``): one ``setattr`` on the class that defines the method.
"""

from __future__ import annotations

import importlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from lck_megatron._support import logger


@dataclass(frozen=True)
class Binding:
    """One rebinding made by the patch: ``module.attr`` held ``original`` and now holds ``replacement``.

    ``owner`` is the class for a class attribute (``module`` then names the class, ``"pkg.mod.Class"``);
    ``None`` for a module global.
    """

    module: str
    attr: str
    original: Any
    replacement: Any
    owner: Any = None

    @property
    def site(self) -> str:
        return f"{self.module}.{self.attr}"

    def target(self) -> Any:
        return self.owner if self.owner is not None else sys.modules.get(self.module)


@dataclass
class Applied:
    """What one feature of the patch holds: its options, its (original, replacement) pairs, its sites."""

    options: tuple[tuple[str, Any], ...]
    pairs: list[tuple[Any, Any]]  # (original, replacement) for the module-global sweep
    bindings: list[Binding] = field(default_factory=list)
    route: Any = None  # linear_cross_entropy: the LinearCrossEntropyRoute its wrappers share


lock = threading.RLock()
applied_features: dict[str, Applied] = {}


def megatron_modules() -> list[tuple[str, Any]]:
    return [
        (name, mod)
        for name, mod in list(sys.modules.items())
        if mod is not None and (name == "megatron" or name.startswith("megatron."))
    ]


def rebind(pairs: list[tuple[Any, Any]]) -> list[Binding]:
    """Point every megatron global that is one of the originals at its replacement."""
    made = []
    for mod_name, mod in megatron_modules():
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


def restore(state: Applied) -> list[str]:
    """Give every site of ``state`` its original back; returns the restored sites."""
    restored = []
    for b in state.bindings:
        target = b.target()
        if target is None:
            continue
        current = (target.__dict__ if b.owner is not None else vars(target)).get(b.attr)
        if current is b.replacement:
            setattr(target, b.attr, b.original)
            restored.append(b.site)
        elif current is not b.original:
            logger.warning(
                "lck: %s was changed by someone else after lck patched it; leaving it as it is", b.site
            )
    # Megatron may copy a patched object into another global after the patch (the local spec
    # provider assigns WrappedTorchNorm to backends.LNImpl when asked for an RMSNorm): restore those too.
    for mod_name, mod in megatron_modules():
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


def original(module: str, attr: str) -> Any:
    """The object Megatron had at ``module.attr`` before lck's patch (the current value if unpatched)."""
    if not isinstance(module, str) or not isinstance(attr, str):
        raise TypeError("original: module and attr must be str")
    with lock:
        for state in applied_features.values():
            for b in state.bindings:
                if b.module == module and b.attr == attr:
                    return b.original
    return getattr(importlib.import_module(module), attr)
