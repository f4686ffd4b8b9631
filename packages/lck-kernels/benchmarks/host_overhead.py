"""GPU, host and loop time of every lck op's forward+backward beside torch and Liger (one CUDA GPU, a few
minutes), and where the host's time goes.

    python packages/lck-kernels/benchmarks/host_overhead.py [--out DIR] [--quick]

For each op at the shapes of issue 28 and of the kernels README (bf16, one forward plus one backward through
``torch.autograd.grad``, as a training step runs it) and each provider (lck; torch's own op or eager code;
Liger-Kernel where installed) it measures:

- GPU ms: ``time_cuda`` (calls queued behind a GPU spin: the device's time alone);
- host ms: the host's cost to enqueue one call while the GPU is busy (``host_ms``'s protocol: calls queued
  behind a GPU spin), the providers alternating call by call (``_host_paired``);
- loop ms: ``time_loop`` (calls back to back, as a training loop runs them).

It prints them as a markdown table with the issue's verdicts (lck host ms at or below torch's, and loop ms
within 1.15x of GPU ms where GPU ms >= 0.1; each case also times the "floor" provider, ``_autograd_floor``),
then a layer-by-layer breakdown of one small op's host cost and a cProfile of the host side of RMSNorm, cross
entropy and the fused linear cross entropy. Writes ``host-overhead-<gpu>-<date>.{json,csv,png,md}`` (JSON and
CSV with provenance). The vocabulary-parallel ops need a process group: ``python -m
lck_kernels.bench.tp`` times them.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import json
import pstats
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lck_runtime.benchmarking import (
    Record,
    gpu_slug,
    host_ms,
    provenance,
    summarize,
    time_cuda,
    time_loop,
    write_results,
)

BF16 = torch.bfloat16
Step = Callable[[], object]


def _t(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=BF16, requires_grad=grad)


def _liger(name: str):
    """A Liger-Kernel function by its module path, or None when Liger is not installed."""
    try:
        module, _, attr = name.rpartition(".")
        return getattr(__import__(module, fromlist=[attr]), attr)
    except (ImportError, AttributeError):
        return None


def _rms_norm(rows: int, hidden: int) -> dict[str, Step]:
    import torch.nn.functional as F

    from lck_kernels import rms_norm

    x, w, dy = _t(rows, hidden), _t(hidden), _t(rows, hidden, grad=False)
    steps = {
        "lck": lambda: torch.autograd.grad(rms_norm(x, w), (x, w), dy),
        "torch": lambda: torch.autograd.grad(F.rms_norm(x, (hidden,), w, 1e-6), (x, w), dy),
    }
    liger = _liger("liger_kernel.ops.rms_norm.LigerRMSNormFunction")
    if liger is not None:
        steps["liger"] = lambda: torch.autograd.grad(liger.apply(x, w, 1e-6, 0.0, "llama", False), (x, w), dy)
    return steps


def _swiglu(rows: int, n: int) -> dict[str, Step]:
    import torch.nn.functional as F

    from lck_kernels import swiglu

    a, b, dc = _t(rows, n), _t(rows, n), _t(rows, n, grad=False)
    steps = {
        "lck": lambda: torch.autograd.grad(swiglu(a, b), (a, b), dc),
        "torch": lambda: torch.autograd.grad(F.silu(a) * b, (a, b), dc),
    }
    liger = _liger("liger_kernel.ops.swiglu.LigerSiLUMulFunction")
    if liger is not None:
        steps["liger"] = lambda: torch.autograd.grad(liger.apply(a, b), (a, b), dc)
    return steps


def _swiglu_packed(rows: int, n: int) -> dict[str, Step]:
    import torch.nn.functional as F

    from lck_kernels import swiglu_packed

    y, dc = _t(rows, 2 * n), _t(rows, n, grad=False)

    def torch_step():
        gate, up = y.chunk(2, -1)
        return torch.autograd.grad(F.silu(gate) * up, y, dc)

    steps = {"lck": lambda: torch.autograd.grad(swiglu_packed(y), y, dc), "torch": torch_step}
    liger = _liger("liger_kernel.ops.swiglu.LigerSiLUMulFunction")
    if liger is not None:

        def liger_step():  # Liger has no packed form: the halves as chunk views, as its users call it
            gate, up = y.chunk(2, -1)
            return torch.autograd.grad(liger.apply(gate, up), y, dc)

        steps["liger"] = liger_step
    return steps


def _cross_entropy(rows: int, vocab: int) -> dict[str, Step]:
    import torch.nn.functional as F

    from lck_kernels import cross_entropy

    x = _t(rows, vocab)
    t = torch.randint(0, vocab, (rows,), device="cuda")
    steps = {
        "lck": lambda: torch.autograd.grad(cross_entropy(x, t), x),
        "torch": lambda: torch.autograd.grad(F.cross_entropy(x, t), x),
    }
    liger = _liger("liger_kernel.transformers.functional.liger_cross_entropy")
    if liger is not None:
        steps["liger"] = lambda: torch.autograd.grad(liger(x, t), x)
    return steps


def _linear_cross_entropy(rows: int, hidden: int, vocab: int, scaled: bool = False) -> dict[str, Step]:
    import torch.nn.functional as F

    from lck_kernels import fused_linear_cross_entropy, fused_linear_scaled_cross_entropy

    x, w = _t(rows, hidden), _t(vocab, hidden)
    t = torch.randint(0, vocab, (rows,), device="cuda")
    if scaled:  # FLSCE, reduced NLL at inverse temperature 1/0.7 (its training fast path)
        tau = 1 / 0.7
        return {
            "lck": lambda: torch.autograd.grad(
                fused_linear_scaled_cross_entropy(x, w, t, inverse_temperature=tau, reduction="mean")[0],
                (x, w),
            ),
            "torch": lambda: torch.autograd.grad(F.cross_entropy((x @ w.T).float() * tau, t), (x, w)),
        }
    steps = {
        "lck": lambda: torch.autograd.grad(fused_linear_cross_entropy(x, w, t), (x, w)),
        "torch": lambda: torch.autograd.grad(F.cross_entropy(x @ w.T, t), (x, w)),
    }
    liger = _liger("liger_kernel.transformers.functional.liger_fused_linear_cross_entropy")
    if liger is not None:
        steps["liger"] = lambda: torch.autograd.grad(liger(x, w, t), (x, w))
    return steps


def _autograd_floor() -> Step:
    """The "floor" provider of every case: one elementwise torch op (``x * 2`` on 1024x1024 bf16) forward and
    backward through ``torch.autograd.grad``, which costs the host autograd.grad itself (its graph task and the
    hand-offs to and from autograd's device thread) and one launch each way: what any op's fwd+bwd measured
    this way pays at least. Where it is near an op's GPU time, that op's loop time cannot stay within 1.15x of
    its GPU time, whatever the op's own host cost."""
    x, dy = _t(1024, 1024), _t(1024, 1024, grad=False)
    return lambda: torch.autograd.grad(x * 2, x, dy)


def _cases(quick: bool) -> list[tuple[str, str, Callable[[], dict[str, Step]]]]:
    """(op, shape, steps) at the shapes of issue 28 first, then the README's."""
    cases = [
        ("rms_norm", "8192x4096", lambda: _rms_norm(8192, 4096)),
        ("rms_norm", "4096x2048", lambda: _rms_norm(4096, 2048)),
        ("swiglu", "8192x14336", lambda: _swiglu(8192, 14336)),
        ("swiglu", "4096x2816", lambda: _swiglu(4096, 2816)),
        ("swiglu_packed", "4096x2*2816", lambda: _swiglu_packed(4096, 2816)),
        ("cross_entropy", "4096x32000", lambda: _cross_entropy(4096, 32000)),
    ]
    if not quick:
        cases += [
            ("rms_norm", "16384x4096", lambda: _rms_norm(16384, 4096)),
            ("swiglu_packed", "8192x2*4096", lambda: _swiglu_packed(8192, 4096)),
            ("swiglu_packed", "8192x2*32768", lambda: _swiglu_packed(8192, 32768)),
            ("cross_entropy", "8192x128256", lambda: _cross_entropy(8192, 128256)),
            (
                "fused_linear_cross_entropy",
                "8192x4096->128256",
                lambda: _linear_cross_entropy(8192, 4096, 128256),
            ),
            (
                "fused_linear_scaled_cross_entropy",
                "8192x4096->128256",
                lambda: _linear_cross_entropy(8192, 4096, 128256, scaled=True),
            ),
        ]
    return cases


HOST_ROUNDS = 7  # host time: rounds behind one GPU spin each, the providers alternating call by call
HOST_CALLS = 20  # calls per provider per round
# Per round for ops of tens of launches each: a CUDA stream holds about a thousand queued launches, beyond which
# a launch waits for the GPU (here: for the spin, which spoils the round).
HOST_CALLS_LONG = 5
LONG_OPS = ("fused_linear_cross_entropy", "fused_linear_scaled_cross_entropy")


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def _measure(op: str, shape: str, provider: str, fn: Step) -> Record:
    rec = Record(op, provider, "fwd_bwd", shape, "bfloat16")
    try:
        rec.__dict__.update(summarize(time_cuda(fn, warmup=3, iters=20)))
        rec.extra["loop_ms"] = time_loop(fn, iters=30, warmup=2)
    except Exception as exc:  # a peer that cannot run a case is a row, not a crash
        rec.error = _error(exc)
    return rec


def _host_paired(steps: dict[str, Step], records: dict[str, Record], calls: int) -> None:
    """Each provider's host ms with the providers alternating call by call: per round, one GPU spin (so no call
    waits for the device), then ``calls`` turns in which every provider makes one call (the order rotating), each
    call timed alone. A slow spell of the host machine (seen to move one provider's figure by 20-60% between
    rounds) then falls on every provider alike. host_ms is the median over all kept calls (p20/p80 beside it); a
    round in which the spin ended (a call waited for the GPU) is dropped, and a provider whose call always
    synchronises (a host read of a device value) gets None, measured on its own."""
    import time

    live = [p for p, r in records.items() if r.error is None]
    for p in list(live):
        try:
            if host_ms(steps[p], iters=2, warmup=1) is None:  # it synchronises: it would spoil every round
                live.remove(p)
                records[p].extra["host_ms"] = None
        except Exception as exc:
            records[p].error = _error(exc)
            live.remove(p)
    times: dict[str, list[float]] = {p: [] for p in live}
    dropped = 0
    for _ in range(HOST_ROUNDS):
        torch.cuda.synchronize()
        spun = torch.cuda.Event()
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU spin: the host runs ahead of it for every call below
        spun.record()
        got: dict[str, list[float]] = {p: [] for p in live}
        for k in range(calls):
            for p in live[k % len(live) :] + live[: k % len(live)]:
                t0 = time.perf_counter()
                steps[p]()
                got[p].append((time.perf_counter() - t0) * 1e3)
        if spun.query():  # the spin ended inside the round: some call waited for the GPU
            dropped += 1
            continue
        for p in live:
            times[p] += got[p]
    torch.cuda.synchronize()
    for p in live:
        rec, ts = records[p], sorted(times[p])
        rec.extra["host_ms"] = statistics.median(ts) if ts else None
        if ts:
            rec.extra["host_ms_p20"], rec.extra["host_ms_p80"] = ts[len(ts) // 5], ts[(4 * len(ts)) // 5]
        rec.extra["host_calls"] = len(ts)
        rec.extra["host_rounds_dropped"] = dropped


def _verdicts(records: list[Record]) -> dict[tuple[str, str], dict[str, object]]:
    """Issue 28's targets per case: lck host ms <= torch's, lck loop ms <= 1.15 x GPU ms where GPU >= 0.1; and
    where the loop target is missed, whether the autograd floor's host ms (measured in the same run) is itself
    above 1.15 x the op's GPU ms (then no op measured through autograd.grad can meet it)."""
    out: dict[tuple[str, str], dict[str, object]] = {}
    by = {(r.bench, r.shape, r.provider): r for r in records if r.error is None}
    for bench, shape in dict.fromkeys((r.bench, r.shape) for r in records):
        lck, torch_rec = by.get((bench, shape, "lck")), by.get((bench, shape, "torch"))
        floor = by[(bench, shape, "floor")].extra.get("host_ms") if (bench, shape, "floor") in by else None
        if lck is None:
            continue
        host, loop, gpu = lck.extra.get("host_ms"), lck.extra.get("loop_ms"), lck.median_ms
        v: dict[str, object] = {}
        if torch_rec is not None and host is not None and torch_rec.extra.get("host_ms") is not None:
            v["host_le_torch"] = host <= torch_rec.extra["host_ms"]
        if gpu is not None and gpu >= 0.1 and loop is not None:
            v["loop_le_1.15_gpu"] = loop <= 1.15 * gpu
            if not v["loop_le_1.15_gpu"] and floor is not None:
                v["floor_above_1.15_gpu"] = floor > 1.15 * gpu
        out[(bench, shape)] = v
    return out


def _markdown(records: list[Record]) -> str:
    verdicts = _verdicts(records)
    lines = [
        "| op, shape (bf16, fwd+bwd) | provider | GPU ms | host ms | loop ms | verdicts (lck) |",
        "|---|---|---|---|---|---|",
    ]

    def f(v):
        return "—" if v is None else f"{v:.3f}"

    for r in records:
        v = verdicts.get((r.bench, r.shape), {}) if r.provider == "lck" else {}
        note = ", ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in v.items())
        if r.error:
            lines.append(f"| {r.bench} {r.shape} | {r.provider} | error: {r.error} | | | |")
            continue
        lines.append(
            f"| {r.bench} {r.shape} | {r.provider} | {f(r.median_ms)} | {f(r.extra.get('host_ms'))} | "
            f"{f(r.extra.get('loop_ms'))} | {note} |"
        )
    return "\n".join(lines) + "\n"


def _plot(records: list[Record], path: Path) -> None:
    """One panel per case; per provider three bars: GPU, host and loop ms."""
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r.bench, r.shape) for r in records))
    cols = 3
    rows = (len(cases) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    kinds = (("GPU", lambda r: r.median_ms), ("host", lambda r: r.extra.get("host_ms")),
             ("loop", lambda r: r.extra.get("loop_ms")))  # fmt: skip
    for ax, (bench, shape) in zip(axes.flat, cases):
        sub = [r for r in records if r.bench == bench and r.shape == shape and r.error is None]
        for k, (label, get) in enumerate(kinds):
            xs = [i + k * 0.27 for i in range(len(sub))]
            ax.bar(xs, [get(r) or 0.0 for r in sub], width=0.27, label=label)
        ax.set_xticks([i + 0.27 for i in range(len(sub))])
        ax.set_xticklabels([r.provider for r in sub], fontsize=8)
        ax.set_title(f"{bench} {shape}", fontsize=9)
        ax.set_ylabel("ms per fwd+bwd")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(cases) :]:
        ax.axis("off")
    fig.suptitle(f"lck vs torch vs Liger, bf16 fwd+bwd on {gpu_slug()}: GPU, host and loop time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _breakdown() -> list[dict]:
    """Host ms of each layer of one small op (packed SwiGLU at 8192 × 2·4096 bf16), inside out, with the
    dispatcher path and two peers for scale."""
    import importlib

    import torch.nn.functional as F

    from lck_kernels import _eager, swiglu_packed
    from lck_kernels.swiglu.kernels import _swiglu_fwd_kernel
    from lck_kernels.swiglu.launch import launch_fwd

    sp = importlib.import_module("lck_kernels.swiglu.ops")
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    yd = y.detach()
    dout = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    gate, up = yd[:, :4096], yd[:, 4096:]
    out = torch.empty(8192, 4096, device="cuda", dtype=torch.bfloat16)
    grid = (8192 * 2,)

    def raw():
        _swiglu_fwd_kernel[grid](
            gate, up, out, 8192, 4096, 8192, 8192, 4096, BLOCK_M=1, BLOCK_N=2048, num_warps=4
        )

    def launch():  # as the op body launches in eager mode: the compiled kernel's own launcher
        _eager.run_direct(launch_fwd, gate, up, out)

    def impl():
        _eager.run_direct(sp._packed_fwd_impl, yd)

    def eager_fwd_bwd():
        a, b = y.chunk(2, -1)
        return torch.autograd.grad(F.silu(a) * b, y, dout)

    steps = [
        ("Triton's generic launch (kernel[grid](...))", raw),
        ("launch_fwd (cached config + pre-bound launch)", launch),
        ("op body (checks, empty, launch)", impl),
        ("torch.ops.lck.swiglu_packed_fwd (dispatcher)", lambda: torch.ops.lck.swiglu_packed_fwd(yd)),
        ("swiglu_packed, no grad", lambda: swiglu_packed(yd)),
        ("swiglu_packed, graph recorded", lambda: swiglu_packed(y)),
        ("swiglu_packed fwd+bwd", lambda: torch.autograd.grad(swiglu_packed(y), y, dout)),
        ("torch eager fwd+bwd", eager_fwd_bwd),
    ]
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        def liger():
            a, b = y.chunk(2, -1)
            return torch.autograd.grad(LigerSiLUMulFunction.apply(a, b), y, dout)

        steps.append(("Liger fwd+bwd (chunked halves)", liger))
    except ImportError:
        pass
    rows = []
    for name, fn in steps:
        rows.append({"step": name, "host_ms": host_ms(fn, iters=50)})
    _eager.EagerOp.direct = False
    rows.append(
        {"step": "swiglu_packed fwd+bwd through the dispatcher", "host_ms": host_ms(steps[6][1], iters=50)}
    )
    _eager.EagerOp.direct = True
    return rows


def _profile(fn, n: int = 200) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true", help="only the issue's shapes")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("host_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    records: list[Record] = []
    profiles: dict[str, str] = {}
    floor = _autograd_floor()
    for op, shape, make in _cases(args.quick):
        steps = {**make(), "floor": floor}
        case = {provider: _measure(op, shape, provider, fn) for provider, fn in steps.items()}
        _host_paired(steps, case, HOST_CALLS_LONG if op in LONG_OPS else HOST_CALLS)
        for provider, r in case.items():
            records.append(r)
            print(f"{op:<34} {shape:<18} {provider:<6} gpu {r.median_ms} host {r.extra.get('host_ms')} "
                  f"loop {r.extra.get('loop_ms')} {r.error or ''}", flush=True)  # fmt: skip
        if (op, shape) in (("rms_norm", "4096x2048"), ("cross_entropy", "4096x32000")):
            profiles[f"{op} {shape}"] = _profile(steps["lck"])
        elif op == "fused_linear_cross_entropy":  # where its host milliseconds go (30 calls: 35 ms each)
            profiles[f"{op} {shape}"] = _profile(steps["lck"], n=30)
        del steps
        torch.cuda.empty_cache()
    breakdown = _breakdown()
    table = _markdown(records)
    print("\n" + table)
    print("host ms per call, layer by layer (packed SwiGLU 8192 x 2*4096 bf16):")
    for row in breakdown:
        ms = row["host_ms"]
        print(f"  {row['step']:<48} {ms if ms is not None else float('nan'):7.3f}")
    for name, text in profiles.items():
        print(f"\n--- cProfile of {name} forward+backward calls (own time first)\n{text}")
    stem = f"host-overhead-{gpu_slug()}-{_dt.date.today().isoformat()}"
    verdicts = {f"{b} {s}": v for (b, s), v in _verdicts(records).items()}
    paths = write_results(
        records, args.out, stem, meta={"verdicts": verdicts, "breakdown": breakdown, "profiles": profiles},
        plot=_plot,
    )  # fmt: skip
    md = args.out / f"{stem}.md"
    md.write_text(f"Provenance: {json.dumps(provenance())}\n\n{table}")
    print("wrote", ", ".join(str(p) for p in [*paths.values(), md]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
