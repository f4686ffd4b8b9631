"""Benchmark result files carry provenance and every record; the timers measure what they document."""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Callable

import pytest
import torch

from lck_runtime import benchmarking
from lck_runtime.benchmarking import (
    Record,
    device_barrier,
    host_ms,
    summarize,
    time_cuda,
    time_loop,
    write_results,
)
from lck_runtime.testing import run_workers


def test_write_results_json_and_csv(tmp_path) -> None:
    recs = [
        Record("rms_norm", "lck", "fwd", "16x8", "float32", median_ms=0.5, extra={"gbps": 1.0}),
        Record("rms_norm", "torch", "fwd", "16x8", "float32", error="RuntimeError: boom"),
    ]
    paths = write_results(recs, tmp_path, "cpu-test", meta={"note": "unit"})
    data = json.loads(paths["json"].read_text())
    for key in ("date", "commit", "torch", "triton", "gpu"):
        assert key in data["provenance"], key
    assert [r["provider"] for r in data["records"]] == ["lck", "torch"]
    rows = list(csv.DictReader(paths["csv"].open()))
    assert rows[0]["median_ms"] == "0.5" and rows[1]["error"] == "RuntimeError: boom"


def test_summarize_quantiles() -> None:
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median_ms"] == 3.0 and s["p20_ms"] == 2.0 and s["p80_ms"] == 4.0


# ---------------------------------------------------------------- timers on a simulated GPU
#
# time_cuda, host_ms and time_loop are CUDA-only. On CPU they run against FakeCuda: a device that
# executes queued `_sleep(cycles)` spins one after another in real time (2 GHz, so 5_000_000 cycles
# take 2.5 ms as on an H200), events that complete when the queue reaches them, and a synchronize
# that waits for the queue to drain. Host work is real `time.sleep`, so the tests check the timers'
# contract (what is inside the timed region, what is hidden by the head start, when host_ms gives up)
# with measured times in bands.

CLOCK_HZ = 2e9
EPS = 1e-6  # ms: float rounding of perf_counter differences


class FakeCuda:
    def __init__(self) -> None:
        self.busy_until = 0.0  # perf_counter time at which the queued spins end
        self.log: list[str] = []

    def _sleep(self, cycles: int) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + cycles / CLOCK_HZ

    def synchronize(self, device: object = None) -> None:
        self.log.append("sync")
        wait = self.busy_until - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def Event(self, enable_timing: bool = False) -> _FakeEvent:
        return _FakeEvent(self)


class _FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.at = cuda, None

    def record(self) -> None:
        self.at = max(time.perf_counter(), self.cuda.busy_until)

    def query(self) -> bool:
        return self.at is not None and time.perf_counter() >= self.at

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1e3


