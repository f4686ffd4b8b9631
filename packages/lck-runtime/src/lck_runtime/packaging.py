"""What every lck package's ``__init__`` shares: its version, and lazily imported public names.

Standard library only: each package's ``import`` stays as cheap as its own docstring promises.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any


def distribution_version(distribution: str, source_tree: str) -> str:
    """The installed version of ``distribution``, or ``source_tree`` when the package runs from a source
    tree on PYTHONPATH (GPU runners), where no distribution metadata exists."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return source_tree


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's PEP 562 ``__getattr__`` and ``__dir__``: ``exports`` maps a public name to the
    submodule defining it, imported on first use and then bound in ``namespace`` (the package's
    ``globals()``, which holds ``__name__`` and ``__all__``)."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(namespace["__all__"])

    return __getattr__, __dir__
