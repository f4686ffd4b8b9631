"""``lck_runtime.capture.host_group``: the gloo group a host-side agreement runs on, per membership.

Real processes: on the CPU (gloo) a group is its own host group and no mirror is made; over NCCL on two
GPUs, each membership (the world, and the one-rank halves, made by their members only) gets one gloo
mirror with the same members in the same order, shared by later lookups, that carries a CPU all-reduce.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lck_runtime.testing import run_workers


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lck_runtime import capture

    out: dict[str, Any] = {}
    world_group = dist.group.WORLD
    half = None
    for members in ([0], [1]):  # each rank makes only its own half (no world-wide new_group call)
        if rank in members:
            half = dist.new_group(members, use_local_synchronization=True)
    out["before_create"] = capture.host_group(world_group, create=False) is None
    for name, group in (("world", world_group), ("half", half)):
        host = capture.host_group(group)
        out[f"{name}_is_self"] = host is group
        out[f"{name}_backend"] = str(dist.get_backend(host))
        out[f"{name}_members"] = dist.get_process_group_ranks(host)
        out[f"{name}_cached"] = capture.host_group(group, create=False) is host
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=host)
        out[f"{name}_sum"] = float(t)
    return out


def test_gloo_groups_are_their_own_host_groups() -> None:
    results = run_workers(_worker, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["before_create"] is False, r  # gloo: the group itself, never None
        assert r["world_is_self"] and r["half_is_self"], r
        assert r["world_members"] == [0, 1] and r["half_members"] == [rank], r
        assert r["world_sum"] == 3.0 and r["half_sum"] == float(rank + 1), r


@pytest.mark.multigpu(2)
def test_nccl_groups_get_one_gloo_mirror_per_membership() -> None:
    results = run_workers(_worker, 2, backend="nccl", timeout=180)
    for rank, r in enumerate(results):
        assert r["before_create"] is True, r  # no mirror until one is asked for
        assert not r["world_is_self"] and not r["half_is_self"], r
        assert r["world_backend"] == "gloo" and r["half_backend"] == "gloo", r
        assert r["world_members"] == [0, 1] and r["half_members"] == [rank], r
        assert r["world_cached"] and r["half_cached"], r
        assert r["world_sum"] == 3.0 and r["half_sum"] == float(rank + 1), r
