"""Helpers shared by the multi-process vocab-parallel tests: per-section results gathered from every
rank, poisoned allocator memory on CUDA, identical targets on every rank, error-message checks, and the
switches every one of them uses (interpreter flag, CPU-variant skip, the GPU workers' environment)."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable

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
