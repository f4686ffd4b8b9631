"""Shared pieces of every layer's benchmark: timing, memory, provenance, result files, a progress bar.

Timing uses CUDA events around each call (after a warm-up), with fixed iteration counts so that
collective benchmarks stay in lock step across ranks (``triton.testing.do_bench`` picks a repeat
count per process, which hangs collectives). The timers refuse a non-callable ``fn``, ``iters < 1``
and ``warmup < 0`` before any CUDA work. Results go to ``<out>/<stem>.json`` and ``.csv`` with
provenance (GPU, driver, torch, triton, commit, date), and a PNG when matplotlib is installed.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Record:
    """One measurement: a provider running one case."""

    bench: str  # e.g. "rms_norm"
    provider: str  # e.g. "lck", "torch", "torch_compile", "liger"
    mode: str  # "fwd", "fwd_bwd", ...
    shape: str  # human-readable case, e.g. "16384x4096"
    dtype: str
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    peak_mib: float | None = None  # peak allocated during the call, above what was live before it
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _git_commit() -> str | None:
    if os.environ.get("LCK_COMMIT"):
        return os.environ["LCK_COMMIT"]
    git = shutil.which("git")
    if not git:
        return None
    try:
        out = subprocess.run([git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run([git, "status", "--porcelain", "-uno"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance() -> dict[str, Any]:
    """GPU, driver, library versions, commit and date of the run."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            gpu=p.name,
            gpu_count=torch.cuda.device_count(),
            sms=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    else:
        info.update(gpu=None, driver=None)
    for env in ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        if env in os.environ:
            info.setdefault("env", {})[env] = os.environ[env]
    return info


def gpu_slug() -> str:
    """A file-name-safe GPU name, e.g. ``h200``; ``cpu`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").split("-")[0] or "gpu"


def _check_timing_args(where: str, fn: Any, iters: Any, warmup: Any) -> None:
    """Raise before any CUDA work: a bad count would otherwise surface as an empty list or a division by 0."""
    if not callable(fn):
        raise TypeError(f"{where}: fn must be callable, got {type(fn).__name__}")
    for name, value, low in (("iters", iters, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
        if value < low:
            raise ValueError(f"{where}: {name} must be >= {low}, got {value}")


def time_cuda(
    fn: Callable[[], Any],
    *,
    warmup: int = 5,
    iters: int = 30,
    setup: Callable[[], Any] | None = None,
    barrier: Callable[[], None] | None = None,
    align: Callable[[], Any] | None = None,
    flush_l2: bool = True,
) -> list[float]:
    """Milliseconds per call of ``fn``, measured with CUDA events, one pair per call.

    ``setup`` runs before each call outside the timed region (e.g. zeroing grads). ``barrier`` runs
    before each timed call, after a device sync, to keep collective benchmarks in lock step. The
    iteration counts are fixed, never adaptive, so every rank runs exactly the same sequence.

    ``align`` (for collectives, e.g. :func:`device_barrier`) is enqueued on the device just before each
    start event. A host barrier releases the ranks tens to hundreds of microseconds apart, and without
    a device-side meeting point the first collective inside ``fn`` absorbs that skew, so the early rank
    times its wait for the late one. With ``align`` every rank's events start when the ranks' streams
    meet, as they do in a training step that follows other collectives.

    ``flush_l2`` writes a 256 MiB buffer before each call, outside the timed region. It evicts the
    previous call's data from L2 (an H200 has 50 MB), so inputs come from HBM as in training, and it
    then spins the GPU for ~2.5 ms while the host enqueues the call: without that head start, a
    sub-0.1 ms kernel behind tens of microseconds of Python dispatch is timed as the host's launch
    rate, not the kernel. (0.5 ms was too short: an autograd forward+backward of a small op costs 0.4 to
    0.9 ms of host time on the H200 machine, measured with :func:`host_ms`.) For the time back to back,
    dispatch gaps included, use :func:`time_loop`.
    """
    _check_timing_args("time_cuda", fn, iters, warmup)
    for name, hook in (("setup", setup), ("barrier", barrier), ("align", align)):
        if hook is not None and not callable(hook):
            raise TypeError(f"time_cuda: {name} must be callable or None, got {type(hook).__name__}")
    import torch

    flush = _l2_flush_buffer() if flush_l2 else None

    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if setup is not None:
            setup()
        if barrier is not None:
            torch.cuda.synchronize()
            barrier()
        if flush is not None:
            flush.zero_()
            # ~2.5 ms of GPU spin outside the timed region: the host enqueues the call meanwhile, so
            # the events bracket GPU execution rather than host dispatch (the same for every provider).
            torch.cuda._sleep(5_000_000)
        if align is not None:
            align()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def device_barrier(group: Any = None) -> Callable[[], None]:
    """A device-side meeting point for :func:`time_cuda`'s ``align``: an all-reduce of one element over
    ``group`` (default WORLD) on the current stream, so it completes on every rank at about the same
    moment without blocking the host. Built once per group; every rank of the group must call it."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("device_barrier: torch.distributed is not initialised")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"device_barrier: group must be a ProcessGroup or None, got {type(group).__name__}")
    if dist.get_backend(group) != "nccl":
        raise ValueError(
            f"device_barrier: group must use the nccl backend (a device-side collective), "
            f"got {dist.get_backend(group)!r}"
        )
    token = torch.ones(1, device="cuda")  # its value is never read: only the meeting matters

    def align() -> None:
        dist.all_reduce(token, op=dist.ReduceOp.MAX, group=group)

    return align


