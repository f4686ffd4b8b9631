"""Try a handful of launch configurations for the RMSNorm and SwiGLU kernels at the target shapes.

    python packages/lck-kernels/benchmarks/tune_rms_norm_swiglu.py [--iters 30] [--wide]

For each kernel and shape it times the default configuration and each candidate (overrides through
``lck_kernels._common.tuning``), checks every candidate's output once against a torch fp32 reference, and
prints a table plus the best configuration per (kernel, shape), then the end-to-end forward+backward times
of the public functions against the targets (``--wide``: RMSNorm rows wider than one block instead, the tiled
path, with its tile width among the candidates). Times are medians of CUDA-event timings
(``lck_runtime.benchmarking.time_cuda``). Needs one CUDA GPU; takes about a minute on an H200.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from lck_kernels._common import tuning
from lck_kernels.rms_norm import rms_norm
from lck_kernels.rms_norm.launch import bwd_config, fwd_config
from lck_kernels.swiglu import swiglu_packed
from lck_kernels.swiglu.launch import elementwise_config
from lck_runtime.benchmarking import time_cuda

HBM_GBPS = 4247.0  # H200 device-to-device copy rate (FACTS.md)
ES = 2  # bf16
# Target shapes of issue 2: (rows, hidden) for RMSNorm, (rows, n) for the packed [rows, 2n] SwiGLU, with
# the fwd+bwd targets in ms on one H200.
RMS_SHAPE, RMS_TARGET = (16384, 4096), 0.20
RMS_EXTRA_SHAPES = ((16384, 1024), (16384, 8192))  # hidden 1024: where lck trailed torch.compile most
SWIGLU_SHAPES = (((8192, 32768), 1.20), ((8192, 4096), 0.15))
# Rows wider than MAX_BLOCK (tiled): 20480 = 16384 + 4096, 18432 = 9 x 2048, 28672 = 7 x 4096.
RMS_WIDE_SHAPES = ((4096, 20480), (4096, 18432), (2048, 28672))
RMS_FWD_WIDE = [dict(BLOCK_N=b, ROWS=1, num_warps=w) for b in (2048, 4096, 8192) for w in (4, 8, 16)]
RMS_BWD_WIDE = [
    dict(BLOCK_N=b, ROWS=1, num_warps=w, PROGRAMS_PER_SM=p, PREFETCH=0)
    for b in (2048, 4096, 8192) for w in (4, 8, 16) for p in (2, 4)
]  # fmt: skip

RMS_FWD = [dict(ROWS=r, num_warps=w) for r, w in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16))]
# (ROWS, warps, programs per SM, look-ahead): the look-ahead keeps a load in flight during each step's
# reduction, at the price of twice the input registers (hence fewer programs per SM).
RMS_BWD = [
    dict(ROWS=r, num_warps=w, PROGRAMS_PER_SM=p, PREFETCH=f)
    for r, w, p, f in (
        (1, 8, 2, 0), (1, 8, 4, 0), (1, 16, 2, 0), (2, 8, 2, 0), (2, 4, 4, 0), (2, 8, 3, 0), (4, 8, 1, 0),
        (1, 8, 2, 1), (1, 8, 4, 1), (1, 4, 4, 1), (2, 8, 1, 1), (2, 8, 2, 1), (2, 16, 1, 1), (4, 16, 1, 1),
        (4, 4, 4, 0), (4, 4, 4, 1), (8, 8, 2, 0), (8, 8, 2, 1), (2, 4, 8, 1),
    )
]  # fmt: skip
SWIGLU = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w)
    for m, n, w in (
        (1, 1024, 4),
        (1, 2048, 4),
        (1, 2048, 8),
        (2, 2048, 8),
        (1, 4096, 8),
        (2, 4096, 16),
        (4, 1024, 4),
        (4, 2048, 8),
    )
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _measure(fn: Callable[[], object], check: Callable[[], float], iters: int) -> tuple[float | None, str]:
    try:
        err = check()
        if not err < 2e-2:
            return None, f"WRONG (rel err {err:.2e})"
        return sorted(time_cuda(fn, warmup=3, iters=iters))[iters // 2], ""
    except Exception as exc:  # a config that does not compile or launch is a row, not a crash
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"


def _sweep(kernel, label, default, candidates, run, check, nbytes, iters, rows_out):
    results = []
    for cfg in [None, *candidates]:
        params = default if cfg is None else {**default, **cfg}
        if cfg is not None and params == default:
            continue
        with tuning(kernel, **params):
            ms, note = _measure(run, check, iters)
        results.append((params, ms, note, cfg is None))
        gbps = f"{nbytes / (ms * 1e-3) / 1e9:7.0f}" if ms else "      -"
        tag = " (default)" if cfg is None else ""
        print(
            f"{kernel:<14}{label:<16}{_fmt(params):<58}{(f'{ms:8.4f}' if ms else '       -')} {gbps} {note}{tag}"
        )
    ok = [r for r in results if r[1] is not None]
    if ok:
        best = min(ok, key=lambda r: r[1])
        base = next((r[1] for r in results if r[3]), None)
        rows_out.append((kernel, label, best[0], best[1], base))


def _fmt(params: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def tune_rms_norm(rows_out, iters: int, wide: bool = False) -> None:
    for m, n in RMS_WIDE_SHAPES if wide else (RMS_SHAPE, *RMS_EXTRA_SHAPES):
        _tune_rms_norm_shape(m, n, rows_out, iters, wide)
        torch.cuda.empty_cache()


def _tune_rms_norm_shape(m: int, n: int, rows_out, iters: int, wide: bool = False) -> None:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    rstd_ref = torch.rsqrt(xf.pow(2).mean(-1) + 1e-6)
    y_ref = (xf * rstd_ref[:, None]).to(torch.bfloat16).float() * w.float()
    xn = xf * rstd_ref[:, None]
    g = dy.float() * w.float()
    dx_ref = (g - xn * (g * xn).mean(-1, keepdim=True)) * rstd_ref[:, None]
    dw_ref = (dy.float() * xn).sum(0)
    _, rstd = torch.ops.lck.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    label = f"{m}x{n}"

    def check_fwd():
        return _rel_err(torch.ops.lck.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")[0], y_ref)

    def check_bwd():
        dx, dw = torch.ops.lck.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama")
        return max(_rel_err(dx, dx_ref), _rel_err(dw, dw_ref))

    _sweep(
        "rms_norm_fwd", label, fwd_config(n, ES), RMS_FWD_WIDE if wide else RMS_FWD,
        lambda: torch.ops.lck.rms_norm_fwd(x, w, 1e-6, 0.0, "llama"), check_fwd, 2 * m * n * ES, iters, rows_out,
    )  # fmt: skip
    _sweep(
        "rms_norm_bwd", label, bwd_config(n, ES), RMS_BWD_WIDE if wide else RMS_BWD,
        lambda: torch.ops.lck.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama"), check_bwd, 3 * m * n * ES, iters, rows_out,
    )  # fmt: skip


def tune_swiglu(rows_out, iters: int) -> None:
    for (m, n), _ in SWIGLU_SHAPES:
        _tune_swiglu_shape(m, n, rows_out, iters)
        torch.cuda.empty_cache()


def _tune_swiglu_shape(m: int, n: int, rows_out, iters: int) -> None:
    y = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    gate, up = y.float().chunk(2, -1)
    s = torch.sigmoid(gate)
    out_ref = gate * s * up
    dy_ref = torch.cat([dout.float() * up * (s + gate * s * (1 - s)), dout.float() * gate * s], -1)
    del gate, up, s
    label = f"{m}x2*{n}"
    _sweep(
        "swiglu_fwd", label, elementwise_config("swiglu_fwd", n, ES), SWIGLU,
        lambda: torch.ops.lck.swiglu_packed_fwd(y),
        lambda: _rel_err(torch.ops.lck.swiglu_packed_fwd(y), out_ref), 3 * m * n * ES, iters, rows_out,
    )  # fmt: skip
    _sweep(
        "swiglu_bwd", label, elementwise_config("swiglu_bwd", n, ES), SWIGLU,
        lambda: torch.ops.lck.swiglu_packed_bwd(y, dout),
        lambda: _rel_err(torch.ops.lck.swiglu_packed_bwd(y, dout), dy_ref), 5 * m * n * ES, iters, rows_out,
    )  # fmt: skip


def end_to_end(iters: int) -> None:
    """Forward and forward+backward of the public functions at default configs, against the targets."""
    print("\nend to end (defaults), bf16; target = issue 2's fwd+bwd target, fwd floor at 85% of copy rate")
    specs = []
    x = torch.randn(RMS_SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(RMS_SHAPE[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gx = torch.randn_like(x)
    specs.append((f"rms_norm {RMS_SHAPE[0]}x{RMS_SHAPE[1]}", lambda: rms_norm(x, w), lambda: torch.autograd.grad(rms_norm(x, w), (x, w), gx),
                  2 * x.numel() * ES, RMS_TARGET))  # fmt: skip
    for (m, n), target in SWIGLU_SHAPES:
        y = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        specs.append((f"swiglu_packed {m}x2*{n}", (lambda y=y: swiglu_packed(y)),
                      (lambda y=y, gy=gy: torch.autograd.grad(swiglu_packed(y), y, gy)), 3 * m * n * ES, target))  # fmt: skip
    print(f"{'op':<28}{'fwd ms':>9}{'fwd %HBM':>10}{'fwd+bwd ms':>12}{'target':>8}  verdict")
    for name, fwd, fwd_bwd, fwd_bytes, target in specs:
        f = sorted(time_cuda(fwd, warmup=5, iters=iters))[iters // 2]
        fb = sorted(time_cuda(fwd_bwd, warmup=5, iters=iters))[iters // 2]
        pct = 100 * fwd_bytes / (f * 1e-3) / 1e9 / HBM_GBPS
        verdict = ("ok" if fb <= target else "MISSES fwd+bwd target") + (
            "" if pct >= 85 else ", fwd below 85% HBM"
        )
        print(f"{name:<28}{f:9.4f}{pct:9.0f}%{fb:12.4f}{target:8.2f}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--wide", action="store_true", help="RMSNorm rows wider than one block only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_rms_norm_swiglu: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'kernel':<14}{'shape':<16}{'config':<58}{'ms':>8} {'GB/s':>7}")
    best: list = []
    tune_rms_norm(best, args.iters, args.wide)
    if not args.wide:
        tune_swiglu(best, args.iters)
    print("\nbest per (kernel, shape):")
    for kernel, label, params, ms, base in best:
        gain = f"{100 * (base - ms) / base:+.1f}% vs default" if base else "default failed"
        print(f"  {kernel:<14}{label:<16}{_fmt(params):<58}{ms:8.4f} ms  ({gain})")
    if not args.wide:
        end_to_end(args.iters)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
