"""Teams per ordered membership: split once per partition at setup, looked up on execution paths.

A partition's teams are made by splitting the bootstrap team (NVSHMEM's world) once per group of the
partition, in the partition's order (by first member). ``team_split_strided`` is collective over the
parent team, so every bootstrap rank calls every split of the partition, including the splits of
groups it is not in; each rank keeps the one handle it gets back. Execution paths only look teams up:
they never create one.

On the torch.distributed path a team is the same bookkeeping without an NVSHMEM handle, so the
lifecycle rules (destroy, invalidation) are the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lck_runtime.groups import Partition

__all__ = ["Team", "TeamCache"]


@dataclass
class Team:
    """This rank's team in one partition."""

    ranks: tuple[int, ...]  # ordered global ranks
    local: tuple[int, ...]  # the same members as bootstrap-local ranks (NVSHMEM world PEs)
    partition: Partition
    handle: int | None  # NVSHMEM team handle; None on the torch.distributed path
    alive: bool = True

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class TeamCache:
    """Ordered membership → this rank's team; one entry per partition."""

    by_ranks: dict[tuple[int, ...], Team] = field(default_factory=dict)
    by_partition: dict[tuple[int, int], Team] = field(default_factory=dict)

    def get(self, ranks: tuple[int, ...]) -> Team | None:
        return self.by_ranks.get(ranks)

    def partitions(self) -> list[tuple[int, int]]:
        return sorted(self.by_partition)

    def ensure(
        self, partition: Partition, bootstrap_ranks: tuple[int, ...], local_rank: int, nvshmem: Any | None
    ) -> Team:
        """This rank's team of ``partition``, splitting the whole partition on a miss (collective)."""
        hit = self.by_partition.get(partition.key)
        if hit is not None:
            return hit
        mine: Team | None = None
        for group in partition.groups:
            handle = None
            if nvshmem is not None:
                handle = nvshmem.split_strided(group[0], partition.stride, partition.size)
            if local_rank in group:
                if nvshmem is not None and handle is None:
                    raise RuntimeError(
                        f"NVSHMEM split of bootstrap ranks {group} returned no team on member {local_rank}"
                    )
                mine = Team(
                    ranks=tuple(bootstrap_ranks[i] for i in group),
                    local=group,
                    partition=partition,
                    handle=handle,
                )
            elif handle is not None:
                raise RuntimeError(
                    f"NVSHMEM split of bootstrap ranks {group} returned team {handle} on non-member {local_rank}"
                )
        assert mine is not None  # a validated partition covers every rank
        self.by_partition[partition.key] = mine
        self.by_ranks[mine.ranks] = mine
        return mine

    def destroy(self, key: tuple[int, int], nvshmem: Any | None) -> Team | None:
        """Destroy this rank's team of the partition ``key`` (collective over its members)."""
        team = self.by_partition.pop(key, None)
        if team is None:
            return None
        self.by_ranks.pop(team.ranks, None)
        team.alive = False
        if nvshmem is not None and team.handle is not None:
            nvshmem.destroy_team(team.handle)
        return team

    def destroy_all(self, nvshmem: Any | None) -> None:
        for key in sorted(self.by_partition):
            self.destroy(key, nvshmem)
