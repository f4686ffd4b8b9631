"""Where a smaller fused-linear-CE chunk loses time: each per-chunk GEMM alone, and alternatives to them.

At 8192×4096→128256 bf16, for chunk lengths 512 / 1024 / 2048 tokens, loop ms (calls back to back between
CUDA events, after a warm-up) of: the logits GEMM ``x_c·Wᵀ``, the row-gradient GEMM ``dlogits·W`` (plain,
and split over the vocabulary into ``s`` batched partial products summed in float32), the weight-gradient
update ``grad_W += dlogitsᵀ·x_c`` (``addmm_``, and the transposed ``grad_Wᵀ`` form), and the two gradient
GEMMs of a chunk issued on two streams. Totals are per 8192 tokens (chunks × per-chunk time). A
diagnostic for choosing the schedule, not a benchmark of lck; writes ``flce-gemm-profile-<gpu>-<date>.json``.

    python packages/lck-kernels/benchmarks/flce_gemm_profile.py [--iters 20]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from pathlib import Path

import torch

from lck_runtime.benchmarking import gpu_slug, provenance, time_loop

N, H, V = 8192, 4096, 128256


def _loop_ms(fn, iters: int) -> float:
    return time_loop(fn, iters=iters, warmup=3)


def _profile_chunk(c: int, x, w, gw, gwt, side, iters: int) -> dict[str, float]:
    dt = x.dtype
    g = torch.randn(c, V, device="cuda", dtype=dt) * 1e-4
    xc = x[:c]
    gx = torch.empty(c, H, device="cuda", dtype=dt)
    out: dict[str, float] = {}
    out["logits"] = _loop_ms(lambda: torch.mm(xc, w.t(), out=g), iters)
    g.normal_().mul_(1e-4)
    out["grad_x"] = _loop_ms(lambda: torch.mm(g, w, out=gx), iters)
    for s in (2, 4, 8):
        gs = g.view(c, s, V // s).transpose(0, 1)
        ws = w.view(s, V // s, H)

        def split(gs=gs, ws=ws):
            try:  # float32 partials where this torch offers them, else bf16 ones summed in float32
                part = torch.bmm(gs, ws, out_dtype=torch.float32)
            except TypeError:
                part = torch.bmm(gs, ws)
            gx.copy_(part.sum(0, dtype=torch.float32))

        out[f"grad_x_split{s}"] = _loop_ms(split, iters)
    out["grad_w_addmm"] = _loop_ms(lambda: gw.addmm_(g.t(), xc), iters)
    out["grad_wT_addmm"] = _loop_ms(lambda: gwt.addmm_(xc.t(), g), iters)

    def two_streams():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gw.addmm_(g.t(), xc)
        torch.mm(g, w, out=gx)
        torch.cuda.current_stream().wait_stream(side)

    out["grads_two_streams"] = _loop_ms(two_streams, iters)
    out["grads_one_stream"] = _loop_ms(lambda: (torch.mm(g, w, out=gx), gw.addmm_(g.t(), xc)), iters)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dt = torch.bfloat16
    x = torch.randn(N, H, device="cuda", dtype=dt) * 0.5
    w = torch.randn(V, H, device="cuda", dtype=dt) * H**-0.5
    gw = torch.randn(V, H, device="cuda", dtype=dt) * 1e-3
    gwt = torch.randn(H, V, device="cuda", dtype=dt) * 1e-3
    side = torch.cuda.Stream()
    rows = []
    for c in (512, 1024, 2048):
        out = _profile_chunk(c, x, w, gw, gwt, side, args.iters)
        n_chunks = N // c
        rows.append({"chunk": c, "chunks": n_chunks, "per_chunk_ms": out,
                     "per_8192_ms": {k: v * n_chunks for k, v in out.items()}})  # fmt: skip
        print(c, {k: round(v * n_chunks, 3) for k, v in out.items()}, flush=True)
    doc = {"provenance": provenance(), "shape": [N, H, V], "dtype": "bf16", "iters": args.iters, "rows": rows}
    name = f"flce-gemm-profile-{gpu_slug()}-{_dt.date.today().isoformat()}.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / name).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
