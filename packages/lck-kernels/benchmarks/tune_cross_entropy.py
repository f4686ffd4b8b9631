"""Tune the cross-entropy kernels' launch parameters on this GPU (about two minutes on an H200).

    python packages/lck-kernels/benchmarks/tune_cross_entropy.py [--out DIR] [--budget-s 120]

At 8192 × 128256 bf16 it sweeps, through ``lck_kernels._common.tuning``, most informative first:

1. ``cross_entropy_fwd_grad`` (loss and gradient in one kernel: the training path): the CUDA cluster kernel
   by blocks and threads; one program reads a whole row twice, the second pass last tile first or first
   tile first (``reverse``), by tile, warps and programs per SM, and on a fraction of the SMs (``sm_pct``:
   fewer rows in flight); rows split over teams of 2 or 4 programs (``split``: ``_ce_fwd_split_kernel``);
   then eviction hints off and no look-ahead for the two best. With ``--grad-only`` instead: the default
   against maxima per tile (``warp_max=0``) and variants of it (``--configs``);
2. the whole ``cross_entropy`` forward+backward with the best configuration (target ≤ 1.30 ms);
3. fused linear cross entropy at 8192 × 4096 → 128256: the time of each piece of one chunk (logits GEMM,
   row pass, the two gradient GEMMs, the weight-gradient GEMM accumulating or not), then forward+backward
   by ``chunk_bytes`` with and without ``overlap`` (row passes on a side stream between the GEMMs of
   neighbouring chunks), with the working memory beyond the gradients (targets ≤ 36 ms, ≤ 0.6 GB);
4. ``cross_entropy_fwd`` (loss only: one read of the logits; target ≥ 85% of the copy rate);
5. ``cross_entropy_bwd`` (gradient from a saved lse: the backward of the recompute path).

It reports milliseconds and bandwidth as a fraction of this GPU's measured device-to-device copy rate,
prints the overrides to copy into ``_cross_entropy_kernels._DEFAULTS`` (and the FLCE ``overlap`` verdict),
and writes ``tune-cross-entropy-<gpu>-<date>.{json,csv}``. Configurations past the time budget are skipped.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
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
        self, kernel: str, params: dict, fn, nbytes: float | None, copy_rate: float, *, iters=20, check=None
    ) -> float | None:
        """Time ``fn`` under ``params``; ``check()`` (optional, run first) returns an error or None: a
        configuration that computes wrong values is reported and never chosen."""
        from lck_kernels._common import tuning

        rec = Record(kernel, _label(params), "tune", f"{N}x{V}", "bfloat16")
        if not self.left():
            rec.error = "skipped: over the time budget"
            self.records.append(rec)
            return None
        try:
            with tuning(kernel, **params):
                wrong = check() if check is not None else None
                if wrong:
                    raise ValueError(f"wrong result: {wrong}")
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


def _ce_inputs():
    gen = torch.Generator("cuda").manual_seed(0)
    logits = (torch.randn(N, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, V, (N,), device="cuda", generator=gen)
    return logits, target


def _sweep_fwd_grad(
    sweep: Sweep, copy_rate: float, logits, target, *, quick: bool = False, configs: list[dict] | None = None
) -> dict:
    import lck_kernels.cross_entropy  # noqa: F401  (registers torch.ops.lck.cross_entropy_*)

    nbytes = logits.numel() * logits.element_size()
    fwd_op = torch.ops.lck.cross_entropy_fwd
    print("1. loss + gradient in one kernel (cross_entropy_fwd_grad)", flush=True)
    grad_fn = lambda: fwd_op(logits, target, None, -100, 0.0, 0.0, 0.0, "mean", True)
    kernel = "cross_entropy_fwd_grad"
    # Every configuration must reproduce the Triton default's loss and gradient (the split kernel's teams
    # and the CUDA kernel's clusters cooperate through memory: a scheduling or ordering fault shows up as
    # NaN or wrong rows here).
    from lck_kernels._common import tuning

    with tuning(kernel, cuda=0):
        ref_loss, _, _, ref_grad, _ = grad_fn()
    rows = torch.arange(0, N, 97, device=logits.device)

    def check() -> str | None:
        loss, _, _, grad, _ = grad_fn()
        g, r = grad[rows].float(), ref_grad[rows].float()
        if not torch.isfinite(loss).item() or not torch.isfinite(g).all().item():
            return "NaN or inf"
        if abs(loss.item() - ref_loss.item()) > 1e-4 * abs(ref_loss.item()):
            return f"loss {loss.item()} vs {ref_loss.item()}"
        if ((g - r).norm() / r.norm()).item() > 1e-2:
            return f"gradient differs by {((g - r).norm() / r.norm()).item():.2e}"
        return None

    base = {"prefetch": 1, "block_bytes": 32768, "warps": 32, "evict": 1, "split": 1, "cuda": 0}
    if quick:  # maxima per tile (the default before 2026-11-30) against per warp-wide strip and its variants
        tiles = {**base, "reverse": 0, "programs_per_sm": 0, "warp_max": 0, "grad_ahead": 0}
        sweep.run(kernel, tiles, grad_fn, 2 * nbytes, copy_rate, check=check)
        strips = {**tiles, "warp_max": 1, "grad_ahead": 1}
        for p in configs or (
            {}, {"grad_ahead": 0}, {"programs_per_sm": 1}, {"prefetch": 0}, {"block_bytes": 16384},
            {"block_bytes": 65536}, {"block_bytes": 16384, "warps": 16},
            {"block_bytes": 16384, "warps": 16, "programs_per_sm": 2}, {"reverse": 1},
        ):  # fmt: skip
            sweep.run(kernel, {**strips, **p}, grad_fn, 2 * nbytes, copy_rate, check=check)
        return (_best(sweep, kernel) or [{}])[0]
    # The CUDA cluster kernel (one read of each row, kept in shared memory): blocks per row and threads per
    # block. 8 blocks of 512 threads fit two blocks per SM; 4 blocks use 128 KiB of shared memory, one per SM.
    from lck_kernels.cross_entropy import cuda as _cross_entropy_cuda

    for p in _grid(cluster=(4, 8), threads=(1024, 512, 256)):
        sweep.run(kernel, {"cuda": 1, **p}, grad_fn, 2 * nbytes, copy_rate, check=check)
    # (kernel, device, threads, cluster, shared bytes) -> clusters resident at once (the grid's cluster count)
    print("  resident clusters:", {k[2:]: v for k, v in _cross_entropy_cuda._RESIDENT.items()}, flush=True)
    # The second pass last tile first (reverse=1) against first tile first, then tiles and warps; teams
    # (split) last: on 2026-11-30 they were slower at every size (2: 1.89 ms, 4: 2.45, 8: 3.7-5.9 against
    # 1.54 without), the waits for partners' records costing more than the L2 hits gain.
    for p in _grid(reverse=(1, 0), programs_per_sm=(0, 1)):
        sweep.run(kernel, {**base, **p}, grad_fn, 2 * nbytes, copy_rate, check=check)
    # One program per SM streams only what it has in flight (on 2026-11-30 half the SMs took 1.83x the
    # time): a deeper look-ahead (prefetch=2) and a look-ahead in the gradient pass (grad_ahead) raise a
    # program's bandwidth, so fewer rows in flight (sm_pct < 100: a smaller L2 working set between a
    # tile's two reads) might keep the HBM busy while the re-read hits L2.
    deep = {**base, "prefetch": 2, "grad_ahead": 1}
    for p in _grid(sm_pct=(100, 75, 50), block_bytes=(32768, 16384)):
        sweep.run(kernel, {**deep, "programs_per_sm": 1, **p}, grad_fn, 2 * nbytes, copy_rate, check=check)
    sweep.run(kernel, {**deep, "programs_per_sm": 0}, grad_fn, 2 * nbytes, copy_rate, check=check)
    sweep.run(
        kernel, {**base, "grad_ahead": 1, "programs_per_sm": 0}, grad_fn, 2 * nbytes, copy_rate, check=check
    )
    sweep.run(
        kernel, {**base, "prefetch": 2, "programs_per_sm": 0}, grad_fn, 2 * nbytes, copy_rate, check=check
    )
    for p in _grid(sm_pct=(50, 75), reverse=(0, 1)):
        sweep.run(kernel, {**base, "programs_per_sm": 1, **p}, grad_fn, 2 * nbytes, copy_rate, check=check)
    for p in _grid(block_bytes=(16384, 65536), warps=(32, 16), programs_per_sm=(0, 1)):
        sweep.run(kernel, {**base, "reverse": 1, **p}, grad_fn, 2 * nbytes, copy_rate, check=check)
    for p in _grid(split=(2, 4), programs_per_sm=(1,)):
        sweep.run(kernel, {**base, "reverse": 1, **p}, grad_fn, 2 * nbytes, copy_rate, check=check)
    for p in _best(sweep, kernel, 2):
        sweep.run(kernel, {**p, "evict": 0}, grad_fn, 2 * nbytes, copy_rate, check=check)
        sweep.run(kernel, {**p, "prefetch": 0}, grad_fn, 2 * nbytes, copy_rate, check=check)
    return (_best(sweep, kernel) or [{}])[0]


def _time_cross_entropy(sweep: Sweep, best_grad: dict, logits, target) -> None:
    from lck_kernels._common import tuning
    from lck_kernels.cross_entropy import cross_entropy

    leaf = logits.clone().requires_grad_(True)
    with tuning("cross_entropy_fwd_grad", **best_grad):
        full = summarize(time_cuda(lambda: torch.autograd.grad(cross_entropy(leaf, target), leaf), iters=20))
    print(
        f"2. cross_entropy fwd+bwd with the best configuration: {full['median_ms']:.3f} ms (target <= 1.30)"
    )
    rec = Record("cross_entropy_autograd", _label(best_grad), "fwd_bwd", f"{N}x{V}", "bfloat16")
    rec.__dict__.update(full)
    sweep.records.append(rec)


def _sweep_fwd_and_bwd(sweep: Sweep, copy_rate: float, logits, target) -> dict[str, dict]:
    import lck_kernels.cross_entropy  # noqa: F401  (registers torch.ops.lck.cross_entropy_*)
    from lck_kernels.cross_entropy.launch import CEOptions, launch_bwd, launch_reduction

    nbytes = logits.numel() * logits.element_size()
    fwd_op = torch.ops.lck.cross_entropy_fwd
    print("4. loss only (cross_entropy_fwd)", flush=True)
    loss_fn = lambda: fwd_op(logits, target, None, -100, 0.0, 0.0, 0.0, "mean", False)
    for p in _grid(block_bytes=(8192, 4096), warps=(8, 4), prefetch=(1, 0), warp_max=(0, 1)):
        sweep.run("cross_entropy_fwd", p, loss_fn, nbytes, copy_rate)
    for p in _best(sweep, "cross_entropy_fwd", 2):
        for per_sm in (2, 4):
            sweep.run("cross_entropy_fwd", {**p, "programs_per_sm": per_sm}, loss_fn, nbytes, copy_rate)

    print("5. gradient from a saved lse (cross_entropy_bwd)", flush=True)
    red = launch_reduction(target, None, V, -100, mean=True, wrap=False)
    lse = torch.logsumexp(logits.float(), -1)
    grad = torch.empty_like(logits)
    one = torch.ones((), device="cuda")
    bwd_fn = lambda: launch_bwd(
        logits, grad, target, None, red, CEOptions(), lse=lse, entropy=None, g_loss=one, g_lse=None,
        g_entropy=None, wrap=False,
    )  # fmt: skip
    for p in _grid(block_bytes=(16384, 32768), warps=(16, 8), programs_per_sm=(0,)):
        sweep.run("cross_entropy_bwd", p, bwd_fn, 2 * nbytes, copy_rate)
    return {k: (_best(sweep, k) or [{}])[0] for k in ("cross_entropy_fwd", "cross_entropy_bwd")}


def _flce_breakdown(sweep: Sweep, copy_rate: float, x, w, target, best_grad: dict) -> None:
    """Each piece of one chunk of the gradients-in-the-forward schedule, timed alone."""
    from lck_kernels._common import tuning
    from lck_kernels.cross_entropy.launch import CEOptions, launch_fwd, launch_reduction
    from lck_kernels.linear_cross_entropy import plan_chunk_tokens

    chunk = plan_chunk_tokens(N, V, 2)
    n_chunks = -(-N // chunk)
    xc, tc = x.detach()[:chunk], target[:chunk]
    wd = w.detach()
    buf = torch.mm(xc, wd.t())
    gx = torch.empty(chunk, H, device="cuda", dtype=x.dtype)
    gw = torch.zeros(V, H, device="cuda", dtype=x.dtype)
    red = launch_reduction(tc, None, V, -100, mean=True, wrap=False)
    rows = [torch.empty(chunk, device="cuda") for _ in range(3)]
    flop = 2 * chunk * H * V
    pieces = [
        ("logits GEMM x·Wt", lambda: torch.mm(xc, wd.t(), out=buf), flop),
        (
            "row pass (in place)",
            lambda: launch_fwd(
                buf,
                tc,
                None,
                red,
                CEOptions(),
                loss=rows[0],
                lse=rows[1],
                grad=buf,
                applied=rows[2],
                wrap=False,
            ),
            None,
        ),
        ("grad_x GEMM dl·W", lambda: torch.mm(buf, wd, out=gx), flop),
        ("grad_W GEMM dlt·x (accumulate)", lambda: gw.addmm_(buf.t(), xc), flop),
        ("grad_W GEMM dlt·x (first chunk)", lambda: torch.mm(buf.t(), xc, out=gw), flop),
    ]
    print(
        f"3a. fused linear cross entropy, one {chunk}-token chunk of {n_chunks}, each piece alone", flush=True
    )
    total = 0.0
    with tuning("cross_entropy_fwd_grad", **best_grad):
        for name, fn, f in pieces:
            if not sweep.left():
                break
            ms = summarize(time_cuda(fn, warmup=2, iters=10))["median_ms"]
            rec = Record("flce_piece", name, "chunk", f"{chunk}x{H}x{V}", "bfloat16", median_ms=ms)
            if f:
                rec.extra["tflop_per_s"] = f / (ms * 1e-3) / 1e12
                rate = f"{rec.extra['tflop_per_s']:5.0f} TFLOP/s"
            else:
                rec.extra["of_copy_rate"] = 2 * buf.numel() * 2 / (ms * 1e-3) / copy_rate
                rate = f"{rec.extra['of_copy_rate']:6.1%} of copy"
            sweep.records.append(rec)
            if "first" not in name:
                total += ms * (n_chunks if "accumulate" not in name else n_chunks - 1)
            else:
                total += ms
            print(f"  {name:<34} {ms:7.3f} ms  {rate}", flush=True)
    print(
        f"  sum over {n_chunks} chunks (first grad_W GEMM without accumulation): {total:.2f} ms", flush=True
    )


def _sweep_flce(sweep: Sweep, best_grad: dict, x, w, target) -> int:
    from lck_kernels._common import tuning
    from lck_kernels.linear_cross_entropy import fused_linear_cross_entropy

    print("3b. fused linear cross entropy fwd+bwd by chunk budget and overlap", flush=True)
    best_overlap, best_ms, ref_sample = 0, float("inf"), None
    for mib, overlap in ((512, 0), (512, 1), (1024, 1), (1024, 0), (384, 0), (768, 1), (256, 0)):
        if not sweep.left():
            break

        def step(mib=mib):
            return torch.autograd.grad(
                fused_linear_cross_entropy(x, w, target, chunk_bytes=mib << 20), (x, w)
            )

        label = f"chunk_bytes={mib}MiB overlap={overlap}"
        rec = Record("fused_linear_cross_entropy", label, "fwd_bwd", f"{N}x{H}x{V}", "bfloat16")
        with (
            tuning("cross_entropy_fwd_grad", **best_grad),
            tuning("fused_linear_cross_entropy", overlap=overlap),
        ):
            rec.__dict__.update(summarize(time_cuda(step, warmup=2, iters=5)))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grads = step()
            torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads)
        # The same gradients (sampled rows) in every configuration: chunking changes only rounding.
        sample = [grads[0][::97].float(), grads[1][::997].float()]
        del grads
        if ref_sample is None:
            ref_sample = sample
        diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(sample, ref_sample))
        if not diff <= 2e-2:
            rec.error = f"wrong result: gradients differ from the first configuration's by {diff:.2e}"
            print(f"  {label:<32} {rec.error}", flush=True)
            sweep.records.append(rec)
            continue
        rec.extra.update(extra_gb=extra / 1e9, tflop_per_s=6 * N * H * V / (rec.median_ms * 1e-3) / 1e12)
        sweep.records.append(rec)
        if mib == 512 and rec.median_ms < best_ms:
            best_overlap, best_ms = overlap, rec.median_ms
        print(
            f"  {label:<32} {rec.median_ms:7.2f} ms  {rec.extra['tflop_per_s']:5.0f} TFLOP/s  "
            f"extra {extra / 1e9:.3f} GB  (targets: <= 36 ms, <= 0.6 GB)",
            flush=True,
        )
    return best_overlap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--budget-s", type=float, default=120.0, help="stop starting new configurations after this"
    )
    parser.add_argument(
        "--grad-only",
        action="store_true",
        help="only steps 1, 2 and 4: maxima per tile against the default and its variants (~1 minute)",
    )
    parser.add_argument(
        "--configs",
        help="with --grad-only: a JSON list of overrides of the default (warp_max) configuration to time "
        'instead of the built-in list, e.g. \'[{"reverse": 1}, {"stages": 2}]\'',
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("tune_cross_entropy: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_rate = _copy_rate()
    print(f"device-to-device copy: {copy_rate / 1e9:.0f} GB/s", flush=True)
    sweep = Sweep(args.budget_s)
    logits, target = _ce_inputs()
    configs = json.loads(args.configs) if args.configs else None
    best = {
        "cross_entropy_fwd_grad": _sweep_fwd_grad(
            sweep, copy_rate, logits, target, quick=args.grad_only, configs=configs
        )
    }
    _time_cross_entropy(sweep, best["cross_entropy_fwd_grad"], logits, target)
    if args.grad_only:
        print("4. loss only (cross_entropy_fwd), by warp_max", flush=True)
        loss_fn = lambda: torch.ops.lck.cross_entropy_fwd(
            logits, target, None, -100, 0.0, 0.0, 0.0, "mean", False
        )
        nbytes = logits.numel() * logits.element_size()
        for p in _grid(warp_max=(0, 1), block_bytes=(4096, 8192, 16384), warps=(4, 8)):
            sweep.run("cross_entropy_fwd", p, loss_fn, nbytes, copy_rate)
        best["cross_entropy_fwd"] = (_best(sweep, "cross_entropy_fwd") or [{}])[0]
        stem = f"tune-cross-entropy-grad-{gpu_slug()}-{_dt.date.today().isoformat()}"
        write_results(sweep.records, args.out, stem, meta={"copy_rate_bytes_per_s": copy_rate, "best": best})
        print("best cross_entropy_fwd_grad:", best["cross_entropy_fwd_grad"])
        return 0
    del logits
    torch.cuda.empty_cache()
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16).requires_grad_(True)
    flce_target = torch.randint(0, V, (N,), device="cuda", generator=gen)
    _flce_breakdown(sweep, copy_rate, x, w, flce_target, best["cross_entropy_fwd_grad"])
    overlap = _sweep_flce(sweep, best["cross_entropy_fwd_grad"], x, w, flce_target)
    del x, w
    torch.cuda.empty_cache()
    logits, target = _ce_inputs()
    best.update(_sweep_fwd_and_bwd(sweep, copy_rate, logits, target))
    print("\nbest overrides (copy into lck_kernels.cross_entropy.kernels._DEFAULTS):")
    for kernel, params in best.items():
        print(f"  {kernel!r}: {params}")
    print(f"fused linear cross entropy at 512 MiB: overlap={overlap} was faster")
    best["fused_linear_cross_entropy"] = {"overlap": overlap}
    stem = f"tune-cross-entropy-{gpu_slug()}-{_dt.date.today().isoformat()}"
    paths = write_results(
        sweep.records, args.out, stem, meta={"copy_rate_bytes_per_s": copy_rate, "best": best}
    )
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
