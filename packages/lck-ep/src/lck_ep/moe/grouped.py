"""Grouped GEMMs over the expert-major layout: the forward's Triton kernels (``gemm_kernels.py``: the first
GEMM with the weighted SwiGLU as its epilogue, the second plain) where their tiles fit, ``torch._grouped_mm``
(CUTLASS on Hopper/Blackwell) for bf16 on CUDA otherwise and in the backward, and a loop of ``torch.matmul``
over experts elsewhere.

The Triton forward serves CUDA bf16/fp16 on compute capability 9.x and later (TMA) with contiguous expert
weights and expanded rows, ``hidden`` and ``ffn`` multiples of 64, and the Triton interpreter on CPU (float32,
small tiles, for the tests); ``LCK_EP_MOE_FUSED=0`` turns it off (the separate passes then run).

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
import os
from typing import NamedTuple

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


class GemmTile(NamedTuple):
    """One Triton GEMM's launch: tile sizes, warps and pipeline stages, and the grid. ``programs_per_sm``
    0 launches one program per tile of the most-tiles routing (programs past the last tile return at once);
    a positive value launches that many programs per SM, each looping over tiles (persistent), with the
    loop over tiles and K steps flattened into one pipelined loop when ``flatten``."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    programs_per_sm: int = 0
    flatten: bool = False
    warp_specialize: bool = False


class Tiles(NamedTuple):
    """Launches of the Triton forward's two GEMMs; the first GEMM's ``block_n`` columns are taken from the
    gate and from the up half each."""

    gemm1: GemmTile
    gemm2: GemmTile


@functools.cache
def _kernels():  # imported on first use: `import lck_ep.moe` stays cheap
    from lck_ep.moe import gemm_kernels

    return gemm_kernels


def _divisor(n: int, options: tuple[int, ...]) -> int | None:
    return next((c for c in options if n % c == 0), None)


