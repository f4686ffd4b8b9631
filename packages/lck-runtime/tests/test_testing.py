"""run_workers: real processes, errors carried back per rank, hangs bounded."""

from __future__ import annotations

import time

import pytest

from lck_runtime.testing import WorkerError, WorkerTimeout, run_workers


def _allreduce(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def _fail_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def _hang_on_zero(rank: int, world: int) -> str | None:
    if rank == 0:
        time.sleep(600)
    return f"rank {rank} finished: " + "x" * 5000 + " and its last words"


def test_allreduce_over_gloo() -> None:
    assert run_workers(_allreduce, 3, timeout=120) == [6, 6, 6]


def test_error_is_reported_with_rank() -> None:
    with pytest.raises(WorkerError) as info:
        run_workers(_fail_on_one, 2, timeout=120)
    assert info.value.messages() == {1: "ValueError: rank one refuses"}


def test_hang_fails_within_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"ranks \[0\] did not finish within 60 s") as info:
        run_workers(_hang_on_zero, 2, timeout=60)
    assert time.monotonic() - t0 < 120
    # What the ranks that finished returned comes along (shown cut short in the message).
    assert set(info.value.results) == {1} and info.value.results[1].startswith("rank 1 finished: x")
    assert "rank 1 returned: 'rank 1 finished: xxx" in str(info.value)
    assert "characters left out" in str(info.value) and str(info.value).endswith("and its last words'")
    assert len(str(info.value)) < 2500


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_workers(_allreduce, 0)
    with pytest.raises(ValueError, match="backend"):
        run_workers(_allreduce, 1, backend="mpi")


def _visible(rank: int, world: int) -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_ranks_of_a_cpu_test_see_no_gpu() -> None:
    """A test without the gpu marker runs its ranks with CUDA hidden, on a GPU machine too (the CPU paths
    it tests are the ones a CPU runner takes); the test process's own view is left alone."""
    import os

    assert os.environ.get("LCK_TEST_CPU") == "1"
    assert run_workers(_visible, 2) == ["", ""]
    assert run_workers(_visible, 1, env={"CUDA_VISIBLE_DEVICES": "0"}) == ["0"]
