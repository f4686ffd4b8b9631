"""Time Megatron's SwiGLU activation: lck (copy and in-place), megatron-core's bias_swiglu_impl, torch eager.

``lck bench megatron`` / ``python -m lck_megatron.benchmark`` runs the activation on the layout Megatron's
MLP really passes, ``[s, b, 2·ffn_local]`` bfloat16 (gate then up), at S=2048, B=4 for ffn_local 4096 and
32768: forward and forward+backward median milliseconds (CUDA events, fixed iteration counts; GPU time,
with the host's dispatch hidden), the same back to back as a training loop calls it (``loop_ms``, host
dispatch included, and the host's own cost ``host_ms``), and the peak memory of one forward+backward above
what was live before it. Each provider's output and input gradient are checked once against torch eager
before it is timed. Results go to
``<out>/swiglu-<gpu>-<date>.{json,csv,png}`` with provenance; a table with the speed-ups over megatron
and the in-place memory ratio is printed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = "megatron_swiglu"
PROVIDERS = ("lck", "lck_in_place", "megatron", "torch")
# Targets of issue 5, on the 3-D layout: fwd+bwd speed-up over megatron per ffn_local, and in-place memory.
SPEEDUP_TARGETS = {4096: 4.0, 32768: 5.0}
IN_PLACE_MEMORY_TARGET = 0.8


def _default_out() -> Path:
    pkg = Path(__file__).resolve().parents[2]  # packages/lck-megatron in a source checkout
    if (pkg / "pyproject.toml").exists() and (pkg / "benchmarks").is_dir():
        return pkg / "benchmarks" / "results"
    return Path("lck-megatron-bench")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lck bench megatron", description=__doc__.splitlines()[0])
    p.add_argument(
        "--ffn", type=int, nargs="+", default=[4096, 32768], help="ffn_local sizes (n of [s, b, 2n])"
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small shapes and few iterations (a smoke run)")
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default: the package's benchmarks/results)"
    )
    args = p.parse_args(argv)
    for name in ("seq", "batch", "iters", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.ffn):
        p.error(f"--ffn sizes must be positive, got {args.ffn}")
    if args.quick:
        args.ffn, args.seq, args.iters, args.warmup = [1024], 256, 10, 3
    return args


def _providers(names: list[str]) -> dict[str, Callable[[Any], Any] | str]:
    """name → ``f(y) -> out`` with Megatron's call convention, or an error string when unavailable."""
    import torch.nn.functional as F

    from lck_megatron.swiglu import LckMegatronSwiGLU

    out: dict[str, Callable[[Any], Any] | str] = {}
    for name in names:
        if name in ("lck", "lck_in_place"):
            module = LckMegatronSwiGLU(fallback_impl=None, in_place=name == "lck_in_place")
            out[name] = lambda y, m=module: m(y, None, False, False)
        elif name == "megatron":
            try:
                from lck_megatron.swiglu import megatron_bias_swiglu_impl

                impl = megatron_bias_swiglu_impl()
            except ImportError as exc:
                out[name] = f"megatron-core not importable: {exc}"
                continue
            out[name] = lambda y, f=impl: f(y, None, False, False)
        elif name == "torch":

            def eager(y: Any) -> Any:
                a, b = y.chunk(2, dim=-1)
                return F.silu(a) * b

            out[name] = eager
    return out


