"""RMSNorm benchmark suite: lck against torch eager (Hugging Face Llama style and ``F.rms_norm``),
torch.compile and Liger-Kernel, forward and forward+backward, bf16.

Shapes: the headline 16384×4096, hidden sizes 1024 and 8192 at 16384 tokens, a tiled row (20480, past the
fused path's 16384 limit) and Megatron's 3-D ``[seq, batch, hidden]`` layout. ``quick``: small
shapes only. Gradients are taken with ``torch.autograd.grad`` so nothing accumulates between iterations.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lck_kernels.bench._harness import Case, compiled, have

EPS = 1e-6


def _hf_llama_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What Hugging Face's LlamaRMSNorm computes, as a user would write it in eager torch."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * xf.to(x.dtype)


def _closures(fn, inputs: dict[str, Any]):
    x, w, g = inputs["x"], inputs["w"], inputs["g"]

    def fwd():
        return fn(x, w)

    def fwd_bwd():
        return torch.autograd.grad(fn(x, w), (x, w), g)

    return fwd, fwd_bwd


def _providers() -> dict[str, Any]:
    from lck_kernels.rms_norm import rms_norm

    providers = {
        "lck": lambda inp: _closures(lambda x, w: rms_norm(x, w, EPS), inp),
        "lck_in_place": lambda inp: _closures(lambda x, w: rms_norm(x, w, EPS, in_place=True), inp),
        "torch": lambda inp: _closures(_hf_llama_rms_norm, inp),
        "torch_rms_norm": lambda inp: _closures(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS), inp),
        "torch_compile": lambda inp: _closures(compiled(_hf_llama_rms_norm), inp),
    }
    if have("liger_kernel"):

        def liger(inp):
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # Liger's defaults (casting "llama", in_place=True), as LigerRMSNorm uses them.
            return _closures(lambda x, w: LigerRMSNormFunction.apply(x, w, EPS), inp)

        providers["liger"] = liger
    return providers


def _case(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> Case:
    hidden, rows = shape[-1], 1
    for s in shape[:-1]:
        rows *= s
    es = torch.finfo(dtype).bits // 8

    def make_inputs() -> dict[str, Any]:
        x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
        w = (torch.rand(hidden, device="cuda", dtype=dtype) + 0.5).requires_grad_(True)
        return {"x": x, "w": w, "g": torch.randn(shape, device="cuda", dtype=dtype)}

    fwd = 2 * rows * hidden * es + hidden * es + 4 * rows  # read x, w; write y, rstd
    bwd = 3 * rows * hidden * es + 2 * hidden * es + 4 * rows  # read dy, x, w, rstd; write dx, dw
    return Case(
        bench="rms_norm",
        shape="x".join(str(s) for s in shape),
        dtype=dtype,
        make_inputs=make_inputs,
        providers=_providers(),
        bytes={"fwd": fwd, "fwd_bwd": fwd + bwd},
    )


def cases(quick: bool) -> list[Case]:
    if quick:
        return [_case((4096, 4096)), _case((2048, 1024)), _case((512, 4, 2048))]
    shapes = [(16384, 4096)] + [(16384, h) for h in (1024, 8192)]
    shapes += [(4096, 20480), (4096, 4, 4096)]
    return [_case(s) for s in shapes]
