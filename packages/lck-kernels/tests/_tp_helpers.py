"""Helpers shared by the multi-process vocab-parallel tests: per-section results gathered from every
rank, poisoned allocator memory on CUDA, identical targets on every rank, error-message checks, and the
switches every one of them uses (interpreter flag, CPU-variant skip, the GPU workers' environment)."""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_variant = pytest.mark.skipif(
    not INTERPRET, reason="the CPU variant runs Triton kernels in its interpreter: set TRITON_INTERPRET=1"
)
# GPU workers: NVSHMEM over the loopback bootstrap on one host, NVLink multicast off (not available here).
GPU_ENV = {
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "LCK_TEST_PG_TIMEOUT": "300",
}


# CPU workers: gloo processes running Triton's interpreter, with bounded process-group and setup waits.
CPU_ENV = {"TRITON_INTERPRET": "1", "LCK_TEST_PG_TIMEOUT": "90", "LCK_SETUP_TIMEOUT": "60"}


def run_cpu_world(fn: Callable[[int, int], object], world: int = 2) -> list:
    """``fn(rank, world)`` on ``world`` gloo processes under the interpreter (a module fixture's body)."""
    from lck_runtime.testing import run_workers

    if not INTERPRET:
        pytest.skip("the CPU variant runs Triton kernels in its interpreter: set TRITON_INTERPRET=1")
    return run_workers(fn, world, env=CPU_ENV, timeout=600)


