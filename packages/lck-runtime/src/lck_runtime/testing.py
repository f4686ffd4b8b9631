"""Real multi-process runs for tests and benchmarks: one process per rank over a file store.

``run_workers(fn, world_size)`` spawns ``world_size`` fresh interpreters, initialises
``torch.distributed`` in each (gloo on CPU, NCCL when ``backend="nccl"``, one GPU per rank), calls
``fn(rank, world_size, *args)`` and returns the per-rank results. Every join is bounded: a rank that
hangs fails the call with a :class:`WorkerTimeout` naming it instead of stalling the whole run, and a
rank that raises re-raises here as :class:`WorkerError` carrying each failing rank's traceback.
``fn`` must be importable by module path (a top-level function of a test module is). With
``LCK_TEST_STACK_DIR`` set, a worker still running after ``LCK_TEST_STACK_AFTER`` seconds (default 120) dumps
every thread's Python stack into a file there: what a stalled rank was doing when the run is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any


class WorkerError(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank → (exception type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]):
        self.errors = errors
        parts = [f"rank {r}: {name}: {msg}\n{tb}" for r, (name, msg, tb) in sorted(errors.items())]
        super().__init__(f"{len(errors)} rank(s) failed:\n" + "\n".join(parts))

    def messages(self) -> dict[int, str]:
        return {r: f"{name}: {msg}" for r, (name, msg, _) in self.errors.items()}


class WorkerTimeout(RuntimeError):
    """Some ranks did not finish within the timeout; ``results`` maps each rank that did to what it returned.

    The message shows those results too (each cut to its first and last ``SHOWN_CHARS // 2`` characters):
    a rank that failed early and returned its failure as data is often why the others are still waiting.
    """

    SHOWN_CHARS = 2000

    def __init__(self, message: str, results: dict[int, Any] | None = None):
        self.results = dict(results or {})
        parts = [
            f"rank {r} returned: {_cut(repr(v), self.SHOWN_CHARS)}" for r, v in sorted(self.results.items())
        ]
        super().__init__("\n".join([message, *parts]))


def _cut(text: str, limit: int) -> str:
    """Both ends of a long text: a returned traceback starts with where it ran and ends with the error."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ...({len(text) - 2 * half} characters left out)... {text[-half:]}"


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    env: dict[str, str],
    args: Sequence[Any],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.setdefault("LCK_TEST_RANK", str(rank))
    stacks = os.environ.get("LCK_TEST_STACK_DIR")
    if stacks:  # a worker still running after LCK_TEST_STACK_AFTER s writes every thread's Python stack there
        import faulthandler

        os.makedirs(stacks, exist_ok=True)
        sink = open(os.path.join(stacks, f"rank{rank}-of-{world_size}-pid{os.getpid()}.txt"), "w")
        faulthandler.dump_traceback_later(float(os.environ.get("LCK_TEST_STACK_AFTER", "120")), file=sink)
    try:
        import torch
        import torch.distributed as dist

        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=float(env.get("LCK_TEST_PG_TIMEOUT", "120"))),
            **kwargs,
        )
        out = fn(rank, world_size, *args)
        # Report before tearing down: a peer that is still stuck can block destroy_process_group,
        # and this rank's result must not be lost to that.
        results.put((rank, True, out))
    except BaseException as exc:  # report everything, including SystemExit from a test helper
        results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``env`` is applied in each rank before ``fn`` runs. Under a test without the ``gpu`` marker
    (``LCK_TEST_CPU=1``, set by lck's pytest plugin) the ranks see no GPU unless ``env`` names
    ``CUDA_VISIBLE_DEVICES``.

    Raises :class:`WorkerError` if any rank raised (after all ranks ended or the timeout passed) and
    :class:`WorkerTimeout` if some rank neither returned nor raised within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"run_workers: world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_workers: backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="lck-pg-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    child_env = {k: v for k, v in (env or {}).items()}
    if os.environ.get("LCK_TEST_CPU") == "1":  # a test of the CPU paths (pytest_plugin): ranks see no GPU
        child_env.setdefault("CUDA_VISIBLE_DEVICES", "")
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, init_file, backend, child_env, args, results),
            name=f"lck-rank{r}",
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    errors: dict[int, tuple[str, str, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if not p.is_alive() and r not in outs and r not in errors
                ]
                # A rank that died without reporting (segfault, os._exit) is an error, not a hang.
                for r in dead:
                    time.sleep(0.5)  # its report may still be in flight
                    try:
                        while True:
                            rr, ok2, pl = results.get_nowait()
                            (outs if ok2 else errors)[rr] = pl
                    except queue.Empty:
                        pass
                    if r not in outs and r not in errors:
                        errors[r] = ("ProcessDied", f"exit code {procs[r].exitcode}", "")
                continue
            (outs if ok else errors)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        try:
            os.unlink(init_file)
        except OSError:
            pass
    missing = [r for r in range(world_size) if r not in outs and r not in errors]
    if errors:
        raise WorkerError(errors)
    if missing:
        raise WorkerTimeout(f"ranks {missing} did not finish within {timeout:.0f} s (killed)", outs)
    del stuck  # ranks that reported but hung in teardown were killed above; their results stand
    return [outs[r] for r in range(world_size)]


# The NVSHMEM settings of a single-host GPU test (no remote transport, NVLink multicast off).
SINGLE_HOST_NVSHMEM_ENV = {
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NVLS": "1",
    "LCK_SETUP_TIMEOUT": "120",
}


def shared_gpu_env(world_size: int, num_gpus: int) -> dict[str, str]:
    """What ``world_size`` NVSHMEM ranks sharing ``num_gpus`` GPUs round-robin need: the opt-in
    (``LCK_NVSHMEM_SHARED_GPUS=1``) and each process's share of its GPU under CUDA MPS, so that the shares
    on one GPU sum to at most 100 (NVSHMEM creates teams across PEs of one GPU only under MPS, and its
    synchronising kernels need the PEs of a GPU resident at once)."""
    if num_gpus < 1 or world_size < num_gpus:
        raise ValueError(f"shared_gpu_env: need world_size >= num_gpus >= 1, got {world_size} and {num_gpus}")
    per_gpu = -(-world_size // num_gpus)
    return {"LCK_NVSHMEM_SHARED_GPUS": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // per_gpu)}


def mps_daemon_running() -> bool:
    """Whether a CUDA MPS control daemon answers on this machine (``CUDA_MPS_PIPE_DIRECTORY`` as set): the
    shared-GPU NVSHMEM tests need one and skip, saying how to start it, without."""
    from lck_runtime.nvshmem import mps_servers

    return mps_servers(attempts=5) is not None


SHARED_GPU_SKIP = (
    "needs a CUDA MPS control daemon for several NVSHMEM PEs per GPU: MPS=1 bash ci/device.sh <stages> starts "
    "a private one"
)


def error_text(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """``'Type: message'`` of what ``fn(*args, **kwargs)`` raised, or ``'<no error>'``: workers return it so
    that the test's assertions, not the worker, say what was expected."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "<no error>"


def assert_every_rank_says(outs: list[dict[str, str]], want: dict[str, str]) -> None:
    """Each ``want[key]`` is in every rank's ``outs[rank][key]``, and the ranks' texts are identical (what
    a collective check must give: the same answer everywhere, error or not)."""
    for key, text in want.items():
        got = {o[key] for o in outs}
        assert len(got) == 1, (key, got)
        assert text in got.pop(), (key, outs[0][key])
