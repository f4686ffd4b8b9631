"""``lck bench moe`` / ``python -m lck_ep.moe.benchmark``: the MoE experts layer on one GPU, no communication.

The whole layer from unsorted routing to the per-token output (permutation, both GEMMs, activation,
routing weights, un-permutation), forward (``fwd``) and forward plus backward (``fwd_bwd``, gradients of
``x``, both weights and the routing weights through ``torch.autograd.grad``), at the Qwen3-30B-A3B expert
shape (hidden 2048, expert ffn 768, 128 experts, top-8, 8192 tokens, bf16). Providers:

- ``lck``: :class:`lck_ep.MoEExperts` (local sort, lck's grouped GEMMs with the weighted SwiGLU as the first
  one's epilogue; ``fwd`` runs without gradients, so the first GEMM also gathers the rows);
- ``grouped_mm_eager``: the same layer in torch ops (argsort, gather, ``torch._grouped_mm``, eager
  ``silu(g) * u``, weight multiply, ``index_add_``);
- ``grouped_mm_eager_sorted``: only ``torch._grouped_mm`` + eager SwiGLU on tokens already sorted by
  expert (no permutation, no weighting): the figure quoted in FACTS.md;
- ``expert_loop``: a Python loop over experts with ``torch.matmul`` (Megatron's ``SequentialMLP``).

- ``lck_separate``: the same module with its Triton forward off (``LCK_EP_MOE_FUSED=0``): row gather,
  ``torch._grouped_mm``, the weighted SwiGLU kernel, ``torch._grouped_mm``.

On the GPU (without ``--only``) the forward GEMMs are also timed alone (benches ``moe_gemm1`` and
``moe_gemm2``): the two passes the first one replaces (``torch._grouped_mm``, weighted SwiGLU) against
:func:`lck_ep.moe.grouped.gemm_swiglu` with and without ``h``, and the row gather followed by that kernel
against :func:`lck_ep.moe.grouped.gemm_swiglu_gather` (the gather inside, as the forward without backward
runs it); ``torch._grouped_mm`` against :func:`lck_ep.moe.grouped.mm_tiled` for the second, with the largest
difference relative to the largest magnitude of the output between them.

Every row has the GPU time (:func:`time_cuda`: L2 flushed, host given a head start), the host time per call
(:func:`host_ms`; empty where a provider synchronises) and the loop time (back to back), the peak memory
above what was allocated before the call, and TFLOP/s (6·T·K·H·F forward, three times that for
forward+backward). Results: ``<out>/<gpu>-<date>-moe.{json,csv,png}`` with provenance. ``--cpu`` runs the
same code at a tiny shape on the CPU (perf_counter, Triton interpreter) as a smoke test.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int

    @property
    def label(self) -> str:
        return f"{self.name} T{self.tokens} H{self.hidden} F{self.ffn} E{self.experts} K{self.topk}"

    @property
    def fwd_flops(self) -> float:
        return 6.0 * self.tokens * self.topk * self.hidden * self.ffn


GPU_SHAPES = [Shape("qwen3-30b-a3b", 8192, 2048, 768, 128, 8)]
CPU_SHAPES = [Shape("tiny", 16, 32, 16, 4, 2)]


def _inputs(shape: Shape, device: Any, dtype: Any, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    t, h, f, e, k = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.topk
    idx = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()  # distinct experts, balanced
    w = torch.rand(t, k, generator=g).softmax(dim=1)
    return {
        "x": (torch.randn(t, h, generator=g) * 0.5).to(device=device, dtype=dtype),
        "idx": idx.to(device),
        "w": w.to(device),
        "w1": (torch.randn(e, h, 2 * f, generator=g) / h**0.5).to(device=device, dtype=dtype),
        "w2": (torch.randn(e, f, h, generator=g) / f**0.5).to(device=device, dtype=dtype),
        "dy": torch.randn(t, h, generator=g).to(device=device, dtype=dtype),
    }


# ------------------------------------------------------------------------------------------ providers


def _lck(inp: dict[str, Any], shape: Shape) -> Callable[[bool], Any]:
    import torch

    from lck_ep.moe import MoEExperts

    m = MoEExperts(shape.experts, shape.hidden, shape.ffn, dtype=inp["x"].dtype, device=inp["x"].device)
    with torch.no_grad():
        m.weight1.copy_(inp["w1"])
        m.weight2.copy_(inp["w2"])
    return _runner(lambda x, w: m(x, inp["idx"], w), inp, [m.weight1, m.weight2])


def _eager_layer(inp: dict[str, Any], shape: Shape) -> Callable[[bool], Any]:
    import torch
    import torch.nn.functional as fn

    e, k, f = shape.experts, shape.topk, shape.ffn
    w1 = inp["w1"].clone().requires_grad_()
    w2 = inp["w2"].clone().requires_grad_()

    def layer(x: Any, w: Any) -> Any:
        flat = inp["idx"].reshape(-1)
        order = torch.argsort(flat, stable=True)
        ends = torch.searchsorted(flat[order], torch.arange(1, e + 1, device=flat.device)).to(torch.int32)
        tok = order // k
        hh = torch._grouped_mm(x.index_select(0, tok), w1, offs=ends)
        act = fn.silu(hh[:, :f]) * hh[:, f:] * w.reshape(-1)[order].unsqueeze(1).to(hh.dtype)
        y = torch._grouped_mm(act, w2, offs=ends)
        return torch.zeros_like(x).index_add_(0, tok, y)

    return _runner(layer, inp, [w1, w2])


def _eager_sorted(inp: dict[str, Any], shape: Shape) -> Callable[[bool], Any]:
    import torch
    import torch.nn.functional as fn

    e, f = shape.experts, shape.ffn
    counts = torch.bincount(inp["idx"].reshape(-1), minlength=e)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    rows = int(ends[-1])
    g = torch.Generator(device="cpu").manual_seed(1)
    xs = torch.randn(rows, shape.hidden, generator=g).to(device=inp["x"].device, dtype=inp["x"].dtype)
    dys = torch.randn(rows, shape.hidden, generator=g).to(device=inp["x"].device, dtype=inp["x"].dtype)
    w1 = inp["w1"].clone().requires_grad_()
    w2 = inp["w2"].clone().requires_grad_()

    def layer(x: Any) -> Any:
        hh = torch._grouped_mm(x, w1, offs=ends)
        return torch._grouped_mm(fn.silu(hh[:, :f]) * hh[:, f:], w2, offs=ends)

    def run(backward: bool) -> Any:
        if not backward:
            with torch.no_grad():
                return layer(xs)
        x = xs.detach().requires_grad_()
        return torch.autograd.grad(layer(x), [x, w1, w2], dys)

    return run


def _expert_loop(inp: dict[str, Any], shape: Shape) -> Callable[[bool], Any]:
    import torch
    import torch.nn.functional as fn

    f = shape.ffn
    w1 = inp["w1"].clone().requires_grad_()
    w2 = inp["w2"].clone().requires_grad_()

    def layer(x: Any, w: Any) -> Any:
        out = torch.zeros_like(x)
        for j in range(shape.experts):
            tok, slot = (inp["idx"] == j).nonzero(as_tuple=True)
            hh = x.index_select(0, tok) @ w1[j]
            y = (fn.silu(hh[:, :f]) * hh[:, f:]) @ w2[j]
            out = out.index_add(0, tok, y * w[tok, slot].unsqueeze(1).to(y.dtype))
        return out

    return _runner(layer, inp, [w1, w2])


def _runner(
    layer: Callable[[Any, Any], Any], inp: dict[str, Any], params: list[Any]
) -> Callable[[bool], Any]:
    import torch

    def run(backward: bool) -> Any:
        if not backward:
            with torch.no_grad():
                return layer(inp["x"], inp["w"])
        x = inp["x"].detach().requires_grad_()
        w = inp["w"].detach().requires_grad_()
        y = layer(x, w)
        return torch.autograd.grad(y, [x, w, *params], inp["dy"])

    return run


def _gemm_rows(inp: dict[str, Any], shape: Shape, cuda: bool, iters: int) -> list[Any]:
    """The forward GEMMs alone: torch's passes against lck's Triton kernels (benches moe_gemm1, moe_gemm2)."""
    import torch

    from lck_ep.moe import grouped, launch
    from lck_ep.moe.permute import build_local_layout
    from lck_runtime.benchmarking import Record

    lay = build_local_layout(inp["idx"], shape.experts, 1)
    k = shape.topk
    tw = inp["w"].float().contiguous()
    x_e, w_e = launch.gather_rows(inp["x"], lay.entry, k, tw.reshape(-1))
    tiles = grouped.forward_tiles(inp["x"], inp["w1"], inp["w2"])
    act_in = launch.swiglu_weighted_fwd(grouped.mm(x_e, inp["w1"], lay.ends), w_e, lay.ends)

    def separate() -> Any:
        return launch.swiglu_weighted_fwd(torch._grouped_mm(x_e, inp["w1"], offs=lay.ends), w_e, lay.ends)

    runs: dict[tuple[str, str], Callable[[], Any]] = {
        ("moe_gemm1", "grouped_mm_act"): separate,
        ("moe_gemm2", "torch_grouped_mm"): lambda: torch._grouped_mm(act_in, inp["w2"], offs=lay.ends),
    }
    if tiles is not None:
        for keep_h in (True, False):
            runs[("moe_gemm1", f"lck_gemm_swiglu{'_with_h' if keep_h else ''}")] = lambda keep_h=keep_h: (
                grouped.gemm_swiglu(x_e, w_e, inp["w1"], lay.ends, tiles, keep_h)[1]
            )
        runs[("moe_gemm1", "lck_gemm_swiglu_gathering")] = lambda: grouped.gemm_swiglu_gather(
            inp["x"], lay.entry, tw.reshape(-1), k, inp["w1"], lay.ends, tiles
        )  # the row gather inside: its time is that of the separate gather plus the GEMM
        runs[("moe_gemm1", "lck_gather_then_gemm_swiglu")] = lambda: grouped.gemm_swiglu(
            *launch.gather_rows(inp["x"], lay.entry, k, tw.reshape(-1)), inp["w1"], lay.ends, tiles, False
        )[1]
        runs[("moe_gemm2", "lck_mm_tiled")] = lambda: grouped.mm_tiled(act_in, inp["w2"], lay.ends, tiles)
    used = int(lay.ends[-1])
    want = {"moe_gemm1": separate()[:used].float(), "moe_gemm2": runs[("moe_gemm2", "torch_grouped_mm")]()}
    want["moe_gemm2"] = want["moe_gemm2"][:used].float()
    rows = []
    for (bench, name), run in runs.items():
        rec = Record(bench, name, "fwd", shape.label, str(inp["x"].dtype).replace("torch.", ""))
        try:
            with torch.no_grad():
                got = _measure(run, cuda, False, iters)
                out = run()[:used].float()
            rec.median_ms, rec.p20_ms, rec.p80_ms = got["median_ms"], got["p20_ms"], got["p80_ms"]
            rec.peak_mib = got["peak_mib"]
            flops = (4.0 if bench == "moe_gemm1" else 2.0) * shape.tokens * k * shape.hidden * shape.ffn
            rec.extra = {
                "host_ms": got["host_ms"],
                "loop_ms": got["loop_ms"],
                "tflops": flops / (rec.median_ms * 1e-3) / 1e12,
                "max_rel_diff": _max_rel_diff(out, want[bench]),
            }
        except Exception as exc:
            rec.error = repr(exc)
        rows.append(rec)
    return rows


def _lck_separate(inp: dict[str, Any], shape: Shape) -> Callable[[bool], Any]:
    run = _lck(inp, shape)

    def separate(backward: bool) -> Any:
        old = os.environ.get("LCK_EP_MOE_FUSED")
        os.environ["LCK_EP_MOE_FUSED"] = "0"
        try:
            return run(backward)
        finally:
            if old is None:
                del os.environ["LCK_EP_MOE_FUSED"]
            else:
                os.environ["LCK_EP_MOE_FUSED"] = old

    return separate


PROVIDERS: dict[str, Callable[[dict[str, Any], Shape], Callable[[bool], Any]]] = {
    "lck": _lck,
    "lck_separate": _lck_separate,
    "grouped_mm_eager": _eager_layer,
    "grouped_mm_eager_sorted": _eager_sorted,
    "expert_loop": _expert_loop,
}
SLOW = {"expert_loop"}  # ~200 ms per forward+backward on an H200: fewer iterations


# ------------------------------------------------------------------------------------------ timing


def _measure(run: Callable[[], Any], cuda: bool, slow: bool, iters: int) -> dict[str, Any]:
    """GPU time (median, p20, p80), host ms per call, loop ms per call and peak MiB of one call."""
    from lck_runtime.benchmarking import host_ms, peak_memory_mib, summarize, time_cuda, time_loop

    n = max(3, iters // 6) if slow else iters
    if not cuda:
        run()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
        return {**summarize(times), "host_ms": None, "loop_ms": None, "peak_mib": None}
    out = summarize(time_cuda(run, warmup=2 if slow else 5, iters=n))
    out["host_ms"] = host_ms(run, iters=3 if slow else 20, warmup=1 if slow else 3)
    out["loop_ms"] = time_loop(run, iters=3 if slow else 50, warmup=1 if slow else 5)
    out["peak_mib"] = peak_memory_mib(run)
    return out


def _max_rel_diff(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> int:
    """Time the MoE experts layer against a torch grouped-GEMM layer and an expert loop (one GPU)."""
    import torch

    from lck_runtime.benchmarking import Progress, Record, bar_plot, gpu_slug, write_results

    parser = argparse.ArgumentParser(prog="lck bench moe", description=main.__doc__)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"result folder (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--iters", type=int, default=30, help="timed iterations per row (a sixth for the loop)"
    )
    parser.add_argument("--only", nargs="+", choices=sorted(PROVIDERS), help="these providers only")
    parser.add_argument("--cpu", action="store_true", help="a tiny shape on the CPU (smoke test)")
    args = parser.parse_args(argv)
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("lck bench moe: no CUDA device (use --cpu for a smoke run)", file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            print("lck bench moe --cpu: needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    providers = args.only or list(PROVIDERS)
    records: list[Record] = []
    bar = Progress(len(shapes) * len(providers) * 2, "lck bench moe")
    for shape in shapes:
        inp = _inputs(shape, device, dtype)
        reference = None
        for name in providers:
            try:
                run = PROVIDERS[name](inp, shape)
            except Exception as exc:  # e.g. torch._grouped_mm missing in this torch
                for mode in ("fwd", "fwd_bwd"):
                    records.append(Record("moe", name, mode, shape.label, str(dtype), error=repr(exc)))
                    bar.step(f"{name} {mode}: {exc!r}"[:80])
                continue
            for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                rec = Record("moe", name, mode, shape.label, str(dtype).replace("torch.", ""))
                try:
                    got = _measure(lambda r=run, b=backward: r(b), cuda, name in SLOW, args.iters)
                    rec.median_ms, rec.p20_ms, rec.p80_ms = got["median_ms"], got["p20_ms"], got["p80_ms"]
                    rec.peak_mib = got["peak_mib"]
                    flops = shape.fwd_flops * (3 if backward else 1)
                    rec.extra = {
                        "host_ms": got["host_ms"],
                        "loop_ms": got["loop_ms"],
                        "tflops": flops / (rec.median_ms * 1e-3) / 1e12,
                        "rows_expanded": shape.tokens * shape.topk,
                    }
                    if not backward and name != "grouped_mm_eager_sorted":
                        y = run(False)
                        if reference is None:
                            reference = y
                        rec.extra["max_rel_diff_vs_first"] = _max_rel_diff(y, reference)
                except Exception as exc:
                    rec.error = repr(exc)
                records.append(rec)
                note = f"{name} {mode}: " + (
                    f"{rec.median_ms:.3f} ms" if rec.median_ms else str(rec.error)[:60]
                )
                bar.step(note)
        if cuda and not args.only:
            records += _gemm_rows(inp, shape, cuda, args.iters)
    slug = gpu_slug() if cuda else "cpu"
    stem = f"{slug}-{_dt.date.today().isoformat()}-moe"
    meta = {
        "shapes": [s.label for s in shapes],
        "targets_ms": {"fwd": 1.35, "fwd_bwd": 4.5},
        "iters": args.iters,
        "note": "whole layer (permutation, GEMMs, activation, weighting, un-permutation) except "
        "grouped_mm_eager_sorted (GEMMs + SwiGLU on pre-sorted rows); no communication",
    }
    paths = write_results(
        records, args.out, stem, meta=meta,
        plot=lambda recs, path: bar_plot(recs, path, title=f"lck-ep MoE experts on {slug}"),
    )  # fmt: skip
    for r in records:
        if r.error:
            print(f"{r.provider:>24} {r.mode:>8}: error {r.error}")
        else:
            ex = r.extra
            host = f"{ex['host_ms']:.3f}" if ex.get("host_ms") is not None else "-"
            loop = f"{ex['loop_ms']:.3f}" if ex.get("loop_ms") is not None else "-"
            peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
            print(
                f"{r.provider:>24} {r.mode:>8}: gpu {r.median_ms:.3f} ms  host {host}  loop {loop}  "
                f"{ex['tflops']:.0f} TFLOP/s  peak {peak} MiB"
            )
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if all(r.error is None for r in records if r.provider == "lck") else 1


if __name__ == "__main__":
    raise SystemExit(main())