def _measure(
    name: str, fn: Callable[[Any], Any], s: int, b: int, n: int, iters: int, warmup: int
) -> list[Any]:
    import torch

    from lck_runtime.benchmarking import Record, host_ms, peak_memory_mib, summarize, time_cuda, time_loop

    shape, dtype = f"{s}x{b}x{2 * n}", "bfloat16"
    gen = torch.Generator(device="cuda").manual_seed(n)
    pristine = torch.randn(s, b, 2 * n, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(s, b, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = pristine.clone().requires_grad_(True)

    def restore() -> None:  # the in-place provider overwrites y with its gradient; every provider pays this
        with torch.no_grad():
            y.copy_(pristine)

    def fwd() -> Any:
        return fn(y)

    def fwd_bwd() -> Any:
        out = fn(y)
        return torch.autograd.grad(out, y, dout)[0]

    records = []
    try:
        restore()
        _check(name, fn, y, pristine, dout)
    except Exception as exc:
        return [
            Record(BENCH, name, m, shape, dtype, error=f"{type(exc).__name__}: {exc}")
            for m in ("fwd", "fwd_bwd")
        ]
    for mode, closure in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        rec = Record(BENCH, name, mode, shape, dtype, extra={"ffn_local": n})
        try:
            times = time_cuda(closure, warmup=warmup, iters=iters, setup=restore)
            rec.__dict__.update(summarize(times))
            restore()
            rec.peak_mib = peak_memory_mib(closure)
            if name != "lck_in_place":  # back to back it would keep differentiating its own gradient
                # What a training step sees when it calls the op repeatedly: host dispatch included.
                rec.extra["loop_ms"] = time_loop(closure, iters=iters, warmup=2)
                rec.extra["host_ms"] = host_ms(closure)
            moved = {"fwd": 3 * s * b * n * 2, "fwd_bwd": 3 * s * b * n * 2 + 5 * s * b * n * 2}[mode]
            rec.extra["gb_per_s"] = moved / (rec.median_ms * 1e-3) / 1e9
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        records.append(rec)
    return records


def _check(name: str, fn: Callable[[Any], Any], y: Any, pristine: Any, dout: Any) -> None:
    """One forward+backward against torch eager in float32 (bf16 tolerance), before timing."""
    import torch
    import torch.nn.functional as F

    out = fn(y)
    grad = torch.autograd.grad(out, y, dout)[0].float()
    ref_y = pristine.float().requires_grad_(True)
    a, b = ref_y.chunk(2, dim=-1)
    ref = F.silu(a) * b
    (ref_grad,) = torch.autograd.grad(ref, ref_y, dout.float())
    for what, got, want in (("output", out.float(), ref), ("input gradient", grad, ref_grad)):
        err = ((got - want).norm() / want.norm()).item()
        if not err <= 1e-2:
            raise AssertionError(f"{name}: {what} differs from torch eager (relative error {err:.2e})")


def _speedup(n: int, ours: float, theirs: float) -> tuple[float, float | None, bool]:
    """(megatron / lck, the target at ffn_local ``n`` or None, met)."""
    target = SPEEDUP_TARGETS.get(n)
    return theirs / ours, target, target is None or theirs / ours >= target


def summarize_records(records: list[Any]) -> tuple[list[str], dict[str, Any]]:
    """Table lines and the checks against the targets, from the records of one run."""
    by = {(r.provider, r.mode, r.extra.get("ffn_local")): r for r in records if r.error is None}
    lines = [
        f"{'ffn_local':>9} {'mode':>8} {'provider':>13} {'median ms':>10} {'peak MiB':>9} {'vs megatron':>12}"
        f" {'loop ms':>8}"
    ]
    checks: dict[str, Any] = {}
    for n in sorted({r.extra.get("ffn_local") for r in records if r.extra.get("ffn_local")}):
        for mode in ("fwd", "fwd_bwd"):
            base = by.get(("megatron", mode, n))
            for prov in PROVIDERS:
                r = by.get((prov, mode, n))
                if r is None:
                    continue
                speed = f"{base.median_ms / r.median_ms:.2f}x" if base else "-"
                loop = r.extra.get("loop_ms")
                lines.append(
                    f"{n:>9} {mode:>8} {prov:>13} {r.median_ms:>10.3f} {r.peak_mib:>9.0f} {speed:>12}"
                    f" {f'{loop:.3f}' if loop is not None else '-':>8}"
                )
        lck, meg, inp = (by.get((p, "fwd_bwd", n)) for p in ("lck", "megatron", "lck_in_place"))
        if lck and meg:
            checks[f"fwd_bwd speed-up at ffn_local={n}"] = _speedup(n, lck.median_ms, meg.median_ms)
            # The same ratio for calls back to back without a head start: the host's dispatch cost counts
            # (Megatron's figures in FACTS.md were taken this way; the GPU-time ratio above is the strict one).
            loops = lck.extra.get("loop_ms"), meg.extra.get("loop_ms")
            if None not in loops:
                checks[f"fwd_bwd speed-up at ffn_local={n}, back to back"] = _speedup(n, *loops)
        if inp and meg:
            ratio = inp.peak_mib / meg.peak_mib
            checks[f"in-place peak memory / megatron at ffn_local={n}"] = (
                ratio,
                IN_PLACE_MEMORY_TARGET,
                ratio <= IN_PLACE_MEMORY_TARGET,
            )
    for r in records:
        if r.error is not None:
            lines.append(f"{r.extra.get('ffn_local', '?'):>9} {r.mode:>8} {r.provider:>13} error: {r.error}")
    return lines, checks


def _plot(records: list[Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.error is None]
    sizes = sorted({r.extra["ffn_local"] for r in ok})
    panels = [("fwd", "median_ms", "forward, ms"), ("fwd_bwd", "median_ms", "forward+backward, ms"),
              ("fwd_bwd", "peak_mib", "forward+backward peak, MiB")]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4))
    width = 0.8 / len(PROVIDERS)
    for ax, (mode, value, title) in zip(axes, panels):
        for i, prov in enumerate(PROVIDERS):
            xs, ys = [], []
            for j, n in enumerate(sizes):
                hit = [
                    getattr(r, value)
                    for r in ok
                    if r.provider == prov and r.mode == mode and r.extra["ffn_local"] == n
                ]
                if hit:
                    xs.append(j + i * width)
                    ys.append(hit[0])
            ax.bar(xs, ys, width=width, label=prov)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
        ax.set_xticklabels([f"ffn_local={n}" for n in sizes])
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("Megatron SwiGLU activation, [s, b, 2·ffn_local] bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Time Megatron's SwiGLU activation: lck, lck in-place, megatron-core, torch eager (speed and memory)."""
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    import torch

    if not torch.cuda.is_available():
        print("lck bench megatron: needs a CUDA device (the timings are CUDA-event timings)", file=sys.stderr)
        return 2
    from lck_runtime.benchmarking import Progress, gpu_slug, write_results

    providers = _providers(args.providers)
    progress = Progress(len(args.ffn) * len(providers), "megatron swiglu")
    records: list[Any] = []
    from lck_runtime.benchmarking import Record

    for n in args.ffn:
        for name, fn in providers.items():
            if isinstance(fn, str):
                shape = f"{args.seq}x{args.batch}x{2 * n}"
                records += [
                    Record(BENCH, name, m, shape, "bfloat16", error=fn, extra={"ffn_local": n})
                    for m in ("fwd", "fwd_bwd")
                ]
            else:
                records += _measure(name, fn, args.seq, args.batch, n, args.iters, args.warmup)
                torch.cuda.empty_cache()  # the case's buffers died with _measure's frame
            progress.step(f"{name} ffn_local={n}")
    lines, checks = summarize_records(records)
    print("\n".join(lines))
    for what, (value, target, met) in checks.items():
        goal = "" if target is None else f" (target {'≥' if 'speed' in what else '≤'} {target})"
        print(f"{what}: {value:.2f}{goal}{'' if target is None else ('  met' if met else '  MISSED')}")
    stem = f"swiglu-{gpu_slug()}-{_dt.date.today().isoformat()}" + ("-quick" if args.quick else "")
    meta = {"seq": args.seq, "batch": args.batch, "ffn_local": args.ffn, "iters": args.iters, "warmup": args.warmup,
            "checks": {k: {"value": v, "target": t, "met": m} for k, (v, t, m) in checks.items()}}  # fmt: skip
    paths = write_results(records, args.out or _default_out(), stem, meta=meta, plot=_plot)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if all(r.error is None for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
