"""The ``EP_*`` environment knobs that shape generated EP kernels: parsing, validation, ``-D`` mapping.

Knobs (read from the environment when a kernel is generated, never at import):

============================  =========  ===================  ==============================================
variable                      default    accepted values      meaning
============================  =========  ===================  ==============================================
``EP_NUM_SUB_PARTS``          2          integer 1..16        sub-parts per part of a scale-out channel
                                                              (each sub-part is one batched put)
``EP_MIN_SUB_TOKENS``         1          integer 1..65536     fewest tokens a sub-part carries (SM90)
``EP_SM100_MIN_SUB_TOKENS``   15         integer 1..65536     the same floor on SM100 (Blackwell)
``EP_NUM_TOPK_IDX_BITS``      64         8, 16, 32 or 64      width of the signed integer that holds a top-k
                                                              expert index on the device; ``num_experts``
                                                              must be at most ``2**(bits-1)``
``EP_HYBRID_KERNEL``          unordered  unordered, ordered   which scale-out kernel pair is generated
============================  =========  ===================  ==============================================

The four integer knobs reach the compiler only as ``-DNAME=VALUE`` and only when set: with none set, the
generated source and the flag list are byte-identical to a build that never heard of them (the headers
carry the defaults under ``#ifndef``). An empty value counts as unset. ``EP_HYBRID_KERNEL`` is not a
``-D``: it chooses, at generation time, which variant's source is generated, so the generated text (and
with it the JIT cache key) differs between ``unordered`` and ``ordered``; ``unordered`` and unset generate
the same text. Because the JIT's cache key covers the source and the full flag list, changing any knob
re-JITs instead of serving an artifact built with another geometry.

Every value is validated here, before anything is compiled; a bad value raises :class:`KnobError` (a
``ValueError``) naming the variable, the value and the accepted range. ``EP_JIT_EXTRA_FLAGS`` may also
carry ``-DEP_...=N`` items for these names (the JIT appends them after our defines); those values are
validated with the same ranges, and one that contradicts the dedicated variable is an error rather than
a silent "last flag wins".

This module imports only the standard library.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "HYBRID_KERNELS",
    "INT_KNOBS",
    "EpKnobs",
    "IntKnob",
    "KnobError",
    "current_knobs",
    "read_knobs",
]


class KnobError(ValueError):
    """An ``EP_*`` knob holds a value outside its documented range."""


@dataclass(frozen=True)
class IntKnob:
    """An integer knob forwarded as ``-D<name>=<value>`` when set."""

    name: str
    field: str
    default: int
    allowed: tuple[int, ...] | None = None  # a finite set, else the closed range [low, high]
    low: int = 1
    high: int = 65536

    def describe(self) -> str:
        if self.allowed is not None:
            return "one of " + ", ".join(str(v) for v in self.allowed)
        return f"an integer in [{self.low}, {self.high}]"

    def parse(self, raw: str, *, source: str) -> int:
        text = raw.strip()
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise KnobError(f"{source}: {self.name}={raw!r} is not an integer; expected {self.describe()}")
        value = int(text)
        ok = value in self.allowed if self.allowed is not None else self.low <= value <= self.high
        if not ok:
            raise KnobError(f"{source}: {self.name}={value} is out of range; expected {self.describe()}")
        return value


INT_KNOBS: tuple[IntKnob, ...] = (
    IntKnob("EP_NUM_SUB_PARTS", "num_sub_parts", default=2, low=1, high=16),
    IntKnob("EP_MIN_SUB_TOKENS", "min_sub_tokens", default=1, low=1, high=65536),
    IntKnob("EP_SM100_MIN_SUB_TOKENS", "sm100_min_sub_tokens", default=15, low=1, high=65536),
    IntKnob("EP_NUM_TOPK_IDX_BITS", "num_topk_idx_bits", default=64, allowed=(8, 16, 32, 64)),
)
_BY_NAME = {k.name: k for k in INT_KNOBS}
HYBRID_KERNELS = ("unordered", "ordered")
_DEFINE = re.compile(r"-D([A-Za-z_][A-Za-z0-9_]*)=(.*)")


@dataclass(frozen=True)
class EpKnobs:
    """Validated knob values; ``None`` means unset (the header default applies)."""

    num_sub_parts: int | None = None
    min_sub_tokens: int | None = None
    sm100_min_sub_tokens: int | None = None
    num_topk_idx_bits: int | None = None
    hybrid_kernel: str = "unordered"
    # Knobs whose value comes from ``-D`` items of EP_JIT_EXTRA_FLAGS: the JIT appends those flags itself,
    # so :meth:`defines` leaves them out (no duplicate -D) while :meth:`value` still reports them.
    from_extra_flags: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for knob in INT_KNOBS:
            value = getattr(self, knob.field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise KnobError(f"EpKnobs: {knob.field} must be an int or None, got {value!r}")
            knob.parse(str(value), source="EpKnobs")
        if self.hybrid_kernel not in HYBRID_KERNELS:
            raise KnobError(
                f"EpKnobs: hybrid_kernel must be one of {', '.join(HYBRID_KERNELS)}, got {self.hybrid_kernel!r}"
            )

    def defines(self) -> dict[str, int]:
        """``{NAME: value}`` for the set integer knobs only, in a fixed order (the order of the table)."""
        return {
            k.name: getattr(self, k.field)
            for k in INT_KNOBS
            if getattr(self, k.field) is not None and k.name not in self.from_extra_flags
        }

    def value(self, name: str) -> int:
        """The effective value of an integer knob: the set value, else the header default."""
        knob = _BY_NAME[name]
        v = getattr(self, knob.field)
        return knob.default if v is None else v

    @property
    def topk_idx_bits(self) -> int:
        return self.value("EP_NUM_TOPK_IDX_BITS")

    def check_problem(self, *, num_experts: int, num_topk: int) -> None:
        """Reject knob values that cannot serve this routing problem (before anything is compiled)."""
        bits = self.topk_idx_bits
        if num_experts > 2 ** (bits - 1):
            raise KnobError(
                f"EP_NUM_TOPK_IDX_BITS={bits} holds expert indices up to {2 ** (bits - 1) - 1}, "
                f"but num_experts={num_experts}; use a width of at least "
                f"{min(b for b in (8, 16, 32, 64) if num_experts <= 2 ** (b - 1))} bits"
            )
        if num_topk < 1:
            raise KnobError(f"num_topk must be >= 1, got {num_topk}")


def _extra_flag_defines(raw: str) -> dict[str, str]:
    """The ``-DEP_<knob>=...`` items of ``EP_JIT_EXTRA_FLAGS`` (other items are the JIT's to validate)."""
    found: dict[str, str] = {}
    for item in raw.split():
        m = _DEFINE.fullmatch(item)
        if m and m.group(1) in _BY_NAME:
            name, value = m.group(1), m.group(2)
            if name in found and found[name] != value:
                raise KnobError(
                    f"EP_JIT_EXTRA_FLAGS: {name} is defined twice with different values "
                    f"({found[name]!r} and {value!r})"
                )
            found[name] = value
    return found


def read_knobs(environ: Mapping[str, str] | None = None) -> EpKnobs:
    """Read and validate the knobs from ``environ`` (default ``os.environ``).

    Raises :class:`KnobError` naming the variable for a non-integer or out-of-range value, an unknown
    ``EP_HYBRID_KERNEL``, or a ``-DEP_...`` item in ``EP_JIT_EXTRA_FLAGS`` that is out of range or
    contradicts the dedicated variable.
    """
    env = os.environ if environ is None else environ
    values: dict[str, int | None] = {}
    only_in_flags: set[str] = set()
    extra = _extra_flag_defines(env.get("EP_JIT_EXTRA_FLAGS", ""))
    for knob in INT_KNOBS:
        raw = env.get(knob.name, "")
        value = knob.parse(raw, source="environment") if raw.strip() else None
        if knob.name in extra:
            from_flags = knob.parse(extra[knob.name], source="EP_JIT_EXTRA_FLAGS")
            if value is not None and from_flags != value:
                raise KnobError(
                    f"{knob.name}={value} contradicts -D{knob.name}={from_flags} in EP_JIT_EXTRA_FLAGS; "
                    "set one of them"
                )
            if value is None:
                value = from_flags
                only_in_flags.add(knob.name)
        values[knob.field] = value
    hybrid = env.get("EP_HYBRID_KERNEL", "").strip()
    if hybrid and hybrid not in HYBRID_KERNELS:
        raise KnobError(
            f"environment: EP_HYBRID_KERNEL={env.get('EP_HYBRID_KERNEL')!r} is not a kernel variant; "
            f"expected one of {', '.join(HYBRID_KERNELS)}"
        )
    return EpKnobs(
        hybrid_kernel=hybrid or "unordered",
        from_extra_flags=frozenset(only_in_flags),
        **values,  # type: ignore[arg-type]
    )


_SEEN: dict[tuple[str | None, ...], EpKnobs] = {}


def current_knobs() -> EpKnobs:
    """:func:`read_knobs` of ``os.environ``, parsed once per distinct value of the ``EP_*`` variables (a
    dispatch looks them up on every call); a bad value raises on every call, as read_knobs does."""
    key = tuple(os.environ.get(n) for n in _KNOB_VARIABLES)
    knobs = _SEEN.get(key)
    if knobs is None:
        knobs = read_knobs()
        _SEEN[key] = knobs
    return knobs


_KNOB_VARIABLES = ("EP_JIT_EXTRA_FLAGS", "EP_HYBRID_KERNEL", *(k.name for k in INT_KNOBS))
