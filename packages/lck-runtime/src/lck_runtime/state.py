"""The process-wide runtime state that configure, the lifecycle calls and the context lookups share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lck_runtime.agreement import Domain
from lck_runtime.config import FusedLinearCrossEntropyConfig, MoEConfig
from lck_runtime.groups import GroupRegistry, Partition
from lck_runtime.symmetric import SymmetricPool
from lck_runtime.teams import TeamCache

__all__ = ["STATE", "RuntimeState"]


@dataclass
class RuntimeState:
    domain: Domain | None = None
    device: Any = None  # torch.device
    native: bool = False
    native_reason: str = ""
    nvshmem: Any = None  # NvshmemOwner while native
    heap_bytes: int | None = None  # NVSHMEM's symmetric heap, fixed at its init (None: unknown or not native)
    registry: GroupRegistry = field(default_factory=GroupRegistry)
    teams: TeamCache = field(default_factory=TeamCache)
    pool: SymmetricPool = field(default_factory=SymmetricPool)
    # Process-wide capacities: the first request of each kind reserves them; later requests must fit.
    flsce_reserved: FusedLinearCrossEntropyConfig | None = None
    moe_reserved: MoEConfig | None = None
    flsce: dict[tuple[int, int], Any] = field(default_factory=dict)  # partition key → FlsceContext
    moe: dict[tuple[int, int], Any] = field(default_factory=dict)  # partition key → MoEContext

    @property
    def configured(self) -> bool:
        return self.domain is not None

    def bootstrap_partition(self) -> Partition:
        assert self.domain is not None
        n = self.domain.size
        return Partition(size=n, stride=1, groups=(tuple(range(n)),))

    def digest(self) -> dict[str, Any]:
        """What every bootstrap rank's runtime must agree on before a setup collective mutates it."""
        return {
            "configured": self.configured,
            "native": self.native,
            "device_type": None if self.device is None else self.device.type,
            "names": self.registry.digest(),
            "teams": self.teams.partitions(),
            "flsce_capacity": None if self.flsce_reserved is None else self.flsce_reserved.fields(),
            "moe_capacity": None if self.moe_reserved is None else self.moe_reserved.fields(),
            "flsce_contexts": sorted(self.flsce),
            "moe_contexts": sorted(self.moe),
            "reservations": self.pool.plan(),
        }

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


STATE = RuntimeState()
