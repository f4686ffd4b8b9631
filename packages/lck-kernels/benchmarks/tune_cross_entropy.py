"""Tune the cross-entropy kernels' launch parameters on this GPU (about two minutes on an H200).

    python packages/lck-kernels/benchmarks/tune_cross_entropy.py [--out DIR] [--budget-s 110]

At 8192 × 128256 bf16 it sweeps, through ``lck_kernels._common.tuning``:

1. ``cross_entropy_fwd_grad`` (loss and gradient in one kernel: the training path): look-ahead loads,
   tile, warps, persistent grid; then eviction hints off and pipelining depth for the two best;
2. ``cross_entropy_fwd`` (loss only: one read of the logits);
3. ``cross_entropy_bwd`` (gradient from a saved lse: the backward of the fused linear ops' recompute path);
4. the fused linear cross entropy's ``chunk_bytes`` at 8192 × 4096 → 128256 (forward+backward time and the
   working memory beyond the gradients).

It reports milliseconds and bandwidth as a fraction of this GPU's measured device-to-device copy rate
(targets: forward ≥ 85 %, cross entropy forward+backward ≤ 1.30 ms, fused linear ≤ 36 ms with ≤ 0.6 GB),
times the whole ``cross_entropy`` forward+backward with the best configuration, prints the overrides to
copy into ``_cross_entropy_kernels._DEFAULTS``, and writes ``tune-cross-entropy-<gpu>-<date>.{json,csv}``.
Configurations past the time budget are skipped (the most informative run first).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import sys
import time
from pathlib import Path

import torch

from lck_runtime.benchmarking import Record, gpu_slug, summarize, time_cuda, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
N, V, H = 8192, 128256, 4096


def _copy_rate() -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB buffer)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = summarize(time_cuda(lambda: dst.copy_(src), warmup=3, iters=20))["median_ms"]
    return 2 * src.numel() / (ms * 1e-3)


class Sweep:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s, self.records = time.monotonic(), budget_s, []

    def left(self) -> bool:
        return time.monotonic() - self.t0 < self.budget_s

    def run(
        self, kernel: str, params: dict, fn, nbytes: float | None, copy_rate: float, *, iters=20
    ) -> float | None:
        from lck_kernels._common import tuning

        rec = Record(kernel, _label(params), "tune", f"{N}x{V}", "bfloat16")
        if not self.left():
            rec.error = "skipped: over the time budget"
            self.records.append(rec)
            return None
        try:
            with tuning(kernel, **params):
                rec.__dict__.update(summarize(time_cuda(fn, warmup=3, iters=iters)))
        except Exception as exc:  # a configuration that does not compile or launch is a result, not a crash
            rec.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            print(f"  {kernel:<24} {_label(params):<60} error {rec.error}", flush=True)
            self.records.append(rec)
            return None
        if nbytes:
            rec.extra["gb_per_s"] = nbytes / (rec.median_ms * 1e-3) / 1e9
            rec.extra["of_copy_rate"] = nbytes / (rec.median_ms * 1e-3) / copy_rate
        rec.extra["params"] = params
        self.records.append(rec)
        frac = f"{rec.extra['of_copy_rate']:6.1%}" if nbytes else ""
        print(f"  {kernel:<24} {_label(params):<60} {rec.median_ms:8.3f} ms {frac}", flush=True)
        return rec.median_ms


def _label(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def _grid(**axes) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


def _best(sweep: Sweep, kernel: str, k: int = 1) -> list[dict]:
    done = [r for r in sweep.records if r.bench == kernel and r.median_ms is not None]
    return [r.extra["params"] for r in sorted(done, key=lambda r: r.median_ms)[:k]]


def _sweep_cross_entropy(sweep: Sweep, copy_rate: float) -> dict[str, dict]:
    from lck_kernels._common import tuning
    from lck_kernels._cross_entropy_launch import CEOptions, launch_bwd, launch_reduction
    from lck_kernels.cross_entropy import cross_entropy

    gen = torch.Generator("cuda").manual_seed(0)
    logits = (torch.randn(N, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, V, (N,), device="cuda", generator=gen)
    nbytes = logits.numel() * logits.element_size()
    fwd_op = torch.ops.lck.cross_entropy_fwd

    print("1. loss + gradient in one kernel (cross_entropy_fwd_grad)", flush=True)
    grad_fn = lambda: fwd_op(logits, target, None, -100, 0.0, 0.0, 0.0, "mean", True)
    grid = _grid(
        prefetch=(1, 0), block_bytes=(16384, 32768), warps=(32, 16), programs_per_sm=(1, 2, 0), evict=(1,)
    )
    for p in grid:
        sweep.run("cross_entropy_fwd_grad", p, grad_fn, 2 * nbytes, copy_rate)
    for p in _best(sweep, "cross_entropy_fwd_grad", 2):
        sweep.run("cross_entropy_fwd_grad", {**p, "evict": 0}, grad_fn, 2 * nbytes, copy_rate)
        sweep.run("cross_entropy_fwd_grad", {**p, "stages": 2}, grad_fn, 2 * nbytes, copy_rate)

    print("2. loss only (cross_entropy_fwd)", flush=True)
    loss_fn = lambda: fwd_op(logits, target, None, -100, 0.0, 0.0, 0.0, "mean", False)
    for p in _grid(block_bytes=(16384, 8192, 32768), warps=(16, 8, 32), prefetch=(0, 1)):
        sweep.run("cross_entropy_fwd", p, loss_fn, nbytes, copy_rate)
    for p in _best(sweep, "cross_entropy_fwd", 2):
        sweep.run("cross_entropy_fwd", {**p, "programs_per_sm": 4}, loss_fn, nbytes, copy_rate)

    print("3. gradient from a saved lse (cross_entropy_bwd)", flush=True)
    red = launch_reduction(target, None, V, -100, mean=True, wrap=False)
    lse = torch.logsumexp(logits.float(), -1)
    grad = torch.empty_like(logits)
    one = torch.ones((), device="cuda")
    bwd_fn = lambda: launch_bwd(
        logits, grad, target, None, red, CEOptions(), lse=lse, entropy=None, g_loss=one, g_lse=None,
        g_entropy=None, wrap=False,
    )  # fmt: skip
    for p in _grid(block_bytes=(32768, 16384), warps=(16, 8), programs_per_sm=(0, 4)):
        sweep.run("cross_entropy_bwd", p, bwd_fn, 2 * nbytes, copy_rate)

    kernels = ("cross_entropy_fwd_grad", "cross_entropy_fwd", "cross_entropy_bwd")
    best = {k: (_best(sweep, k) or [{}])[0] for k in kernels}
    leaf = logits.clone().requires_grad_(True)
    with tuning("cross_entropy_fwd_grad", **best["cross_entropy_fwd_grad"]):
        full = summarize(time_cuda(lambda: torch.autograd.grad(cross_entropy(leaf, target), leaf), iters=20))
    print(f"cross_entropy fwd+bwd with the best configuration: {full['median_ms']:.3f} ms (target <= 1.30)")
    rec = Record(
        "cross_entropy_autograd", _label(best["cross_entropy_fwd_grad"]), "fwd_bwd", f"{N}x{V}", "bfloat16"
    )
    rec.__dict__.update(full)
    sweep.records.append(rec)
    return best


def _sweep_chunk_budget(sweep: Sweep, best_grad: dict) -> None:
    from lck_kernels._common import tuning
    from lck_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    print("4. fused linear cross entropy chunk budget", flush=True)
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, V, (N,), device="cuda", generator=gen)
    for mib in (512, 256, 768, 128):
        if not sweep.left():
            break

        def step(mib=mib):
            return torch.autograd.grad(
                fused_linear_cross_entropy(x, w, target, chunk_bytes=mib << 20), (x, w)
            )

        rec = Record(
            "fused_linear_cross_entropy", f"chunk_bytes={mib}MiB", "fwd_bwd", f"{N}x{H}x{V}", "bfloat16"
        )
        with tuning("cross_entropy_fwd_grad", **best_grad):
            rec.__dict__.update(summarize(time_cuda(step, warmup=2, iters=5)))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grads = step()
            torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads)
        rec.extra.update(extra_gb=extra / 1e9, tflop_per_s=6 * N * H * V / (rec.median_ms * 1e-3) / 1e12)
        sweep.records.append(rec)
        print(
            f"  chunk_bytes={mib:4d} MiB  {rec.median_ms:7.2f} ms  {rec.extra['tflop_per_s']:5.0f} TFLOP/s  "
            f"extra {extra / 1e9:.3f} GB  (targets: <= 36 ms, <= 0.6 GB)",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--budget-s", type=float, default=110.0, help="stop starting new configurations after this"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("tune_cross_entropy: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_rate = _copy_rate()
    print(f"device-to-device copy: {copy_rate / 1e9:.0f} GB/s", flush=True)
    sweep = Sweep(args.budget_s)
    best = _sweep_cross_entropy(sweep, copy_rate)
    torch.cuda.empty_cache()
    _sweep_chunk_budget(sweep, best["cross_entropy_fwd_grad"])
    print("\nbest overrides (copy into lck_kernels._cross_entropy_kernels._DEFAULTS):")
    for kernel, params in best.items():
        print(f"  {kernel!r}: {params}")
    stem = f"tune-cross-entropy-{gpu_slug()}-{_dt.date.today().isoformat()}"
    paths = write_results(
        sweep.records, args.out, stem, meta={"copy_rate_bytes_per_s": copy_rate, "best": best}
    )
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
