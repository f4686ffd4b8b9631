"""Buffer dispatch/combine over the all-to-all reference backend, real processes (gloo; NCCL on GPU).

One set of 4 processes covers the group sizes 4, 3 and 2 (the world, a 3-rank subgroup with one rank
idle, and two 2-rank subgroups running side by side): starting a process with torch costs more than
all the cases together. Each case of ``_ep_worker.CASES`` and each misuse check is reported by its own
test. ``LCK_EP_TEST_SEED`` pins the seed (it is printed in every failure).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from _ep_worker import CASE_NAMES, MISUSE, worker

from lck_runtime.testing import run_workers

SEED = int(os.environ.get("LCK_EP_TEST_SEED", random.randrange(1, 2**30)))
CPU_CONFIGS = [[[0, 1, 2, 3]], [[0, 1, 2]], [[0, 1], [2, 3]]]
_RUNS: dict[str, list[list[dict[str, Any]]]] = {}


def _records(run: str) -> list[dict[str, Any]]:
    """Every group record of a run, over all ranks."""
    if run not in _RUNS:
        if run == "gloo":
            _RUNS[run] = run_workers(worker, 4, SEED, "torch", True, CPU_CONFIGS, timeout=900)
        else:
            from lck_runtime.toolchain import find_nvcc

            layout = "kernel" if find_nvcc() else "torch"
            world = 2 if run == "nccl2" else 1
            _RUNS[run] = run_workers(worker, world, SEED, layout, world > 1, backend="nccl", timeout=900)
    return [rec for per_rank in _RUNS[run] for rec in per_rank]


def _assert_case(run: str, size: int, case: str) -> None:
    recs = [r for r in _records(run) if r["size"] == size]
    assert recs, f"no group of size {size} ran"
    errors = [e for r in recs for e in r["cases"].get(case, [f"{case}: not run (an earlier case crashed)"])]
    assert not errors, f"seed {SEED}:\n" + "\n".join(errors)


# (misuse check, exception type every rank raises, fragments of the message)
EXPECTED_MISUSE = {
    "hidden_on_last_rank": ("ValueError", ["rank {last}: dispatch: x has hidden size 25", "hidden=24"]),
    "expand_on_rank0": ("ValueError", ["ranks disagree on expand", "rank 0: True", "rank 1: False"]),
    "bad_expert_on_rank1": ("ValueError", ["topk_idx on rank 1 has entries outside [-1, {e})"]),
    "int32_topk_on_rank0": ("TypeError", ["rank 0: dispatch: topk_idx must be int64, got int32"]),
    "combine_rows_on_rank0": ("ValueError", ["rank 0: combine: x must have one row per received rows"]),
    "buffer_hidden_on_rank1": ("ValueError", ["Buffer.__init__: ranks disagree on hidden", "rank 1: 26"]),
    "foreign_handle": ("ValueError", ["handle comes from another Buffer"]),
    "experts_not_multiple": (
        "ValueError",
        ["rank 0: Buffer: num_experts ({odd}) must be a multiple of the group size ({size})"],
    ),
}


def _assert_misuse(run: str, size: int, check: str) -> None:
    recs = [r for r in _records(run) if r["size"] == size]
    assert recs, f"no group of size {size} ran"
    crashes = [r["misuse"]["crash"] for r in recs if "crash" in r["misuse"]]
    assert not crashes, f"seed {SEED}:\n" + "\n".join(crashes)
    kind, fragments = EXPECTED_MISUSE[check]
    by_group: dict[tuple[int, ...], list[str | None]] = {}
    for r in recs:
        by_group.setdefault(tuple(r["ranks"]), []).append(r["misuse"].get(check))
    for ranks, messages in by_group.items():
        assert len(messages) == size, (ranks, messages)
        assert len(set(messages)) == 1, (
            f"seed {SEED}: group {ranks} raised different errors for {check}: {messages}"
        )
        msg = messages[0]
        assert msg is not None and msg.startswith(f"{kind}: "), f"seed {SEED}: {check}: {msg}"
        for frag in fragments:
            frag = frag.format(last=size - 1, e=2 * size, odd=2 * size + 1, size=size)
            assert frag in msg, f"seed {SEED}: {check}: {frag!r} not in {msg!r}"
    assert all(r["misuse"].get("after_misuse_round_trip") == "ok" for r in recs), [r["misuse"] for r in recs]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_dispatch_combine_equal_single_process_oracle(world: int, case: str) -> None:
    _assert_case("gloo", world, case)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("check", MISUSE)
def test_collective_misuse_raises_the_same_error_on_every_rank(world: int, check: str) -> None:
    _assert_misuse("gloo", world, check)


def test_subgroups_ran_side_by_side() -> None:
    groups = sorted({tuple(r["ranks"]) for r in _records("gloo")})
    assert groups == [(0, 1), (0, 1, 2), (0, 1, 2, 3), (2, 3)]


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_nccl_two_gpus(case: str) -> None:
    """The CPU suite's cases over NCCL on 2 GPUs; the dispatch layout from the JIT kernel when nvcc exists."""
    _assert_case("nccl2", 2, case)


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("check", MISUSE)
def test_nccl_two_gpus_misuse(check: str) -> None:
    _assert_misuse("nccl2", 2, check)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASE_NAMES)
def test_nccl_one_gpu(case: str) -> None:
    """A one-rank group on one GPU: every token stays home, through the same code paths."""
    _assert_case("nccl1", 1, case)