def host_ms(fn: Callable[[], Any], *, iters: int = 20, warmup: int = 3) -> float | None:
    """Median host milliseconds per call of ``fn``: Python, dispatch and launch cost, not GPU time.

    The GPU is kept busy (a long spin is queued first) so no call waits for the device; ``fn`` must not
    synchronise: one that does (a ``.item()``, a data-dependent shape) waits out the spin, and the result
    is ``None`` rather than a number that is really GPU time (also when the calls outlast the ~0.1 s spin).
    When this exceeds the GPU time, back-to-back calls run at the host's pace, whatever the kernels' speed.
    """
    _check_timing_args("host_ms", fn, iters, warmup)
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    spun = torch.cuda.Event()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin: the host runs ahead of it for every call below
    spun.record()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    # The spin ended inside the loop: a call waited for the GPU, or the calls outlasted the spin.
    waited = spun.query()
    torch.cuda.synchronize()
    return None if waited else statistics.median(times)


def time_loop(fn: Callable[[], Any], *, iters: int = 50, warmup: int = 5) -> float:
    """Milliseconds per call of ``fn`` called back to back, as in a training loop: one pair of CUDA events
    around ``iters`` calls, no L2 flush and no head start, so host dispatch gaps count when the host is
    slower than the kernels (compare with :func:`time_cuda`, which measures the GPU alone)."""
    _check_timing_args("time_loop", fn, iters, warmup)
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


_FLUSH: dict[int, Any] = {}


def _l2_flush_buffer() -> Any:
    import torch

    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 * 2**20, dtype=torch.int8, device=f"cuda:{dev}")
    return _FLUSH[dev]


def summarize(times: Sequence[float]) -> dict[str, float]:
    ts = sorted(times)
    q = lambda f: ts[min(len(ts) - 1, int(f * (len(ts) - 1) + 0.5))]
    return {"median_ms": statistics.median(ts), "p20_ms": q(0.2), "p80_ms": q(0.8)}


def peak_memory_mib(fn: Callable[[], Any]) -> float:
    """Peak CUDA memory allocated while ``fn`` runs, above what was allocated before it (MiB)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


class Progress:
    """A dependency-free progress bar on stderr (one line, rewritten in place when a TTY)."""

    def __init__(self, total: int, label: str = ""):
        self.total, self.label, self.done, self.t0 = max(total, 1), label, 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, note: str = "") -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = f"{self.label} [{bar}] {self.done}/{self.total} {time.monotonic() - self.t0:5.0f}s {note}"
        if self.tty:
            sys.stderr.write("\r" + line[:160].ljust(160))
            if self.done >= self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def write_results(
    records: Iterable[Record],
    out_dir: str | os.PathLike[str],
    stem: str,
    *,
    meta: dict[str, Any] | None = None,
    plot: Callable[[list[Record], Path], None] | None = None,
) -> dict[str, Path]:
    """Write ``<stem>.json`` (provenance + records), ``<stem>.csv`` and, if given, ``<stem>.png``."""
    recs = list(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "csv": out / f"{stem}.csv"}
    payload = {"provenance": provenance(), "meta": meta or {}, "records": [asdict(r) for r in recs]}
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n")
    cols = [
        "bench",
        "provider",
        "mode",
        "shape",
        "dtype",
        "median_ms",
        "p20_ms",
        "p80_ms",
        "peak_mib",
        "error",
    ]
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*cols, "extra"])
        for r in recs:
            d = asdict(r)
            w.writerow([d[c] for c in cols] + [json.dumps(d["extra"], default=str) if d["extra"] else ""])
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            print("benchmark: matplotlib not installed, no PNG written", file=sys.stderr)
        else:
            paths["png"] = out / f"{stem}.png"
            plot(recs, paths["png"])
    return paths


def bar_plot(recs: list[Record], path: Path, *, title: str, value: str = "median_ms") -> None:
    """One panel per (bench, mode); grouped bars per shape, one bar per provider."""
    import matplotlib.pyplot as plt

    panels = sorted({(r.bench, r.mode) for r in recs})
    cols = min(3, len(panels)) or 1
    rows = (len(panels) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (bench, mode) in zip(axes.flat, panels):
        sub = [r for r in recs if r.bench == bench and r.mode == mode and getattr(r, value) is not None]
        shapes = list(dict.fromkeys(r.shape for r in sub))
        providers = list(dict.fromkeys(r.provider for r in sub))
        w = 0.8 / max(len(providers), 1)
        for i, prov in enumerate(providers):
            xs, ys = [], []
            for j, s in enumerate(shapes):
                hit = [getattr(r, value) for r in sub if r.provider == prov and r.shape == s]
                if hit:
                    xs.append(j + i * w)
                    ys.append(hit[0])
            ax.bar(xs, ys, width=w, label=prov)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{bench} {mode}")
        ax.set_ylabel("ms (median)" if value == "median_ms" else value)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
