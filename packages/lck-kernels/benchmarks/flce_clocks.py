"""Why fused linear CE runs slower than its GEMMs timed alone: SM clock and power while it runs.

    python packages/lck-kernels/benchmarks/flce_clocks.py [--out DIR] [--seconds 8]

On one GPU (8192 x 4096 -> 128256, bf16, 2048-token chunks as lck's default budget gives), five phases,
while ``nvidia-smi`` samples the SM clock, the power draw and the active clock-event reasons every 50 ms
(a 2 s rest before each of phases 4 and 5):

1. ``idle``: nothing queued (the baseline clock and power);
2. ``gemms_burst``: the GEMMs of the fused op (per chunk: logits, dlogits @ W, the dW update), one call
   at a time with a 50 ms pause between calls, so each call starts from a rested GPU;
3. ``gemms_sustained``: the same GEMMs back to back for ``--seconds``;
4. ``lck_flce_burst``: ``lck_kernels.fused_linear_cross_entropy`` forward+backward, one call at a time
   with the same 50 ms pause: the fused op under the GEMMs' rested protocol;
5. ``lck_flce_sustained``: the fused op back to back.

Each phase records ms per call (CUDA events), TFLOP/s of the GEMMs, and the median SM clock, the median
power and the share of samples in which the driver reported the software power cap. Writes
``flce-clocks-<gpu>-<date>.{json,csv,png}``: the records, and the samples as a time series in the JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lck_runtime.benchmarking import Record, gpu_slug, summarize, write_results

TOKENS, HIDDEN, VOCAB, CHUNK = 8192, 4096, 128256, 2048
FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
# Renamed from clocks_throttle_reasons in newer drivers; the sampler tries both spellings.
REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")


class Sampler:
    """``nvidia-smi`` in loop mode on one GPU; samples are (wall time, {field: value})."""

    def __init__(self, index: int, period_ms: int = 50):
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.error: str | None = None
        self._proc = None
        for prefix in ("clocks_event_reasons", "clocks_throttle_reasons"):
            query = ",".join((*FIELDS, *(f"{prefix}.{r}" for r in REASONS)))
            cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", f"-i={index}"]
            probe = subprocess.run(cmd, capture_output=True, text=True)
            if probe.returncode == 0:
                self._proc = subprocess.Popen([*cmd, f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
                break
            self.error = probe.stdout.strip() + probe.stderr.strip()
        if self._proc is not None:
            self.error = None
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        keys = (*FIELDS, *REASONS)
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(keys):
                continue
            row = {}
            for k, v in zip(keys, parts):
                if k in REASONS:
                    row[k] = 1.0 if v.lower() in ("active", "1") else 0.0
                else:
                    try:
                        row[k] = float(v)
                    except ValueError:
                        row[k] = float("nan")
            self.samples.append((time.time(), row))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        rows = [r for t, r in self.samples if t0 <= t <= t1]
        if not rows:
            return {"samples": 0}
        out: dict[str, float] = {"samples": len(rows)}
        for k in FIELDS:
            out[f"median_{k}"] = statistics.median(r[k] for r in rows)
        for k in REASONS:
            out[f"share_{k}"] = sum(r[k] for r in rows) / len(rows)
        return out

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)


def _gemms(x: torch.Tensor, w: torch.Tensor, logits: torch.Tensor, gx: torch.Tensor, gw: torch.Tensor):
    def run() -> None:
        for a in range(0, TOKENS, CHUNK):
            x_c = x[a : a + CHUNK]
            torch.mm(x_c, w.t(), out=logits)
            torch.mm(logits, w, out=gx[a : a + CHUNK])
            if a == 0:
                torch.mm(logits.t(), x_c, out=gw)
            else:
                gw.addmm_(logits.t(), x_c)

    return run


def _timed(fn, *, seconds: float, pause_s: float = 0.0) -> tuple[list[float], float, float]:
    """Calls of ``fn`` for about ``seconds``; (ms per call, wall start, wall end)."""
    fn()
    torch.cuda.synchronize()
    times, t0 = [], time.time()
    while time.time() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if pause_s:
            end.synchronize()
            times.append(start.elapsed_time(end))
            time.sleep(pause_s)
        else:
            times.append((start, end))
    torch.cuda.synchronize()
    t1 = time.time()
    times = [t if isinstance(t, float) else t[0].elapsed_time(t[1]) for t in times]
    return times, t0, t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--seconds", type=float, default=8.0, help="length of each sustained phase")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("flce_clocks: needs a CUDA GPU", file=sys.stderr)
        return 2
    if not args.seconds > 0:
        p.error(f"--seconds must be > 0, got {args.seconds}")
    from lck_kernels import fused_linear_cross_entropy

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(TOKENS, HIDDEN, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
    w = (torch.randn(VOCAB, HIDDEN, device=dev, generator=gen) / HIDDEN**0.5).to(torch.bfloat16)
    w.requires_grad_(True)
    target = torch.randint(0, VOCAB, (TOKENS,), device=dev, generator=gen)
    logits = torch.empty(CHUNK, VOCAB, device=dev, dtype=torch.bfloat16)
    gx, gw = torch.empty_like(x), torch.empty_like(w)
    gemms = _gemms(x.detach(), w.detach(), logits, gx, gw)
    flce = lambda: torch.autograd.grad(fused_linear_cross_entropy(x, w, target), (x, w))
    flops = 6 * TOKENS * HIDDEN * VOCAB
    visible = torch.cuda.get_device_properties(dev).uuid  # nvidia-smi indexes GPUs its own way
    index = _smi_index(str(visible))
    sampler = Sampler(index)
    records, series_from = [], time.time()
    shape = f"{TOKENS}x{HIDDEN}->{VOCAB}"
    try:
        time.sleep(0.5)
        t0 = time.time()
        time.sleep(2.0)
        phases: list[tuple[str, list[float], float, float]] = [("idle", [], t0, time.time())]
        phases.append(("gemms_burst", *_timed(gemms, seconds=args.seconds / 2, pause_s=0.05)))
        phases.append(("gemms_sustained", *_timed(gemms, seconds=args.seconds)))
        time.sleep(2.0)  # let the clock recover before the fused op, as before the GEMMs
        phases.append(("lck_flce_burst", *_timed(flce, seconds=args.seconds / 2, pause_s=0.05)))
        time.sleep(2.0)
        phases.append(("lck_flce_sustained", *_timed(flce, seconds=args.seconds)))
        time.sleep(0.3)
    finally:
        sampler.stop()
    for name, times, t0, t1 in phases:
        rec = Record("flce_clocks", name, "fwd_bwd" if times else "idle", shape, "bfloat16")
        if times:
            rec.__dict__.update(summarize(times))
            rec.extra["calls"] = len(times)
            rec.extra["tflop_per_s"] = flops / (rec.median_ms * 1e-3) / 1e12
            # The first and last quarter of a sustained phase: how the rate drifts as the GPU heats up.
            q = max(1, len(times) // 4)
            rec.extra["first_quarter_ms"] = statistics.median(times[:q])
            rec.extra["last_quarter_ms"] = statistics.median(times[-q:])
        # Skip the first 0.3 s of a window: the sampler's readings lag the work by a sample or two.
        rec.extra.update(sampler.window(t0 + 0.3, t1))
        records.append(rec)
    series = [{"t": round(t - series_from, 3), **r} for t, r in sampler.samples]
    meta = {
        "phases": {
            name: [round(t0 - series_from, 3), round(t1 - series_from, 3)] for name, _, t0, t1 in phases
        },
        "series": series,
        "sampler_error": sampler.error,
        "power_limit_w": _smi_one(index, "power.limit"),
        "max_sm_clock_mhz": _smi_one(index, "clocks.max.sm"),
        "gemm_flops_per_call": flops,
    }
    stem = f"flce-clocks-{gpu_slug()}-{_dt.date.today().isoformat()}"
    write_results(records, args.out, stem, meta=meta, plot=lambda recs, path: _plot(meta, path))
    print(f"{'phase':<22}{'ms/call':>9}{'TFLOP/s':>9}{'SM MHz':>8}{'W':>7}{'power cap':>10}")
    for r in records:
        e = r.extra
        print(
            f"{r.provider:<22}{(r.median_ms or 0):9.2f}{e.get('tflop_per_s', 0):9.0f}"
            f"{e.get('median_clocks.sm', float('nan')):8.0f}{e.get('median_power.draw', float('nan')):7.0f}"
            f"{e.get('share_sw_power_cap', float('nan')):10.0%}"
        )
    print(f"wrote {args.out / stem}.json/.csv/.png; power limit {meta['power_limit_w']} W")
    return 0


def _smi_index(uuid: str) -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        idx, _, gpu_uuid = line.partition(",")
        if uuid.replace("GPU-", "") in gpu_uuid:
            return int(idx)
    return 0


def _smi_one(index: int, field: str) -> Any:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", f"-i={index}"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        return float(out)
    except ValueError:
        return out or None


def _plot(meta: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    series = meta["series"]
    if not series:
        return
    t = [s["t"] for s in series]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    a1.plot(t, [s["clocks.sm"] for s in series], lw=1)
    a1.set_ylabel("SM clock (MHz)")
    a2.plot(t, [s["power.draw"] for s in series], lw=1, color="tab:red")
    a2.set_ylabel("power (W)")
    a2.set_xlabel("s")
    for name, (t0, t1) in meta["phases"].items():
        for ax in (a1, a2):
            ax.axvspan(t0, t1, alpha=0.08)
        a1.text((t0 + t1) / 2, a1.get_ylim()[1], name, ha="center", va="top", fontsize=7)
    fig.suptitle("fused linear CE 8192x4096->128256: SM clock and power per phase", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
