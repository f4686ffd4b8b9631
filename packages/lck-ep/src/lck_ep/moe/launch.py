"""Launches of the MoE kernels (``kernels.py``), and the same arithmetic in torch ops where Triton cannot
run (CPU tensors without ``TRITON_INTERPRET=1``).

Nothing here validates input: :mod:`lck_ep.moe.checks` does that before anything runs. Outputs are
allocated here, once per call. Every function is free of host synchronisation on CUDA.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

_ROW_TILE = 2048  # elements per program of the row-wise kernels: two 16-byte vectors per thread for bf16


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels serve tensors on ``t``'s device: CUDA, or CPU under the interpreter."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())


@functools.cache
def _kernels():  # imported on first use: `import lck_ep.moe` stays cheap
    from lck_ep.moe import kernels

    return kernels


@functools.cache
def _launch_for():  # lck-kernels (and Triton) imported on first use: `import lck_ep.moe` stays cheap
    from lck_kernels._eager import launch_for

    return launch_for


def run(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)`` through lck-kernels' pre-bound launcher: on a GPU the compiled
    kernel's own entry point, fetched once per argument specialisation, instead of Triton's generic
    per-call path (argument binding, specialisation and cache key on every call); the interpreter and
    launch hooks (profilers) keep the generic path. ``args``: every runtime argument in the kernel's order;
    ``meta``: its constexprs and launch options."""
    _launch_for()(kernel, **meta).raw(grid, *args)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _row_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a row-wise kernel over ``n_cols`` columns."""
    # A power of two that divides the row (768 → 256) wastes no lanes; else the next power of two.
    block_n = next((c for c in (1024, 512, 256, 128) if n_cols % c == 0), min(next_pow2(n_cols), 1024))
    block_m = max(1, _ROW_TILE // block_n)
    warps = 4 if block_m * block_n >= 1024 else 1
    return block_m, block_n, warps


def gather_rows(
    x: torch.Tensor, entry: torch.Tensor, num_topk: int, w_flat: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out[m] = x[entry[m] // num_topk]`` (zero where ``entry[m] < 0``) ``[M, H]`` in ``x.dtype``, and
    ``w_out[m] = w_flat[entry[m]]`` ``[M]`` float32 (0 where ``entry[m] < 0``) when ``w_flat`` is given."""
    m, h = entry.numel(), x.shape[1]
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    w_out = None if w_flat is None else torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return out, w_out
    if not use_triton(x):
        valid = (entry >= 0).unsqueeze(1)
        src = torch.where(entry >= 0, torch.div(entry, num_topk, rounding_mode="floor"), 0)
        rows = x.index_select(0, src) if x.shape[0] else torch.zeros_like(out)
        out.copy_(torch.where(valid, rows, torch.zeros((), dtype=x.dtype)))
        if w_flat is not None and w_out is not None:
            picked = w_flat.index_select(0, entry.clamp(min=0)) if w_flat.numel() else torch.zeros_like(w_out)
            w_out.copy_(torch.where(entry >= 0, picked, 0.0))
        return out, w_out
    # 8 rows x 256 columns per program: 0.088 ms at 65536 x 2048 bf16 on an H200, against 0.102 for
    # 2 x 1024 (benchmarks/grouped_gemm_probe.py --part tiles).
    block_n = min(next_pow2(h), 256)
    block_m = max(1, 2048 // block_n)
    grid = (triton_cdiv(m, block_m), triton_cdiv(h, block_n))
    run(_kernels()._gather_rows_kernel, grid,
        x, w_flat if w_flat is not None else out, entry, out, w_out if w_out is not None else out,
        m, h, num_topk, x.stride(0), out.stride(0),
        HAS_W=w_flat is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out, w_out


def swiglu_weighted_fwd(h: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``act = w[:, None] * silu(h[:, :F]) * h[:, F:]`` ``[M, F]`` in ``h.dtype`` (float32 arithmetic) on
    the rows before ``ends[-1]``; later rows (in no expert's segment) are left undefined."""
    m, f = h.shape[0], h.shape[1] // 2
    act = torch.empty(m, f, dtype=h.dtype, device=h.device)
    if m == 0:
        return act
    if not use_triton(h):
        g, u = h[:, :f].float(), h[:, f:].float()
        act.copy_(torch.nn.functional.silu(g) * u * w.unsqueeze(1))
        return act
    bm, bn, warps = _row_config(f)
    run(_kernels()._swiglu_weighted_fwd_kernel, (triton_cdiv(m, bm), triton_cdiv(f, bn)),
        h, w, act, ends[-1:], f, h.stride(0), act.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip
    return act


def swiglu_weighted_bwd(
    h: torch.Tensor, w: torch.Tensor, dact: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dh [M, 2F] in h.dtype, dw [M] float32, act [M, F] in h.dtype)`` for ``act = w * silu(g) * u`` on
    the rows before ``ends[-1]``; later rows: ``dw = 0``, ``dh`` and ``act`` undefined."""
    m, f = h.shape[0], h.shape[1] // 2
    dh = torch.empty(m, 2 * f, dtype=h.dtype, device=h.device)
    dw = torch.empty(m, dtype=torch.float32, device=h.device)
    act = torch.empty(m, f, dtype=h.dtype, device=h.device)
    if m == 0:
        return dh, dw, act
    if not use_triton(h):
        g, u, da = h[:, :f].float(), h[:, f:].float(), dact.float()
        s = torch.sigmoid(g)
        silu = g * s
        a = silu * u
        in_use = torch.arange(m, device=h.device) < ends[-1]
        dw.copy_(torch.where(in_use, (da * a).sum(1), 0.0))
        daw = da * w.unsqueeze(1)
        dh[:, :f].copy_(daw * u * (s + silu * (1.0 - s)))
        dh[:, f:].copy_(daw * silu)
        act.copy_(a * w.unsqueeze(1))
        return dh, dw, act
    # Whole rows per program (the weight gradient is a row sum): a few rows of up to 256 columns at a time.
    bn = min(next_pow2(f), 256)
    bm = max(1, 1024 // bn)
    run(_kernels()._swiglu_weighted_bwd_kernel, (triton_cdiv(m, bm),),
        h, w, dact, dh, dw, act, ends[-1:], m, f, h.stride(0), dact.stride(0), dh.stride(0), act.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
    )  # fmt: skip
    return dh, dw, act


def reduce_rows(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[t] = cast(sum over k ascending of float32(y[index[t, k]]))`` over ``index[t, k] >= 0``,
    ``[T, H]`` in ``y.dtype``; the order of :func:`lck_ep.expanded.reduce_expanded`."""
    t, k = index.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    if t == 0:
        return out
    if not use_triton(y):
        acc = torch.zeros(t, h, dtype=torch.float32, device=y.device)
        for slot in range(k):
            idx = index[:, slot]
            rows = y.index_select(0, idx.clamp(min=0)).float() if y.shape[0] else torch.zeros_like(acc)
            acc = acc + torch.where((idx >= 0).unsqueeze(1), rows, 0.0)
        out.copy_(acc)
        return out
    block_n = min(next_pow2(h), 1024)
    run(_kernels()._reduce_rows_kernel, (t, triton_cdiv(h, block_n)),
        y, index, out, h, k, y.stride(0), out.stride(0), BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out


def zero_empty_experts(out: torch.Tensor, ends: torch.Tensor) -> None:
    """``out[j] = 0`` for every expert j whose segment (``ends[j-1]..ends[j]``) is empty; reads the ends on
    the device (no host synchronisation)."""
    num, per = out.shape[0], out[0].numel() if out.shape[0] else 0
    if num == 0 or per == 0:
        return
    if not use_triton(out):
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        keep = (ends > starts).view(-1, *([1] * (out.dim() - 1)))
        out.copy_(torch.where(keep, out, torch.zeros((), dtype=out.dtype)))
        return
    run(_kernels()._zero_empty_experts_kernel, (num, 16), out, ends, per, SPLITS=16, BLOCK=1024, num_warps=4)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
