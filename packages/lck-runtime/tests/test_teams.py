"""TeamCache: one split per group of a partition on every rank, one team kept, destroy and invalidation."""

from __future__ import annotations

import pytest

from lck_runtime.groups import Partition
from lck_runtime.teams import TeamCache

EP = Partition(size=2, stride=2, groups=((0, 2), (1, 3)))
BOOT = (10, 11, 12, 13)  # global ranks of a non-WORLD bootstrap domain


class _Splitter:
    def __init__(self, me: int, lie: str = "") -> None:
        self.me, self.lie, self.calls, self.destroyed = me, lie, [], []

    def split_strided(self, start: int, stride: int, size: int) -> int | None:
        self.calls.append((start, stride, size))
        member = self.me in range(start, start + stride * size, stride)
        if self.lie == "member gets none":
            member = False
        elif self.lie == "outsider gets one":
            member = True
        return 40 + start if member else None

    def destroy_team(self, handle: int) -> None:
        self.destroyed.append(handle)


@pytest.mark.parametrize("me", [0, 1, 2, 3])
def test_every_rank_splits_every_group_and_keeps_its_own(me: int) -> None:
    cache, nv = TeamCache(), _Splitter(me)
    team = cache.ensure(EP, BOOT, me, nv)
    assert nv.calls == [(0, 2, 2), (1, 2, 2)]
    assert team.local == EP.group_of(me) and team.ranks == tuple(BOOT[i] for i in team.local)
    assert team.handle == 40 + team.local[0] and team.size == 2 and team.alive
    # a hit makes no collective call and returns the same team
    assert cache.ensure(EP, BOOT, me, nv) is team and len(nv.calls) == 2
    assert cache.get(team.ranks) is team and cache.partitions() == [(2, 2)]
    assert cache.destroy((2, 2), nv) is team and nv.destroyed == [team.handle]
    assert not team.alive and cache.get(team.ranks) is None and cache.destroy((2, 2), nv) is None


def test_torch_distributed_path_keeps_bookkeeping_without_handles() -> None:
    cache = TeamCache()
    team = cache.ensure(EP, BOOT, 3, None)
    assert team.handle is None and team.ranks == (11, 13)
    cache.destroy_all(None)
    assert not team.alive and cache.partitions() == []


@pytest.mark.parametrize(
    ("lie", "needle"),
    [("member gets none", "returned no team on member 1"), ("outsider gets one", "on non-member 1")],
)
def test_inconsistent_split_results_are_errors(lie: str, needle: str) -> None:
    with pytest.raises(RuntimeError, match=needle):
        TeamCache().ensure(EP, BOOT, 1, _Splitter(1, lie))