class _FakeFlush:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def zero_(self) -> None:
        self.cuda.log.append("flush")


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    cuda = FakeCuda()
    for name in ("_sleep", "synchronize", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(benchmarking, "_l2_flush_buffer", lambda: _FakeFlush(cuda))
    return cuda


def _kernel(cuda: FakeCuda, ms: float, log: str = "fn") -> Callable[[], None]:
    """A call that enqueues ``ms`` of GPU work and returns at once."""

    def fn() -> None:
        cuda.log.append(log)
        torch.cuda._sleep(int(ms * 1e-3 * CLOCK_HZ))

    return fn


def _host(ms: float, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A call that spends ``ms`` on the host (Python, dispatch) before ``then``."""

    def fn() -> None:
        time.sleep(ms * 1e-3)
        if then is not None:
            then()

    return fn


def test_time_cuda_times_each_call_of_a_known_kernel(fake_cuda) -> None:
    times = time_cuda(_kernel(fake_cuda, 1.0), warmup=2, iters=5, flush_l2=False)
    assert len(times) == 5
    assert fake_cuda.log.count("fn") == 7  # warm-up calls are not timed
    for t in times:
        assert 1.0 - EPS <= t < 1.5, times


def test_time_cuda_leaves_setup_out_and_runs_barrier_in_lock_step(fake_cuda) -> None:
    calls: list[str] = []

    def setup() -> None:
        calls.append("setup")
        time.sleep(3e-3)  # 3 ms of host work: counted, it would triple the 1 ms kernel

    times = time_cuda(
        _kernel(fake_cuda, 1.0),
        warmup=1,
        iters=4,
        setup=setup,
        barrier=lambda: fake_cuda.log.append("barrier"),
        flush_l2=False,
    )
    assert calls == ["setup"] * 5
    assert statistics.median(times) < 2.0, times
    timed = fake_cuda.log[fake_cuda.log.index("sync") + 1 :]  # after the warm-up's synchronize
    assert timed[:3] == ["sync", "barrier", "fn"] and timed.count("barrier") == 4, timed


def test_time_cuda_head_start_hides_host_dispatch(fake_cuda) -> None:
    # 1 ms of host time before a 0.2 ms kernel. The flush's ~2.5 ms spin covers the host time, so only
    # the kernel is timed; without it the events bracket the host's pace (>= 1 ms per call).
    fn = _host(1.0, _kernel(fake_cuda, 0.2))
    flushed = statistics.median(time_cuda(fn, warmup=1, iters=5))
    assert fake_cuda.log.count("flush") == 5
    assert 0.2 - EPS <= flushed < 0.6, flushed
    fake_cuda.log.clear()
    bare = statistics.median(time_cuda(fn, warmup=1, iters=5, flush_l2=False))
    assert "flush" not in fake_cuda.log
    assert bare >= 1.0 - EPS, bare


class _Peer:
    """The other rank of a two-rank collective, as this rank's FakeCuda sees it: after each host barrier
    the peer's stream reaches its first collective ``skew_ms`` later than ours; once met, they stay met."""

    def __init__(self, cuda: FakeCuda, skew_ms: float) -> None:
        self.cuda, self.skew_ms, self.pending = cuda, skew_ms, 0.0

    def barrier(self) -> None:
        self.cuda.log.append("barrier")
        self.pending = self.skew_ms

    def collective(self, log: str) -> Callable[[], None]:
        def fn() -> None:
            self.cuda.log.append(log)
            self.cuda.busy_until = max(time.perf_counter(), self.cuda.busy_until) + self.pending * 1e-3
            self.pending = 0.0

        return fn


def test_time_cuda_align_keeps_rank_skew_out_of_the_timed_call(fake_cuda) -> None:
    # A 1 ms kernel ending in a collective, with the peer released 2 ms later by each host barrier.
    peer = _Peer(fake_cuda, skew_ms=2.0)
    kernel, meet = _kernel(fake_cuda, 1.0), peer.collective("allreduce")

    def fn() -> None:
        kernel()
        meet()

    skewed = time_cuda(fn, warmup=1, iters=4, barrier=peer.barrier)
    assert min(skewed) >= 3.0 - EPS, skewed  # the early rank timed its wait for the late one
    fake_cuda.log.clear()
    aligned = time_cuda(fn, warmup=1, iters=4, barrier=peer.barrier, align=peer.collective("align"))
    for t in aligned:
        assert 1.0 - EPS <= t < 1.5, aligned
    timed = fake_cuda.log[fake_cuda.log.index("sync") + 1 :]
    assert timed[:5] == ["sync", "barrier", "flush", "align", "fn"], timed
    assert timed.count("align") == 4, timed


def test_time_cuda_rejects_hooks_that_are_not_callable(fake_cuda) -> None:
    for name in ("setup", "barrier", "align"):
        with pytest.raises(TypeError, match=f"^time_cuda: {name} must be callable or None, got int"):
            time_cuda(_kernel(fake_cuda, 0.1), iters=1, **{name: 3})
    assert fake_cuda.log == []


def test_device_barrier_needs_an_initialised_nccl_group() -> None:
    with pytest.raises(RuntimeError, match=r"^device_barrier: torch\.distributed is not initialised"):
        device_barrier()
    (result,) = run_workers(_device_barrier_on_gloo, 1)
    assert result == "device_barrier: group must use the nccl backend (a device-side collective), got 'gloo'"


def _device_barrier_on_gloo(rank: int, world: int) -> str:
    try:
        device_barrier()
    except ValueError as exc:
        return str(exc)
    return "accepted a gloo group"


def test_time_loop_counts_host_gaps(fake_cuda) -> None:
    gpu_bound = time_loop(_kernel(fake_cuda, 1.0), iters=10, warmup=2)
    assert 1.0 - EPS <= gpu_bound < 1.5, gpu_bound
    host_bound = time_loop(_host(2.0, _kernel(fake_cuda, 0.1)), iters=10, warmup=1)
    assert 2.0 <= host_bound < 4.0, host_bound


def test_host_ms_measures_host_time(fake_cuda) -> None:
    ms = host_ms(_host(1.0, _kernel(fake_cuda, 0.01)), iters=10, warmup=2)
    assert ms is not None and 1.0 <= ms < 3.0, ms


def test_host_ms_is_none_when_a_call_waits_for_the_gpu(fake_cuda) -> None:
    assert host_ms(torch.cuda.synchronize, iters=5, warmup=1) is None
    # Calls that outlast the ~0.1 s spin (20 x 10 ms) are not host time either.
    assert host_ms(_host(10.0), iters=20, warmup=0) is None


@pytest.mark.parametrize("timer", [time_cuda, host_ms, time_loop], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"iters": 0}, ValueError, "iters must be >= 1, got 0"),
        ({"iters": 2.0}, TypeError, "iters must be an int, got float"),
        ({"iters": True}, TypeError, "iters must be an int, got bool"),
        ({"warmup": -1}, ValueError, "warmup must be >= 0, got -1"),
        ({"fn": None}, TypeError, "fn must be callable, got NoneType"),
    ],
)
def test_timers_validate_before_touching_cuda(fake_cuda, timer, kwargs, error, words) -> None:
    args = {"fn": _kernel(fake_cuda, 0.1), **kwargs}
    fn = args.pop("fn")
    with pytest.raises(error, match=f"^{timer.__name__}: {words}"):
        timer(fn, **args)
    assert fake_cuda.log == []  # refused before any call, synchronize or flush


