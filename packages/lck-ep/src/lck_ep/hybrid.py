"""The hybrid (scale-out) native backend: two-level routing across (virtual) hosts.

A MoE context configured with ``MoEConfig(num_hosts > 1, gpus_per_host)`` splits its group's ordered
members into hosts of ``g = gpus_per_host`` consecutive ranks. Its native Buffers run :class:`HybridEp`: the
native scale-up backend (:mod:`lck_ep.native`) with the two sending kernels replaced by the hybrid pair
(``csrc/hybrid_common.cuh``): a token crosses to each other host once, as a sub-part put with an in-band
header to the rank of that host with its source's local index, which forwards it to its final ranks;
combine returns partials the same way in reverse. Rows land exactly where the native sender puts them, so
the receive, expanded-layout and reduction kernels are the native ones and every output is bit for bit the
reference backend's (same receive order, the same float32 rank-order sum).

On one machine the hosts are virtual (``lck_runtime`` accepts any split of one machine's PEs), and traffic
between them really goes through the scale-out protocol: staging areas, sub-part puts, counting signals or
tails, forwarding. Only the transport under a put differs from real hosts (see the README).

Options (read when a Buffer is built; runtime arguments, no recompilation), beside the ``EP_*`` JIT knobs of
:mod:`lck_ep.knobs` (``EP_HYBRID_KERNEL``, ``EP_NUM_SUB_PARTS``, ``EP_MIN_SUB_TOKENS``,
``EP_SM100_MIN_SUB_TOKENS``):

==============================  ==============================  ========================================
variable                        default                         meaning
==============================  ==============================  ========================================
``EP_HYBRID_CHANNELS``          8                               scale-out channels (blocks of the pair)
``EP_HYBRID_NUM_PARTS``         ``min(4, budget // channels)``  parts per channel (unordered: one
                                                                counting signal each)
``EP_HYBRID_DEBUG_REORDER``     0                               1: the put warp holds sub-parts back and
                                                                issues them newest first (unordered)
``EP_HYBRID_DEBUG_DELAY_US``    0                               microseconds before every put
==============================  ==============================  ========================================

The channel and signal budget is checked before anything is built or launched (:func:`plan_hybrid`):
a value beyond a limit raises :class:`HybridBudgetError` naming the limit and by how much it is exceeded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lck_ep.knobs import INT_KNOBS, EpKnobs, KnobError, read_knobs
from lck_runtime.symmetric import (
    HYBRID_MAX_CHANNELS,
    HYBRID_MAX_SUB_PARTS,
    HYBRID_SIGNAL_WORDS,
    moe_hybrid_area_bytes,
)

__all__ = [
    "DEFAULT_CHANNELS",
    "MAX_GPUS_PER_HOST",
    "SIGNAL_BUDGET",
    "HybridBudgetError",
    "HybridOptions",
    "HybridPlan",
    "channel_range",
    "channel_sub_parts",
    "compile_hybrid_kernels",
    "forwarder",
    "header_bytes",
    "host_blocks",
    "hybrid_problem",
    "part_begin",
    "plan_hybrid",
    "read_hybrid_options",
    "stopped_member",
    "sub_begin",
    "sub_count",
]

SIGNAL_BUDGET = HYBRID_SIGNAL_WORDS  # hybrid signal words per peer slot (kWords in hybrid_common.cuh)
DEFAULT_CHANNELS = 8
DEFAULT_MAX_PARTS = 4
MAX_GPUS_PER_HOST = 32  # one lane per rank of a host in the forwarding warp
MAX_CAP = (1 << 20) - 1  # a header's row count field
_KNOB_DEFAULTS = {k.name: k.default for k in INT_KNOBS}


class HybridBudgetError(ValueError):
    """A hybrid option asks for more channels, parts or signal words than the context provides."""


@dataclass(frozen=True)
class HybridOptions:
    """The hybrid options of the environment; ``None``: derived (see the module table)."""

    channels: int | None = None
    parts: int | None = None
    debug_reorder: bool = False
    debug_delay_us: int = 0


def _int_option(env: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise KnobError(
            f"environment: {name}={env.get(name)!r} is not an integer; expected an integer in [{low}, {high}]"
        ) from None
    if not low <= value <= high:
        raise KnobError(
            f"environment: {name}={value} is out of range; expected an integer in [{low}, {high}]"
        )
    return value


def read_hybrid_options(environ: Mapping[str, str] | None = None) -> HybridOptions:
    """The ``EP_HYBRID_*`` options of ``environ`` (default ``os.environ``), validated (``KnobError``)."""
    env = os.environ if environ is None else environ
    reorder = _int_option(env, "EP_HYBRID_DEBUG_REORDER", 0, 1)
    return HybridOptions(
        channels=_int_option(env, "EP_HYBRID_CHANNELS", 1, 1024),
        parts=_int_option(env, "EP_HYBRID_NUM_PARTS", 1, 1024),
        debug_reorder=bool(reorder),
        debug_delay_us=_int_option(env, "EP_HYBRID_DEBUG_DELAY_US", 0, 1_000_000) or 0,
    )


# ------------------------------------------------------------------------------------- virtual hosts


def host_blocks(num_ranks: int, num_hosts: int, gpus_per_host: int) -> list[tuple[int, ...]]:
    """The group ranks of each (virtual) host: consecutive blocks of ``gpus_per_host``."""
    if num_hosts * gpus_per_host != num_ranks:
        raise ValueError(
            f"host_blocks: num_hosts={num_hosts} x gpus_per_host={gpus_per_host} != {num_ranks} ranks"
        )
    return [tuple(range(h * gpus_per_host, (h + 1) * gpus_per_host)) for h in range(num_hosts)]


def forwarder(src: int, host: int, gpus_per_host: int) -> int:
    """The rank of ``host`` that receives ``src``'s scale-out rows and forwards them: same local index."""
    return host * gpus_per_host + src % gpus_per_host