def _poison_cached_memory(device: str) -> None:
    """On CUDA, leave NaN in the caching allocator's free memory: outputs the op allocates with
    ``torch.empty`` then start as NaN, so an element a kernel never writes fails the comparison."""
    if torch.device(device).type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    block = torch.empty(min(free // 4, 16 << 30) // 4, dtype=torch.float32, device=device)
    block.fill_(float("nan"))
    del block


def _same_targets(vocab: int, n: int) -> torch.Tensor:
    """Targets that every rank draws identically (they must agree across the group)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))


def _expect_error(exc_type: type[BaseException], fn: Callable[[], object], *mentions: str) -> str:
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        for m in mentions:
            assert m in msg, f"expected {m!r} in the {exc_type.__name__} message: {msg}"
        return msg
    raise AssertionError(f"expected {exc_type.__name__} mentioning {mentions}, nothing was raised")


def _sections(rank: int, sections: list[tuple[str, Callable[[], object]]]) -> dict[str, object]:
    """Run each section, recording its result or its traceback (a failure must not hide the others)."""
    out: dict[str, object] = {}
    for name, fn in sections:
        t0 = time.monotonic()
        try:
            out[name] = ("ok", fn())
        except Exception:
            out[name] = ("fail", f"rank {rank}: {traceback.format_exc()}")
            # Printed at once too: if a later section then hangs on the other rank, the timeout's report
            # still shows why this one failed.
            print(f"rank {rank} section {name} failed:\n{out[name][1]}", flush=True)
        if rank == 0 or os.environ.get("LCK_TEST_TIMES"):  # shown by pytest -s, or with a failure
            print(f"rank {rank} section {name}: {time.monotonic() - t0:.1f} s {out[name][0]}", flush=True)
    return out


def _timed(rank: int, label: str, fn: Callable[[], object]) -> object:
    """Run one case, printing its time from rank 0 (so a timeout still shows where the time went)."""
    t0 = time.monotonic()
    result = fn()
    if rank == 0:
        print(f"rank 0   {label}: {time.monotonic() - t0:.1f} s", flush=True)
    return result


def _section(results: list[dict[str, object]], name: str) -> list[object]:
    fails = [r[name][1] for r in results if r[name][0] == "fail"]
    assert not fails, "\n".join(fails)
    return [r[name][1] for r in results]


def same_messages(per_rank: list[dict[str, str]]) -> None:
    """Every rank raised the same message in each case (collective checks agree before they raise)."""
    for case in per_rank[0]:
        msgs = {m[case] for m in per_rank}
        assert len(msgs) == 1, f"{case}: ranks raised different messages: {msgs}"


def same_result(per_rank: list[object]) -> None:
    assert all(r == per_rank[0] for r in per_rank), per_rank


def world_test(
    *cases: Callable[[Any], object], check: Callable[[list[Any]], None] | None = None
) -> Callable[[list[dict[str, object]], str], None]:
    """A CPU-variant test over the module's ``world2`` fixture: each ``case(group)`` ran without error on
    every rank, and ``check(results of every rank)`` holds. The test keeps its cases (``.cases``) for
    ``run_world_tests`` to run."""

    @cpu_variant
    @pytest.mark.parametrize("case", [_case_name(fn) for fn in cases])
    def test(world2: list[dict[str, object]], case: str) -> None:
        per_rank = _section(world2, case)
        if check is not None:
            check(per_rank)

    test.cases = cases
    return test


def run_world_tests(*tests: Callable[..., None]) -> list[dict[str, object]]:
    """The cases of ``tests`` (made by ``world_test``) on two gloo processes over WORLD, under the
    interpreter, each recorded by name (a ``world2`` module fixture's body)."""
    cases = tuple(fn for t in tests for fn in t.cases)
    return run_cpu_world(functools.partial(_world_cases, cases))


def _case_name(fn: Callable[..., object]) -> str:
    return fn.__name__.strip("_")


def _world_cases(cases: tuple[Callable[[Any], object], ...], rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    g = dist.group.WORLD
    return _sections(rank, [(_case_name(fn), functools.partial(fn, g)) for fn in cases])


def run_side_by_side(
    unconfigured: Callable[[Any, Any, int], None],
    configured: Callable[[Any, Any, int], dict[str, str]],
    hidden_size: int,
) -> None:
    """Four gloo processes under the interpreter: WORLD as a TP=4 group beside two TP=2 pairs ({0, 1} and
    {2, 3}). ``unconfigured(tp4, tp2, rank)`` runs over torch.distributed alone; ``configured(tp4, tp2,
    rank)`` with the runtime configured on both (TP=4: 24 tokens, TP=2: 16, 32 vocabulary columns a rank,
    ``hidden_size``) and returns the messages of the errors it provoked, which must agree within a pair."""
    from lck_runtime.testing import run_workers

    worker = functools.partial(_side_by_side, unconfigured, configured, hidden_size)
    results = run_workers(worker, 4, env=CPU_ENV, timeout=600)
    _section(results, "unconfigured")
    msgs = _section(results, "configured")
    assert msgs[0] == msgs[1] and msgs[2] == msgs[3], msgs


def _side_by_side(
    unconfigured: Callable[[Any, Any, int], None],
    configured: Callable[[Any, Any, int], dict[str, str]],
    hidden_size: int,
    rank: int,
    world: int,
) -> dict[str, object]:
    import torch.distributed as dist

    from lck_runtime import FusedLinearCrossEntropyConfig, configure, finalize, flsce_context

    tp4 = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    tp2 = pairs[rank // 2]

    def with_runtime() -> dict[str, str]:
        # The runtime reserves process-wide maxima on the first call: the larger section goes first.
        configure(
            process_groups={"tp2": tp2, "tp4": tp4},
            flsce=FusedLinearCrossEntropyConfig(
                max_tokens=24, hidden_size=hidden_size, local_vocab_size=32, group="tp4"
            ),
        )
        configure(
            flsce=FusedLinearCrossEntropyConfig(
                max_tokens=16, hidden_size=hidden_size, local_vocab_size=32, group="tp2"
            )
        )
        try:
            assert flsce_context(tp2).size == 2 and flsce_context(tp4).size == 4
            return configured(tp4, tp2, rank)
        finally:
            finalize()

    return _sections(
        rank, [("unconfigured", lambda: unconfigured(tp4, tp2, rank)), ("configured", with_runtime)]
    )


def gpu_tp2_test(worker: Callable[[int, int], dict[str, object]]) -> Callable[[], None]:
    """A 2-GPU test of ``worker`` over NCCL: its ``nccl`` section passes on both ranks and its ``nvshmem``
    section (the runtime configured) returns True on both, NVSHMEM up (H200)."""

    @pytest.mark.multigpu(2)
    def test() -> None:
        from lck_runtime.testing import run_workers

        # Bounded well below a CI step's limit, so that a slow run fails here with each rank's section timings.
        results = run_workers(worker, 2, backend="nccl", env=GPU_ENV, timeout=110)
        _section(results, "nccl")
        natives = _section(results, "nvshmem")
        assert natives == [True, True], (
            f"configure(flsce=...) must bring NVSHMEM up on 2 x H200, got {natives}"
        )

    return test
