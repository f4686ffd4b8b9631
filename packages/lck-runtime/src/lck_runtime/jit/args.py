"""Typed kernel arguments.

A CUDA kernel receives its parameters as raw bytes whose layout comes from the C signature; Python
cannot know it. Every scalar is therefore wrapped in its C type (``I32(7)``, ``U64(mask)``,
``F32(0.5)``), raw device addresses in ``Ptr(addr)``; torch CUDA tensors pass their ``data_ptr()``.
Plain ``int``/``float`` are refused: an int32/int64 mix-up silently shifts every later parameter.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, ClassVar

# Kind codes shared with host_module.cpp (enum ArgKind); keep both in sync.
KIND_I32 = 0
KIND_I64 = 1
KIND_U64 = 2
KIND_F32 = 3
KIND_PTR = 4

_F32_MAX = 3.4028234663852886e38


def _as_int(value: Any, type_name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{type_name}(): expected an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{type_name}(): expected an integer, got {type(value).__name__} {value!r}") from None


class _Arg:
    __slots__ = ("value",)
    kind: ClassVar[int]
    lo: ClassVar[int] = 0
    hi: ClassVar[int] = 0

    def __init__(self, value: Any):
        name = type(self).__name__
        v = _as_int(value, name)
        if not self.lo <= v <= self.hi:
            raise ValueError(f"{name}(): {v} is outside [{self.lo}, {self.hi}]")
        self.value = v

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.value))


class I32(_Arg):
    """A C ``int32_t`` parameter."""

    __slots__ = ()
    kind = KIND_I32
    lo, hi = -(2**31), 2**31 - 1


class I64(_Arg):
    """A C ``int64_t`` parameter."""

    __slots__ = ()
    kind = KIND_I64
    lo, hi = -(2**63), 2**63 - 1


class U64(_Arg):
    """A C ``uint64_t`` parameter."""

    __slots__ = ()
    kind = KIND_U64
    lo, hi = 0, 2**64 - 1


class Ptr(_Arg):
    """A raw device address (any ``T*`` parameter), e.g. a peer's symmetric buffer."""

    __slots__ = ()
    kind = KIND_PTR
    lo, hi = 0, 2**64 - 1


class F32(_Arg):
    """A C ``float`` parameter (the value is rounded to float32 at launch)."""

    __slots__ = ()
    kind = KIND_F32

    def __init__(self, value: Any):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"F32(): expected a real number, got {type(value).__name__} {value!r}")
        v = float(value)
        if math.isfinite(v) and abs(v) > _F32_MAX:
            raise ValueError(f"F32(): {v!r} overflows float32 (max {_F32_MAX!r})")
        self.value = v


def pack_args(args: Any, device_index: int, where: str = "launch") -> tuple[list[int], list[int | float]]:
    """Validate ``args`` and split them into (kind codes, values) for the host module.

    Tensors must be CUDA tensors on ``cuda:<device_index>``; anything that is not a typed argument or
    a tensor raises ``TypeError`` naming its position.
    """
    if isinstance(args, (str, bytes)) or not hasattr(args, "__iter__"):
        raise TypeError(f"{where}: args must be a list or tuple of arguments, got {type(args).__name__}")
    kinds: list[int] = []
    values: list[int | float] = []
    for i, a in enumerate(args):
        if isinstance(a, _Arg):
            kinds.append(a.kind)
            values.append(a.value)
            continue
        if isinstance(a, bool) or isinstance(a, (int, float)):
            raise TypeError(
                f"{where}: args[{i}] is a plain {type(a).__name__} ({a!r}); wrap it as I32(...), I64(...), "
                "U64(...), F32(...) or Ptr(...) so its C type is explicit"
            )
        import torch  # local: importing the JIT (and compiling) must not need torch

        if isinstance(a, torch.Tensor):
            if a.device.type != "cuda" or a.device.index != device_index:
                raise ValueError(
                    f"{where}: args[{i}] is a tensor on {a.device}, expected a CUDA tensor on cuda:{device_index} "
                    "(the current device)"
                )
            kinds.append(KIND_PTR)
            values.append(a.data_ptr())
            continue
        raise TypeError(
            f"{where}: args[{i}] has unsupported type {type(a).__name__}; expected a torch CUDA tensor or "
            "I32/I64/U64/F32/Ptr"
        )
    return kinds, values