def stopped_member(arrived: Sequence[bool], me: int, gpus_per_host: int, waited_for: int) -> int:
    """The member to name when this rank's wait for dispatch rows (the native receiver's) timed out.

    ``arrived[s]``: whether source ``s``'s row count for this operation reached this rank; ``waited_for``:
    the source the timed-out wait recorded (the receiver waits for every source at once, so with several
    missing it is any of them). A source on this host publishes its own count; one on another host reaches
    this rank only through its forwarder here, so its count is missing too when that forwarder stopped. A
    missing source whose forwarder's own count did arrive is the one that stopped; one whose forwarder's is
    missing as well is explained by the forwarder. ``waited_for`` when it is among those suspects, else
    the lowest.
    """
    host = me // gpus_per_host
    suspects = [
        s
        for s, ok in enumerate(arrived)
        if not ok and (s // gpus_per_host == host or arrived[forwarder(s, host, gpus_per_host)])
    ]
    if not suspects or waited_for in suspects:
        return waited_for
    return suspects[0]


# ------------------------------------------------------------- geometry (mirror of hybrid_common.cuh)


def channel_range(n: int, c: int, channels: int) -> tuple[int, int]:
    """Stream positions ``[lo, hi)`` of channel ``c`` of a host stream of ``n`` rows."""
    return n * c // channels, n * (c + 1) // channels


def parts_used(q_cap: int, parts: int) -> int:
    return min(q_cap, parts)


def part_begin(q_cap: int, parts: int, j: int) -> int:
    """First template row of part ``j`` of a channel of capacity ``q_cap`` in ``parts`` parts (the first
    part about half the others, every part at least one row when ``parts <= q_cap``)."""
    if j <= 0:
        return 0
    if j >= parts:
        return q_cap
    return j + (q_cap - parts) * (2 * j - 1) // (2 * parts - 1)


def sub_count(q: int, num_sub_parts: int, min_sub_tokens: int) -> int:
    """Sub-parts of a part of ``q`` template rows: at most ``num_sub_parts``, each of at least
    ``min_sub_tokens`` rows (one when the part is smaller)."""
    return max(1, min(num_sub_parts, q // min_sub_tokens))


def sub_begin(q: int, n: int, k: int) -> int:
    return q * k // n


def header_bytes(gpus_per_host: int) -> int:
    """A sub-part header: 16 bytes of words, then one int32 first send slot per rank of the host."""
    return 16 + (4 * gpus_per_host + 15) // 16 * 16


def channel_bytes(q_cap: int, parts: int, num_sub_parts: int, row: int, hb: int) -> int:
    return q_cap * row + parts * num_sub_parts * hb


@dataclass(frozen=True)
class SubPart:
    part: int
    index: int
    first: int  # template row (channel-relative) of its first row
    rows: int
    more: bool  # rows of the channel follow this sub-part's part
    offset: int  # byte offset of its header inside the channel


def channel_sub_parts(
    m: int, q_cap: int, parts: int, num_sub_parts: int, min_sub_tokens: int, row: int, hb: int
) -> list[SubPart]:
    """The sub-parts a channel of ``m`` rows sends, in send order (what the device computes)."""
    if not 0 <= m <= q_cap:
        raise ValueError(f"channel_sub_parts: m={m} rows do not fit a channel of capacity {q_cap}")
    p = parts_used(q_cap, parts)
    out = []
    for j in range(p):
        pb, pe = part_begin(q_cap, p, j), part_begin(q_cap, p, j + 1)
        if j > 0 and m <= pb:
            break
        n = sub_count(pe - pb, num_sub_parts, min_sub_tokens)
        for k in range(n):
            u, v = pb + sub_begin(pe - pb, n, k), pb + sub_begin(pe - pb, n, k + 1)
            if m > 0 and u >= m:
                break
            if m == 0 and (j > 0 or k > 0):
                break
            offset = u * row + (j * num_sub_parts + k) * hb
            out.append(SubPart(j, k, u, max(0, min(m, v) - u), m > pe, offset))
    return out


# ----------------------------------------------------------------------------------- plan and budget


@dataclass(frozen=True)
class HybridPlan:
    """The scale-out geometry of one Buffer: what the kernels are launched with."""

    num_hosts: int
    gpus_per_host: int
    channels: int
    parts: int
    q_cap: int  # channel capacity in rows: ceil(cap / channels)
    header_bytes: int
    area_bytes: int  # one hybrid area (lck_runtime.symmetric.moe_hybrid_area_bytes)
    ordered: bool

    @property
    def signal_words(self) -> int:
        """Hybrid signal words per peer slot this plan uses (dispatch; combine uses ``channels``)."""
        return self.channels if self.ordered else self.channels * self.parts


def _over(what: str, need: int, limit: int, fix: str) -> HybridBudgetError:
    return HybridBudgetError(
        f"hybrid: {what} needs {need} but the limit is {limit} (over by {need - limit}); {fix}"
    )


def plan_hybrid(
    *,
    config: Any,
    num_ranks: int,
    num_sms: int | None,
    knobs: EpKnobs | None = None,
    options: HybridOptions | None = None,
) -> HybridPlan:
    """Resolve and validate the scale-out geometry for a context's ``MoEConfig`` (``num_sms`` is accepted for
    symmetry with the native kernels; the channel count does not depend on it).

    Raises :class:`HybridBudgetError` (a ``ValueError``) naming the limit a value exceeds and by how much:
    channels beyond the hybrid area's ``HYBRID_MAX_CHANNELS``, channels x parts beyond the signal words of a
    peer slot, more hosts than relay flags, a host wider than the forwarding warp, host experts beyond int16.
    Pure (no torch, no CUDA): the same result on every rank.
    """
    knobs = read_knobs() if knobs is None else knobs
    options = read_hybrid_options() if options is None else options
    num_hosts = config.num_hosts
    g = config.gpus_per_host if config.gpus_per_host is not None else num_ranks // num_hosts
    if num_hosts < 2:
        raise ValueError(
            f"plan_hybrid: the context has num_hosts={num_hosts}; the hybrid path needs 2 or more"
        )
    if num_hosts * g != num_ranks:
        raise ValueError(f"plan_hybrid: num_hosts={num_hosts} x gpus_per_host={g} != {num_ranks} ranks")
    ordered = knobs.hybrid_kernel == "ordered"
    if g > MAX_GPUS_PER_HOST:
        raise _over(
            "gpus_per_host (one forwarding lane per rank of a host)",
            g,
            MAX_GPUS_PER_HOST,
            "use fewer ranks per host",
        )
    if num_hosts - 1 > SIGNAL_BUDGET:
        raise _over(
            f"num_hosts={num_hosts} (one relay flag per other host in a peer slot)",
            num_hosts - 1,
            SIGNAL_BUDGET,
            "use fewer, larger hosts",
        )
    experts_per_host = g * (config.num_experts // num_ranks)
    if experts_per_host > 32767:
        raise _over(
            "experts per host (int16 routing words)", experts_per_host, 32767, "use fewer experts per host"
        )
    if config.max_tokens > MAX_CAP:
        raise _over(
            "MoEConfig.max_tokens (a header's row field)", config.max_tokens, MAX_CAP, "use fewer tokens"
        )
    # Not derived from num_sms: the channel count must be the same on every rank (a Buffer's num_sms is not
    # agreed across ranks), and EP_HYBRID_CHANNELS, like every EP_* variable, must be set alike everywhere.
    channels = DEFAULT_CHANNELS if options.channels is None else options.channels
    if channels > HYBRID_MAX_CHANNELS:
        raise _over(
            f"EP_HYBRID_CHANNELS={channels} (channels the hybrid area is sized for)",
            channels,
            HYBRID_MAX_CHANNELS,
            f"set EP_HYBRID_CHANNELS to at most {HYBRID_MAX_CHANNELS}",
        )
    if channels > SIGNAL_BUDGET:
        raise _over(
            f"{channels} channels (one signal word each per peer slot)",
            channels,
            SIGNAL_BUDGET,
            f"set EP_HYBRID_CHANNELS to at most {SIGNAL_BUDGET}",
        )
    parts = options.parts
    if parts is None:
        parts = max(1, min(DEFAULT_MAX_PARTS, SIGNAL_BUDGET // channels))
    if not ordered and channels * parts > SIGNAL_BUDGET:
        raise _over(
            f"EP_HYBRID_CHANNELS={channels} x EP_HYBRID_NUM_PARTS={parts} counting signals per peer slot "
            f"(SIGNAL_WORDS_PER_PEER minus the scale-up protocol's 3)",
            channels * parts,
            SIGNAL_BUDGET,
            f"use at most {SIGNAL_BUDGET // channels} parts with {channels} channels, or fewer channels",
        )
    if parts > SIGNAL_BUDGET:
        raise _over(f"EP_HYBRID_NUM_PARTS={parts}", parts, SIGNAL_BUDGET, "use fewer parts")
    cap = config.max_tokens
    q_cap = -(-cap // channels)
    hb = header_bytes(g)
    row = (config.hidden_size * 2 + config.top_k * 12 + 15) // 16 * 16
    area = moe_hybrid_area_bytes(config, num_ranks)
    subs = knobs.value("EP_NUM_SUB_PARTS")
    need = channels * channel_bytes(q_cap, parts, subs, row, hb)
    if need > area:  # unreachable within the limits above (the area is sized for them); kept as a guard
        raise _over("the staging of one host stream (bytes)", need, area, "use fewer channels or parts")
    assert subs <= HYBRID_MAX_SUB_PARTS
    return HybridPlan(num_hosts, g, channels, parts, q_cap, hb, area, ordered)


def hybrid_problem(*, num_ranks: int, num_topk: int, config: Any, one_machine: bool) -> str | None:
    """Why the hybrid kernels cannot serve this group at all (limits no option changes), or None.
    ``one_machine``: whether the group's members all run on one machine (``MoEContext.one_machine``)."""
    if not one_machine:
        return (
            f"the MoE context's {config.num_hosts} hosts are separate machines: the hybrid kernels reach other "
            "hosts through peer mappings, which exist only within one machine (virtual hosts), and their "
            "cross-machine transport (NVSHMEM remote puts) is not built yet"
        )
    g = config.gpus_per_host if config.gpus_per_host is not None else num_ranks // config.num_hosts
    if g > MAX_GPUS_PER_HOST:
        return f"the hybrid kernels handle hosts of at most {MAX_GPUS_PER_HOST} ranks, this one has {g}"
    if config.num_hosts - 1 > SIGNAL_BUDGET:
        return (
            f"the hybrid kernels handle at most {SIGNAL_BUDGET + 1} hosts, this group has {config.num_hosts}"
        )
    return None


# ----------------------------------------------------------------------------------- JIT and state

_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], dict[str, Any]] = {}


def compile_hybrid_kernels(arch: str, knobs: EpKnobs | None = None) -> dict[str, str]:
    """Compile the pair ``knobs`` selects for ``arch`` without a GPU; ``{kernel name: cubin path}``."""
    from lck_ep.hybrid_codegen import hybrid_spec
    from lck_runtime.jit import Jit

    knobs = read_knobs() if knobs is None else knobs
    jit = Jit(prefix="EP")
    out = {}
    for role in ("dispatch", "combine"):
        spec = hybrid_spec(role, knobs)
        out[spec.name] = str(jit.compile_only(**spec.build_kwargs(), arch=arch))
    return out


def build_hybrid_kernels(device_index: int, knobs: EpKnobs) -> dict[str, Any]:
    """Build (or fetch) and load the selected pair onto ``device_index``: ``{"dispatch": k, "combine": k}``."""
    from lck_ep.hybrid_codegen import hybrid_spec
    from lck_ep.native import load_kernels

    def build(jit: Any) -> dict[str, Any]:
        return {
            role: jit.build(**hybrid_spec(role, knobs).build_kwargs()) for role in ("dispatch", "combine")
        }

    return load_kernels(_LOCK, _KERNELS, knobs, device_index, build)