# ---------------------------------------------------------------- the same on a real GPU


def _spin_ms(cycles: int) -> float:
    """Median GPU time of one ``torch.cuda._sleep(cycles)``, bracketed by events directly."""
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end))
    return statistics.median(runs)


@pytest.mark.gpu
def test_timers_measure_a_known_kernel_on_gpu() -> None:
    cycles = 20_000_000  # ~10 ms at 2 GHz: far above launch overheads and timer resolution
    want = _spin_ms(cycles)
    assert want > 2.0, f"_sleep({cycles}) took {want:.3f} ms; expected several ms at any GPU clock"
    spin = lambda: torch.cuda._sleep(cycles)
    for name, got in (
        ("time_cuda", statistics.median(time_cuda(spin, warmup=1, iters=5))),
        ("time_cuda(flush_l2=False)", statistics.median(time_cuda(spin, warmup=1, iters=5, flush_l2=False))),
        ("time_loop", time_loop(spin, iters=5, warmup=1)),
    ):
        assert 0.8 * want <= got <= 1.25 * want, f"{name}: {got:.3f} ms vs {want:.3f} ms measured directly"
    launch = host_ms(lambda: torch.cuda._sleep(1000), iters=10)
    assert launch is not None and 0.0 < launch < 1.0, launch
    assert host_ms(torch.cuda.synchronize, iters=5) is None


def _skewed_collective(rank: int, world: int, use_align: bool) -> list[float]:
    """Rank 1 enters every timed call ~20 ms of host time after rank 0; the call is a short spin then an
    all-reduce, so without a device-side meeting point rank 0 times its wait for rank 1."""
    import torch.distributed as dist

    x = torch.randn(1 << 20, device="cuda")
    late = (lambda: time.sleep(0.02)) if rank == 1 else (lambda: None)

    def fn() -> None:
        torch.cuda._sleep(1_000_000)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)

    align = device_barrier() if use_align else None
    return time_cuda(fn, warmup=2, iters=6, barrier=lambda: (dist.barrier(), late()), align=align)


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("use_align", [False, True], ids=["host-barrier", "aligned"])
def test_device_barrier_aligns_two_gpus(use_align: bool) -> None:
    rank0, rank1 = run_workers(_skewed_collective, 2, use_align, backend="nccl")
    slow = statistics.median(rank0)
    if use_align:
        assert slow < 10.0, f"aligned: rank 0 still timed rank 1's 20 ms lateness ({rank0})"
        assert statistics.median(rank1) < 10.0, rank1
    else:
        # the control: the harness really produces the skew that align removes
        assert slow >= 15.0, f"expected rank 0 to wait ~20 ms for rank 1 without align, got {rank0}"
