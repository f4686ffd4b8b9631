"""Configuration records for :func:`lck_runtime.configure`: plain frozen dataclasses, standard library only.

Importing this module and constructing its records needs nothing but Python: a framework can build
them (and ship them in its own configs) without importing torch, NVSHMEM or any lck layer. Each record
validates its own fields on construction (``TypeError`` for a wrong type, ``ValueError`` for a wrong
value, both naming the field); everything that depends on the process groups (sizes, topology,
agreement between ranks) is validated collectively by ``configure``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["FusedLinearCrossEntropyConfig", "MoEConfig"]

# The FLSCE scratch holds at least 8 fp32 values per token: the per-token statistics of the
# vocab-parallel reductions (max, sum-exp, target logit, entropy terms) are reduced through the same
# scratch as the [tokens, hidden] gradient, so tiny hidden sizes still get room for them.
MIN_FLSCE_ROW = 8


def _check_int(owner: str, name: str, value: Any, *, minimum: int) -> None:
    # bool is an int subclass: `max_tokens=True` is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _check_group(owner: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(
            f"{owner}.group must be None (the bootstrap group) or the name of a group passed in "
            f"configure(process_groups=...), got {type(value).__name__} {value!r}"
        )
    if not value:
        raise ValueError(f"{owner}.group must be a non-empty name or None, got ''")


def _check_counts(record: Any, *names: str) -> None:
    """Each named field of the config ``record`` is an int >= 1 (checked in the order given)."""
    for name in names:
        _check_int(type(record).__name__, name, getattr(record, name), minimum=1)


@dataclass(frozen=True)
class FusedLinearCrossEntropyConfig:
    """Capacities of the vocab-parallel (fused linear) cross entropy over one TP group.

    - ``max_tokens``: most tokens one call reduces (after any chunking by the caller).
    - ``hidden_size``: the largest hidden size of ``x`` / the weight shard.
    - ``local_vocab_size``: the largest vocab shard held by one rank.
    - ``group``: a name from ``configure(process_groups=...)``; ``None`` selects the bootstrap group.

    The shared reduction scratch holds ``capacity = max_tokens * max(hidden_size, 8)`` fp32 values.
    """

    max_tokens: int
    hidden_size: int
    local_vocab_size: int
    group: str | None = None

    def __post_init__(self) -> None:
        _check_counts(self, "max_tokens", "hidden_size", "local_vocab_size")
        _check_group(type(self).__name__, self.group)

    @property
    def capacity(self) -> int:
        """fp32 elements one ``all_reduce_`` may carry: ``max_tokens * max(hidden_size, 8)``."""
        return self.max_tokens * max(self.hidden_size, MIN_FLSCE_ROW)

    def fields(self) -> dict[str, Any]:
        """The record as a plain dict (what ranks compare when they agree on a request)."""
        return asdict(self)


@dataclass(frozen=True)
class MoEConfig:
    """Capacities and topology of expert-parallel MoE over one EP group.

    - ``max_tokens``: most tokens one rank dispatches in one forward.
    - ``hidden_size``: hidden size of the dispatched activations.
    - ``num_experts``: experts over the whole EP group (divisible by the group size).
    - ``top_k``: experts per token, ``1 <= top_k <= num_experts``.
    - ``num_hosts`` × ``gpus_per_host``: how the group's ordered members split into hosts (consecutive
      blocks of ``gpus_per_host``); ``gpus_per_host=None`` means ``group size // num_hosts``. Hosts
      may be virtual (one machine split in two to exercise the scale-out path), but one host never
      spans machines.
    - ``max_inflight``: retained forwards (all layers and microbatches awaiting backward) one EP
      context holds at once.
    - ``group``: a name from ``configure(process_groups=...)``; ``None`` selects the bootstrap group.
    """

    max_tokens: int
    hidden_size: int
    num_experts: int
    top_k: int
    num_hosts: int = 1
    gpus_per_host: int | None = None
    max_inflight: int = 1
    group: str | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_counts(self, "max_tokens", "hidden_size", "num_experts", "top_k")
        if self.top_k > self.num_experts:
            raise ValueError(f"{owner}.top_k must be <= num_experts ({self.num_experts}), got {self.top_k}")
        _check_counts(self, "num_hosts")
        if self.gpus_per_host is not None:
            _check_counts(self, "gpus_per_host")
        _check_counts(self, "max_inflight")
        _check_group(owner, self.group)

    def fields(self) -> dict[str, Any]:
        """The record as a plain dict (what ranks compare when they agree on a request)."""
        return asdict(self)
