"""Where the host's time goes in one forward+backward of each lck op (needs one CUDA GPU, ~20 s).

    python packages/lck-kernels/benchmarks/host_overhead.py [--out DIR]

For RMSNorm, the packed SwiGLU and cross entropy at a small and a target shape it prints the GPU time
(``time_cuda``), the host's cost per call (``host_ms``) and the time per call back to back (``time_loop``),
then a cProfile of the host side of the RMSNorm and cross-entropy forward+backward (the functions with the
most own time), so launch and dispatch costs can be attributed, not guessed. Writes
``host-overhead-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import json
import pstats
import sys
from pathlib import Path

import torch

from lck_runtime.benchmarking import gpu_slug, host_ms, provenance, summarize, time_cuda, time_loop


def _cases():
    from lck_kernels import cross_entropy, rms_norm, swiglu_packed

    def rms(rows, hidden):
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.autograd.grad(rms_norm(x, w), (x, w), dy)

    def swi(rows, n):
        y = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.autograd.grad(swiglu_packed(y), y, dy)

    def ce(rows, vocab):
        x = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, vocab, (rows,), device="cuda")
        return lambda: torch.autograd.grad(cross_entropy(x, t), x)

    return [
        ("rms_norm", "16384x1024", rms(16384, 1024)),
        ("rms_norm", "16384x4096", rms(16384, 4096)),
        ("swiglu_packed", "8192x2*4096", swi(8192, 4096)),
        ("cross_entropy", "1024x32000", ce(1024, 32000)),
        ("cross_entropy", "8192x128256", ce(8192, 128256)),
    ]


def _breakdown() -> list[dict]:
    """Host ms of each layer of one small op (packed SwiGLU at 8192 × 2·4096 bf16), inside out, with the
    dispatcher path and two peers for scale."""
    import importlib

    import torch.nn.functional as F
    from torch._library.triton import set_wrap_triton_enabled

    from lck_kernels import _common, swiglu_packed
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

    def launch():  # as the op body launches: Triton directly, not through torch's tracing wrapper
        with set_wrap_triton_enabled(False):
            launch_fwd(gate, up, out)

    def impl():
        with set_wrap_triton_enabled(False):
            sp._fwd_impl(yd)

    def eager_fwd_bwd():
        a, b = y.chunk(2, -1)
        return torch.autograd.grad(F.silu(a) * b, y, dout)

    steps = [
        ("raw Triton launch", raw),
        ("launch_fwd (config + launch)", launch),
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
    _common.EagerOp.direct = False
    rows.append(
        {"step": "swiglu_packed fwd+bwd through the dispatcher", "host_ms": host_ms(steps[6][1], iters=50)}
    )
    _common.EagerOp.direct = True
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
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("host_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    print(f"{'op':<14} {'shape':<14} {'gpu ms':>8} {'host ms':>8} {'loop ms':>8}")
    profiles = {}
    for op, shape, fn in _cases():
        gpu = summarize(time_cuda(fn, warmup=3, iters=20))["median_ms"]
        host = host_ms(fn)
        loop = time_loop(fn, iters=30)
        rows.append({"op": op, "shape": shape, "gpu_ms": gpu, "host_ms": host, "loop_ms": loop})
        print(
            f"{op:<14} {shape:<14} {gpu:8.3f} {host if host is not None else float('nan'):8.3f} {loop:8.3f}"
        )
        if shape in ("16384x1024", "1024x32000"):
            profiles[f"{op} {shape}"] = _profile(fn)
    breakdown = _breakdown()
    print("\nhost ms per call, layer by layer (packed SwiGLU 8192 x 2*4096 bf16):")
    for row in breakdown:
        ms = row["host_ms"]
        print(f"  {row['step']:<48} {ms if ms is not None else float('nan'):7.3f}")
    for name, text in profiles.items():
        print(f"\n--- cProfile of 200 x {name} forward+backward (own time first)\n{text}")
    path = args.out / f"host-overhead-{gpu_slug()}-{_dt.date.today().isoformat()}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"provenance": provenance(), "rows": rows, "breakdown": breakdown, "profiles": profiles}, indent=2
        )
    )
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
