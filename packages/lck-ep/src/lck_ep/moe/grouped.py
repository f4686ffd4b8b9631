"""Grouped GEMMs over the expert-major layout: ``torch._grouped_mm`` (CUTLASS on Hopper/Blackwell) for
bf16 on CUDA, a loop of ``torch.matmul`` over experts elsewhere.

``ends`` ``[E]`` int32 are the cumulative segment ends (``offsets[1:]``); rows past ``ends[-1]`` belong to
no expert: the forward products leave them unwritten and the weight gradients ignore them.

What ``torch._grouped_mm`` needs here (aten's ``GroupedMMUtils.h`` / ``GroupMMCommon.cuh``, torch 2.9 to
2.15): int32 offsets with unit stride; 16-byte aligned base pointers; each operand row-major or
column-major in its last two dimensions with the leading stride a multiple of 16 bytes (bf16: hidden and
ffn multiples of 8). Segment sizes need no alignment for these layouts: the activations' row offsets move
along their outer dimension, and in the weight gradient (2-D × 2-D, A column-major, B row-major) empty
segments are allowed: zero matrices on SM90, not on SM100 (pytorch issue 172439), where they are cleared. The bf16 kernel reads the offsets on the device (no host
synchronisation); other dtypes on CUDA take the loop here, which reads them on the host.
"""

from __future__ import annotations

import functools

import torch

from lck_ep.moe import launch


@functools.cache
def _fast_device(index: int) -> bool:
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(index)[0] in (9, 10)


@functools.cache
def _blackwell(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 10


def grouped_fast(a: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm``'s device kernel serves ``a`` (bf16 on CUDA, compute capability 9.x/10.x)."""
    if a.device.type != "cuda" or a.dtype != torch.bfloat16:
        return False
    return _fast_device(a.device.index if a.device.index is not None else torch.cuda.current_device())


def _segments(ends: torch.Tensor) -> list[tuple[int, int]]:
    stops = [int(v) for v in ends.tolist()]
    starts = [0, *stops[:-1]]
    return list(zip(starts, stops))


def mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``out[rows of j] = a[rows of j] @ b[j]``: ``a`` ``[M, K]``, ``b`` ``[E, K, N]`` (any of the two
    layouts in its last two dimensions) → ``[M, N]`` in ``a.dtype``; rows past ``ends[-1]`` undefined."""
    if grouped_fast(a) and a.shape[0]:
        return torch._grouped_mm(a, b, offs=ends)
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    segments = _segments(ends)
    for j, (s, e) in enumerate(segments):
        if e > s:
            torch.matmul(a[s:e], b[j], out=out[s:e])
    out[segments[-1][1] if segments else 0 :].zero_()  # the offsets are on the host here: zeros cost nothing
    return out


def mm_weight_grad(a: torch.Tensor, g: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``out[j] = a[rows of j]^T @ g[rows of j]``: ``a`` ``[M, K]``, ``g`` ``[M, N]`` → ``[E, K, N]`` in
    ``a.dtype`` (zero for an expert without rows)."""
    if grouped_fast(a) and a.shape[0]:
        out = torch._grouped_mm(a.t(), g, offs=ends)
        if _blackwell(a.device):
            # torch._grouped_mm leaves an empty group's weight gradient nonzero on SM100 (pytorch issue
            # 172439; zero on SM90): clear those experts, programs of the others return at once.
            launch.zero_empty_experts(out, ends)
        return out
    num = ends.numel()
    out = torch.zeros(num, a.shape[1], g.shape[1], dtype=a.dtype, device=a.device)
    for j, (s, e) in enumerate(_segments(ends)):
        if e > s:
            torch.matmul(a[s:e].t(), g[s:e], out=out[j])
    return out
