"""Named process groups: ordered membership, uniform strided partitions of the bootstrap domain.

A group is known by its *ordered membership*: the global ranks of its members in group-rank order
(``torch.distributed.get_process_group_ranks``). Expressed as indices into the bootstrap group (the
NVSHMEM world: PE ``i`` is the bootstrap group's rank ``i``), every group must be strided
(``start + stride * i``), and the groups that the ranks register under one name must tile the
bootstrap domain uniformly: equal sizes, one stride, disjoint, covering every rank. Under that rule a
partition is determined by its (size, stride), so two names either share all their groups (and their
teams and contexts) or none, on every rank alike.

The checks here are pure functions of what every rank reported, so all ranks that run them on the
same gathered reports raise the same error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

__all__ = ["GroupEntry", "GroupRegistry", "Partition", "check_partition", "membership", "stride_of"]


@dataclass(frozen=True)
class Partition:
    """A uniform strided partition of the bootstrap domain (indices are bootstrap-local ranks)."""

    size: int
    stride: int
    groups: tuple[tuple[int, ...], ...]  # ordered by first member: the bootstrap-wide split order

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.stride)

    def group_of(self, local_rank: int) -> tuple[int, ...]:
        for g in self.groups:
            if local_rank in g:
                return g
        raise KeyError(local_rank)  # unreachable for a validated partition


def stride_of(local: Sequence[int]) -> int | None:
    """The stride of an ascending arithmetic sequence (1 for a single member), else ``None``."""
    if len(local) == 1:
        return 1
    step = local[1] - local[0]
    if step < 1:
        return None
    if any(b - a != step for a, b in pairwise(local)):
        return None
    return step


def membership(group: Any, what: str) -> tuple[int, ...]:
    """Ordered global ranks of ``group``; raises if it is not a ProcessGroup this rank belongs to."""
    import torch.distributed as dist

    if group is None:
        raise ValueError(f"{what} is None; pass a ProcessGroup (None is never a silent WORLD)")
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{what} is GroupMember.NON_GROUP_MEMBER: this rank ({dist.get_rank()}) is not a member of "
            "that group; each rank passes the group it belongs to"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what} must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"{what} has ranks {ranks}, which do not include this rank ({me})")
    return ranks


def check_partition(what: str, reports: Sequence[tuple[int, ...]], n: int) -> Partition:
    """Validate the memberships reported under one name by bootstrap-local ranks ``0..n-1``.

    ``reports[r]`` is rank ``r``'s ordered membership in bootstrap-local indices. Raises ``ValueError``
    (the same message on every rank, since every rank checks the same reports) unless the groups are
    consistent, strided and tile ``0..n-1`` uniformly.
    """
    if len(reports) != n:
        raise ValueError(f"{what}: expected reports from {n} ranks, got {len(reports)}")
    for r, local in enumerate(reports):
        outside = [m for m in local if not 0 <= m < n]
        if outside:
            raise ValueError(
                f"{what}: rank {r} reported a group {local} with members {outside} outside the "
                f"bootstrap group's {n} ranks"
            )
        if r not in local:
            raise ValueError(f"{what}: rank {r} reported a group {local} that does not contain it")
        if len(set(local)) != len(local):
            raise ValueError(f"{what}: rank {r} reported a group with repeated members {local}")
    # Every member of a group must report the same ordered membership.
    for r, local in enumerate(reports):
        for m in local:
            if reports[m] != local:
                raise ValueError(
                    f"{what}: rank {r} reports the group {local} but its member rank {m} reports "
                    f"{reports[m]}; every member must pass the same group (same ranks, same order)"
                )
    groups = sorted(set(reports), key=lambda g: min(g))
    sizes = sorted({len(g) for g in groups})
    if len(sizes) != 1:
        raise ValueError(
            f"{what}: groups must all have one size, got sizes {sizes} in {tuple(groups)}: "
            "each name is a uniform partition of the bootstrap group"
        )
    strides = set()
    for g in groups:
        s = stride_of(g)
        if s is None:
            raise ValueError(
                f"{what}: group {g} (bootstrap-local ranks) is not a strided ascending sequence "
                "start + stride * i; teams are split with team_split_strided"
            )
        strides.add(s)
    if len(strides) != 1:
        raise ValueError(
            f"{what}: groups must share one stride, got strides {sorted(strides)} in {tuple(groups)}"
        )
    # Consistency above makes the groups disjoint; with one size they cover 0..n-1 exactly when
    # every rank belongs to one, which it does (each rank reported a group containing itself).
    return Partition(size=sizes[0], stride=strides.pop(), groups=tuple(groups))


@dataclass(frozen=True)
class GroupEntry:
    """A registered name: this rank's group, its ordered global ranks, and the partition it belongs to."""

    name: str
    group: Any  # torch.distributed.ProcessGroup
    ranks: tuple[int, ...]
    partition: Partition


@dataclass
class GroupRegistry:
    """Names → groups, additive; plus a ProcessGroup → ordered-membership cache for execution paths."""

    entries: dict[str, GroupEntry] = field(default_factory=dict)
    _pg_ranks: dict[Any, tuple[int, ...]] = field(default_factory=dict)

    def add(self, entry: GroupEntry) -> None:
        self.entries[entry.name] = entry
        self._pg_ranks[entry.group] = entry.ranks

    def alias(self, group: Any, ranks: tuple[int, ...]) -> None:
        """Another ProcessGroup object with a registered membership (same team, same contexts)."""
        self._pg_ranks[group] = ranks

    def ranks_of(self, group: Any, what: str) -> tuple[int, ...]:
        """Ordered global ranks of a ProcessGroup, cached per group object."""
        try:
            hit = self._pg_ranks.get(group)
        except TypeError:  # unhashable: not a ProcessGroup; membership() names the problem
            hit = None
        if hit is not None:
            return hit
        ranks = membership(group, what)
        self._pg_ranks[group] = ranks
        return ranks

    def digest(self) -> list[tuple[str, tuple[int, int]]]:
        """What every rank must agree on: names and their partitions (memberships differ per rank)."""
        return sorted((n, e.partition.key) for n, e in self.entries.items())
