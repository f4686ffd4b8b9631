"""Partition checks: strided groups, consistent memberships, uniform tiling of the bootstrap domain."""

from __future__ import annotations

import pytest

from lck_runtime.groups import GroupEntry, GroupRegistry, Partition, check_partition, stride_of


def test_stride_of() -> None:
    assert stride_of((3,)) == 1
    assert stride_of((0, 1, 2)) == 1
    assert stride_of((1, 3, 5)) == 2
    assert stride_of((0, 1, 3)) is None
    assert stride_of((2, 0)) is None  # descending: not a team_split_strided layout


def _reports(groups: list[tuple[int, ...]], n: int) -> list[tuple[int, ...]]:
    by_rank = {r: g for g in groups for r in g}
    return [by_rank[r] for r in range(n)]


@pytest.mark.parametrize(
    ("groups", "n", "key"),
    [
        ([(0, 1), (2, 3)], 4, (2, 1)),  # TP=2 contiguous
        ([(0, 2), (1, 3)], 4, (2, 2)),  # EP=2 strided
        ([(0, 2), (1, 3), (4, 6), (5, 7)], 8, (2, 2)),
        ([(0,), (1,), (2,)], 3, (1, 1)),
        ([(0, 1, 2, 3)], 4, (4, 1)),
        ([(0, 3), (1, 4), (2, 5)], 6, (2, 3)),
    ],
)
def test_valid_partitions(groups: list[tuple[int, ...]], n: int, key: tuple[int, int]) -> None:
    p = check_partition("x", _reports(groups, n), n)
    assert p.key == key
    assert p.groups == tuple(sorted(groups, key=min))
    for g in groups:
        for r in g:
            assert p.group_of(r) == g


@pytest.mark.parametrize(
    ("reports", "n", "needle"),
    [
        ([(0, 1), (1, 2), (1, 2)], 3, "rank 0 reports the group (0, 1) but its member rank 1 reports (1, 2)"),
        ([(0, 1), (0, 1), (2,)], 3, "one size"),
        ([(0, 1, 3), (0, 1, 3), (2,), (0, 1, 3)], 4, "sizes [1, 3]"),
        ([(0, 1, 3), (0, 1, 3), (2, 4, 5), (0, 1, 3), (2, 4, 5), (2, 4, 5)], 6, "not a strided ascending"),
        ([(0, 1), (0, 1), (2, 4), (3, 5), (2, 4), (3, 5)], 6, "one stride"),
        ([(1,), (1,)], 2, "rank 0 reported a group (1,) that does not contain it"),
        ([(0, 5), (1,)], 2, "outside the bootstrap group's 2 ranks"),
        ([(0, 0), (1, 1)], 2, "repeated members"),
        ([(0, 1)], 2, "expected reports from 2 ranks"),
    ],
)
def test_invalid_partitions(reports: list[tuple[int, ...]], n: int, needle: str) -> None:
    with pytest.raises(ValueError, match="process_groups\\['tp'\\]") as info:
        check_partition("process_groups['tp']", reports, n)
    assert needle in str(info.value)


def test_registry_digest_and_aliases() -> None:
    reg = GroupRegistry()
    tp = Partition(2, 1, ((0, 1), (2, 3)))
    ep = Partition(2, 2, ((0, 2), (1, 3)))
    g1, g2, g3 = object(), object(), object()
    reg.add(GroupEntry("tp", g1, (0, 1), tp))
    reg.add(GroupEntry("ep", g2, (0, 2), ep))
    reg.add(GroupEntry("tp_alias", g3, (0, 1), tp))
    assert reg.digest() == [("ep", (2, 2)), ("tp", (2, 1)), ("tp_alias", (2, 1))]
    # cached ProcessGroup → membership lookups need no torch.distributed call
    assert reg.ranks_of(g3, "x") == (0, 1)
    g4 = object()
    reg.alias(g4, (0, 2))
    assert reg.ranks_of(g4, "x") == (0, 2)
    assert reg.digest() == [("ep", (2, 2)), ("tp", (2, 1)), ("tp_alias", (2, 1))]