def forward_tiles(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Tiles | None:
    """The Triton forward's tiles for these operands, or None where it does not serve them (see above)."""
    if os.environ.get("LCK_EP_MOE_FUSED", "1") == "0":
        return None
    if not (tma_rows(w1) and tma_rows(w2)):
        return None
    hidden, ffn = w1.shape[1], w1.shape[2] // 2
    if x.device.type == "cuda":
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if x.dtype not in (torch.bfloat16, torch.float16) or not _tma_device(index):
            return None
        # 128 x 256 output tiles (both GEMMs), 64-deep steps, 4 stages: measured best of seven on an H200.
        bm, bk, warps, stages, n1, n2 = 128, 64, 8, 4, (128, 64), (256, 128, 64)
    elif x.device.type == "cpu" and launch.interpreting() and x.dtype == torch.float32:
        # float32 only: under the interpreter these kernels gave wrong values for bf16 (the separate passes do not)
        bm, bk, warps, stages, n1, n2 = 16, 16, 1, 1, (16, 8), (16, 8)
    else:
        return None
    bn1, bn2 = _divisor(ffn, n1), _divisor(hidden, n2)
    if bn1 is None or bn2 is None or hidden % bk or ffn % bk:
        return None
    # Persistent grids, one program per SM (benchmarks/grouped_gemm_probe.py --part persist, H200): the
    # second GEMM's short K (12 steps) gains most from flattening its tile and K loops, so the next tile's
    # loads overlap this one's stores (0.405 -> 0.360 ms back to back); the first, with two accumulators,
    # loses with flattening (0.93 ms) and gains a little without (0.720 -> 0.698 ms).
    return Tiles(
        GemmTile(bm, bn1, bk, warps, stages, programs_per_sm=1),
        GemmTile(bm, bn2, bk, warps, stages, programs_per_sm=1, flatten=True),
    )


def tma_rows(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows can be read through a TMA descriptor (contiguous, 16-byte aligned)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


@functools.cache
def _tma_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(t: GemmTile, m: int, num_experts: int, n_cols: int, device: torch.device) -> tuple[int]:
    """Programs of one launch: every tile of the most-tiles routing (each expert's segment may end in a
    partial row tile), or at most ``programs_per_sm`` per SM when persistent."""
    most = (-(-m // t.block_m) + num_experts) * (n_cols // t.block_n)
    if t.programs_per_sm <= 0:
        return (most,)
    if device.type != "cuda":
        sms = 4  # the interpreter: a few programs, each looping over several tiles
    else:
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return (max(1, min(most, sms * t.programs_per_sm)),)


def gemm_swiglu(
    a: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, ends: torch.Tensor, tiles: Tiles, keep_h: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(h [M, 2F] or None, act [M, F])``: ``h = a @ W1[e]`` per expert segment and
    ``act = w * silu(h[:, :F]) * h[:, F:]`` with the rows' ``[M]`` float32 routing weights ``w``, as
    :func:`mm` and ``launch.swiglu_weighted_fwd`` give them (``a`` ``[M, hidden]`` contiguous). ``h`` only
    when ``keep_h``; rows past ``ends[-1]`` are left undefined. No host synchronisation."""
    m = a.shape[0]
    e, hidden, ffn = w1.shape[0], w1.shape[1], w1.shape[2] // 2
    act = torch.empty(m, ffn, dtype=a.dtype, device=a.device)
    h = torch.empty(m, 2 * ffn, dtype=a.dtype, device=a.device) if keep_h else None
    if m == 0:
        return h, act
    t = tiles.gemm1
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    launch.run(_kernels()._swiglu_gemm_kernel, _grid(t, m, e, ffn, a.device),
        _descriptor(a, [bm, bk]), _descriptor(w1.view(e * hidden, 2 * ffn), [bk, bn]), w, ends,
        h if h is not None else act, act, hidden, ffn, h.stride(0) if h is not None else 0, act.stride(0),
        NUM_E=e, E_BLOCK=max(2, launch.next_pow2(e)), WRITE_H=keep_h, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        FLATTEN=t.flatten, WARP_SPECIALIZE=t.warp_specialize, num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    return h, act


def gemm_swiglu_gather(
    x: torch.Tensor,
    entry: torch.Tensor,
    w_flat: torch.Tensor,
    num_topk: int,
    w1: torch.Tensor,
    ends: torch.Tensor,
    tiles: Tiles,
) -> torch.Tensor:
    """``act [M, F]`` of :func:`gemm_swiglu` (without ``h``) for the rows ``x[entry[m] // num_topk]`` (zero
    where ``entry[m] < 0``, as ``launch.gather_rows`` gives them) with the routing weights
    ``w_flat[entry[m]]``, read from ``x`` ``[T, hidden]`` (contiguous) as the kernel needs them: no gathered
    copy. Rows past ``ends[-1]`` are left undefined. No host synchronisation."""
    m = entry.numel()
    e, hidden, ffn = w1.shape[0], w1.shape[1], w1.shape[2] // 2
    act = torch.empty(m, ffn, dtype=x.dtype, device=x.device)
    if m == 0:
        return act
    t = tiles.gemm1
    bn, bk = t.block_n, t.block_k
    launch.run(_kernels()._swiglu_gemm_gather_kernel, _grid(t, m, e, ffn, x.device),
        x, entry, w_flat, _descriptor(w1.view(e * hidden, 2 * ffn), [bk, bn]), ends, act, hidden, ffn,
        x.stride(0), num_topk, act.stride(0), NUM_E=e, E_BLOCK=max(2, launch.next_pow2(e)), BLOCK_M=t.block_m,
        BLOCK_N=bn, BLOCK_K=bk, FLATTEN=t.flatten, WARP_SPECIALIZE=t.warp_specialize, num_warps=t.warps,
        num_stages=t.stages,
    )  # fmt: skip
    return act


def mm_tiled(
    a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, tiles: Tiles, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`mm` through the Triton kernel (``b`` contiguous ``[E, K, N]``, ``a`` ``[M, K]`` contiguous), into
    ``out`` (``[M, N]`` in ``a.dtype``, rows ``N`` apart) when given."""
    m, k = a.shape
    e, n = b.shape[0], b.shape[2]
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    t = tiles.gemm2
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    launch.run(_kernels()._grouped_gemm_kernel, _grid(t, m, e, n, a.device),
        _descriptor(a, [bm, bk]), _descriptor(b.view(e * k, n), [bk, bn]), out, ends, n, k, out.stride(0),
        NUM_E=e, E_BLOCK=max(2, launch.next_pow2(e)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FLATTEN=t.flatten,
        WARP_SPECIALIZE=t.warp_specialize, num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    return out


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
