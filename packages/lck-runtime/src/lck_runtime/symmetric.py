"""Symmetric reservations: the shared FLSCE scratch and the per-context MoE state, in one pool.

NVSHMEM allocation is collective over all PEs and symmetric: the k-th allocation lands at the same
heap offset on every PE, which is what makes a peer's copy addressable. So every rank of the
bootstrap domain makes the same sequence of reservations (labels and sizes), in an order derived
from the agreed request alone, never from rank-local state. A rank reserves the state of *its own*
group in each partition; the groups of a partition have equal sizes, so the sequence is the same
everywhere.

- The FLSCE scratch is shared by every FLSCE context and sized at the process-wide maximum capacity
  (the first ``FusedLinearCrossEntropyConfig``); later, equal or smaller requests reuse it.
- Each MoE context owns its workspace and signals, so one EP group's reservations never move
  another's pointers (captured CUDA graphs keep working).

On the torch.distributed path the same reservations are recorded without memory (``tensor is None``),
so ordering, reuse and growth rules are identical and testable on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lck_runtime.config import MoEConfig

__all__ = [
    "AGREEMENT_HEADER_WORDS",
    "HYBRID_MAX_CHANNELS",
    "HYBRID_MAX_SUB_PARTS",
    "HYBRID_SIGNAL_WORDS",
    "SCRATCH_ALIGN",
    "SIGNAL_WORDS_PER_PEER",
    "Reservation",
    "SymmetricPool",
    "moe_agreement_bytes",
    "moe_agreement_offset",
    "moe_agreement_slot_words",
    "moe_hybrid_area_bytes",
    "moe_workspace_bytes",
    "scratch_numel",
]

# Scratch length is a multiple of 128 fp32 so that its two halves (source and destination of a team
# reduction) both start 256-byte aligned, which NVSHMEM's vectorised reduction paths need.
SCRATCH_ALIGN = 128
SCRATCH_LABEL = "flsce.scratch"  # the one FLSCE scratch, shared by every FLSCE context
# int64 signal words per member of a MoE group: per-peer counters for dispatch/combine barriers.
SIGNAL_WORDS_PER_PEER = 32
_DTYPE_BYTES = {"float32": 4, "int64": 8, "uint8": 1}


def scratch_numel(capacity: int) -> int:
    """fp32 elements of the shared FLSCE scratch for a capacity (in fp32 elements)."""
    return (capacity + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN


# The hybrid (scale-out) area of a workspace whose group spans several hosts (lck_ep.hybrid): at most this
# many scale-out channels, and the signal words of a peer slot left to them after the scale-up protocol's 3.
HYBRID_MAX_CHANNELS = 32
HYBRID_SIGNAL_WORDS = SIGNAL_WORDS_PER_PEER - 3
HYBRID_MAX_SUB_PARTS = 16  # EP_NUM_SUB_PARTS's upper bound


def _moe_row(config: MoEConfig) -> int:
    row = config.hidden_size * 2 + config.top_k * (8 + 4)
    return (row + 15) // 16 * 16


def moe_hybrid_area_bytes(config: MoEConfig, group_size: int) -> int:
    """Bytes of one hybrid area (one per other host; 0 on one host).

    As a forwarder, the rows one other host's source puts here (``max_tokens`` rows in at most
    ``HYBRID_MAX_CHANNELS`` channels, and one sub-part header per signal word and sub-part); as a relay, the
    partials this host's ``gpus_per_host`` ranks return to that source. One operation uses one of the two.
    """
    if config.num_hosts <= 1:
        return 0
    g = config.gpus_per_host if config.gpus_per_host is not None else group_size // config.num_hosts
    row = _moe_row(config)
    header = 16 + (4 * g + 15) // 16 * 16
    staging = (config.max_tokens + HYBRID_MAX_CHANNELS) * row
    staging += HYBRID_SIGNAL_WORDS * HYBRID_MAX_SUB_PARTS * header
    return max(staging, g * config.max_tokens * row)


def moe_workspace_bytes(config: MoEConfig, group_size: int) -> int:
    """Bytes of one MoE context's symmetric workspace.

    The worst-case receive area of one dispatch: every member sends all of its ``max_tokens`` tokens
    to this rank, each a bf16 row of ``hidden_size`` plus its ``top_k`` int64 expert ids and fp32
    weights, rows 16-byte aligned. A group over several hosts adds ``num_hosts - 1`` hybrid areas after it
    (:func:`moe_hybrid_area_bytes`), and the agreement mailbox ends it (:func:`moe_agreement_bytes`).
    """
    return moe_agreement_offset(config, group_size) + moe_agreement_bytes(config, group_size)


# The agreement mailbox of a MoE workspace (lck_ep's synced calls may agree on their arguments through it on
# the device instead of a process-group all-gather): two sets of one slot per member, used by alternate
# agreements, each slot a sequence word and a vector of at most AGREEMENT_HEADER_WORDS + group size +
# num_experts int64 (a status, the call's digest, and a dispatch's tokens per member and per expert).
AGREEMENT_HEADER_WORDS = 32


def moe_agreement_slot_words(config: MoEConfig, group_size: int) -> int:
    """int64 words of one mailbox slot: the sequence word and the longest vector."""
    return 1 + AGREEMENT_HEADER_WORDS + group_size + config.num_experts


def moe_agreement_bytes(config: MoEConfig, group_size: int) -> int:
    """Bytes of the agreement mailbox: two sets of ``group_size`` slots."""
    return 2 * group_size * moe_agreement_slot_words(config, group_size) * 8


def moe_agreement_offset(config: MoEConfig, group_size: int) -> int:
    """Where the agreement mailbox starts in the workspace: after the receive area and the hybrid areas
    (both multiples of 16 bytes)."""
    base = group_size * config.max_tokens * _moe_row(config)
    return base + (config.num_hosts - 1) * moe_hybrid_area_bytes(config, group_size)


@dataclass
class Reservation:
    label: str
    numel: int
    dtype: str  # "float32" | "int64" | "uint8"
    tensor: Any = None  # the symmetric tensor on the NVSHMEM path
    alive: bool = True

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPE_BYTES[self.dtype]


@dataclass
class SymmetricPool:
    """Reservations in allocation order (the same on every bootstrap rank)."""

    reservations: list[Reservation] = field(default_factory=list)
    scratch: Reservation | None = None

    def reserve(self, label: str, numel: int, dtype: str, nvshmem: Any | None) -> Reservation:
        """Collective over the bootstrap domain on the NVSHMEM path (same label/size order everywhere)."""
        if dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"reserve({label!r}): dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}"
            )
        if numel < 1:
            raise ValueError(f"reserve({label!r}): numel must be >= 1, got {numel}")
        tensor = None
        if nvshmem is not None:
            import torch

            tensor = nvshmem.alloc(numel, getattr(torch, dtype))
        res = Reservation(label, numel, dtype, tensor)
        self.reservations.append(res)
        return res

    def ensure_scratch(self, capacity: int, nvshmem: Any | None) -> Reservation:
        """The shared FLSCE scratch for ``capacity``: reuse when it fits (callers reject growth first)."""
        if self.scratch is not None:
            if self.scratch.numel < capacity:
                raise RuntimeError(
                    f"FLSCE scratch holds {self.scratch.numel} fp32 but {capacity} were requested; "
                    "growth must be rejected before reserving"
                )
            return self.scratch
        self.scratch = self.reserve(SCRATCH_LABEL, scratch_numel(capacity), "float32", nvshmem)
        return self.scratch

    def allocate(self, spec: Reservation, nvshmem: Any | None) -> Reservation:
        """Reserve a planned entry (``configure_checks.planned_reservations``): its label, size and dtype."""
        return self.reserve(spec.label, spec.numel, spec.dtype, nvshmem)

    def release(self, res: Reservation, nvshmem: Any | None) -> None:
        """Collective on the NVSHMEM path: every rank releases the same reservation at the same point."""
        if not res.alive:
            return
        res.alive = False
        self.reservations.remove(res)
        if res is self.scratch:
            self.scratch = None
        if nvshmem is not None and res.tensor is not None:
            nvshmem.free(res.tensor)
        res.tensor = None

    def release_all(self, nvshmem: Any | None) -> None:
        for res in reversed(list(self.reservations)):
            self.release(res, nvshmem)

    def plan(self) -> list[tuple[str, int, str]]:
        """(label, numel, dtype) in allocation order: equal on every rank of the bootstrap domain."""
        return [(r.label, r.numel, r.dtype) for r in self.reservations]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reservations)
