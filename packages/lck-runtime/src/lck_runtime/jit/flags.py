"""The ``<PREFIX>_JIT_*`` environment knobs and ``-D`` define validation.

- ``<PREFIX>_JIT_CACHE_DIR``: cache root (default: a per-prefix folder under the user cache dir).
- ``<PREFIX>_JIT_PRINT_COMPILER_COMMAND``: ``1`` prints every nvcc command line to stderr.
- ``<PREFIX>_JIT_EXTRA_FLAGS``: whitespace-separated ``-DNAME=INTEGER`` items appended to every
  build. Nothing else is accepted: an arbitrary flag could change code generation behind the cache
  key's back or turn the argument list into something other than a device-code compile.

Everything here is validated when a :class:`~lck_runtime.jit.Jit` is constructed, before nvcc runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lck_runtime.jit.errors import JitConfigError
from lck_runtime.paths import jit_cache_dir

_PREFIX_RE = re.compile(r"[A-Z][A-Z0-9_]*")
_MACRO_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXTRA_ITEM_RE = re.compile(r"-D([A-Za-z_][A-Za-z0-9_]*)=(-?[0-9]+)")
# String define values are plain tokens: identifiers, numbers, suffixed literals (128u, 1.5f).
_TOKEN_RE = re.compile(r"[A-Za-z0-9_.+-]+")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class JitSettings:
    """The JIT settings read from the environment for one prefix."""

    prefix: str
    cache_dir: Path
    print_command: bool
    extra_defines: tuple[tuple[str, int], ...]

    @property
    def extra_flags(self) -> tuple[str, ...]:
        return tuple(f"-D{n}={v}" for n, v in self.extra_defines)


def check_prefix(prefix: Any) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise JitConfigError(
            f"Jit: prefix must be an upper-case environment prefix such as 'EP' or 'LCK', got {prefix!r}"
        )
    return prefix


def parse_extra_flags(var: str, text: str) -> tuple[tuple[str, int], ...]:
    """Parse ``-DNAME=INTEGER`` items; any other item raises naming ``var`` and the item."""
    out: dict[str, int] = {}
    for item in text.split():
        m = _EXTRA_ITEM_RE.fullmatch(item)
        if m is None:
            raise JitConfigError(
                f"{var}: item {item!r} is not accepted; only -DNAME=INTEGER items are allowed "
                f"(e.g. {var}='-DEP_NUM_SUB_PARTS=4 -DFOO=-1')"
            )
        name, value = m.group(1), int(m.group(2))
        if name in out and out[name] != value:
            raise JitConfigError(
                f"{var}: {name} is set twice with different values ({out[name]} and {value})"
            )
        out[name] = value
    return tuple(out.items())


def parse_bool(var: str, text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise JitConfigError(f"{var}: expected 0 or 1, got {text!r}")


def read_settings(prefix: str) -> JitSettings:
    """Read and validate ``<prefix>_JIT_*`` from the environment."""
    check_prefix(prefix)
    env = os.environ
    var = f"{prefix}_JIT_CACHE_DIR"
    if var in env and not env[var].strip():
        raise JitConfigError(f"{var} is set but empty; unset it or give a directory")
    return JitSettings(
        prefix=prefix,
        cache_dir=jit_cache_dir(prefix),
        print_command=parse_bool(
            f"{prefix}_JIT_PRINT_COMPILER_COMMAND", env.get(f"{prefix}_JIT_PRINT_COMPILER_COMMAND", "")
        ),
        extra_defines=parse_extra_flags(
            f"{prefix}_JIT_EXTRA_FLAGS", env.get(f"{prefix}_JIT_EXTRA_FLAGS", "")
        ),
    )


def define_flags(defines: Any, extra: tuple[tuple[str, int], ...] = ()) -> list[str]:
    """``-DNAME=VALUE`` flags for ``defines`` (a mapping), then the environment's extra defines.

    Values may be ``int``, ``bool`` (→ 1/0) or a plain token string. An extra define from the
    environment that names a macro already in ``defines`` replaces it (so users can override a
    caller's default without a redefinition warning); its flag is still emitted after the others.
    """
    if defines is None:
        defines = {}
    if not isinstance(defines, Mapping):
        raise TypeError(f"build: defines must be a mapping NAME -> value, got {type(defines).__name__}")
    merged: dict[str, str] = {}
    for name, value in defines.items():
        if not isinstance(name, str) or not _MACRO_RE.fullmatch(name):
            raise JitConfigError(f"build: defines key {name!r} is not a C macro name")
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, int):
            text = str(value)
        elif isinstance(value, str) and _TOKEN_RE.fullmatch(value):
            text = value
        else:
            raise JitConfigError(
                f"build: defines[{name!r}] must be an int, a bool or a plain token string, got {value!r}"
            )
        merged[name] = text
    flags = [f"-D{n}={v}" for n, v in merged.items() if n not in dict(extra)]
    flags += [f"-D{n}={v}" for n, v in extra]
    return flags
