"""Where the MoE layer's forward time goes, and whether a grouped GEMM beats ``torch._grouped_mm`` there.

At the Qwen3-30B-A3B expert shape (8192 tokens, top-8, 128 experts, hidden 2048, ffn 768, bf16, balanced
random routing) on one GPU, three questions, answered side by side in one process:

1. ``torch._grouped_mm`` with the expert weights stored as the layer stores them (``[E, K, N]``, N
   contiguous) against the same weights stored K-contiguous (a transposed view of ``[E, N, K]``), for both
   forward GEMMs;
2. a Triton grouped GEMM over the same expert-major rows (TMA loads, one expert per row tile, rows of
   other experts masked at the store) at several tile configurations, with its largest difference from
   ``torch._grouped_mm`` relative to the output's largest magnitude;
3. the GPU time of every kernel of :class:`lck_ep.MoEExperts`' forward (``torch.profiler``);
4. (``--part tiles``) lck's fused first GEMM (:func:`lck_ep.moe.grouped.gemm_swiglu`) at several tiles, and
   the row gather and per-token reduction kernels at several block shapes.

Every timed row has GPU time (L2 flushed, host given a head start), host time and loop time. Output:
``<out>/grouped-gemm-probe-<gpu>-<date>-<commit>.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from lck_ep.moe.gemm_kernels import _locate, _swiglu_acc, _swiglu_store, _tile_counts

# fmt: off


@triton.jit
def _program_tile(ends_ptr, n_cols, NUM_E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """(expert, first row, segment end, live, first column) of this program's tile, one program per tile."""
    pid = tl.program_id(0)
    n_tiles = n_cols // BLOCK_N
    tiles, cum = _tile_counts(ends_ptr, NUM_E, E_BLOCK, BLOCK_M)
    live = pid < tl.sum(tiles, 0) * n_tiles
    e, row0, end, col0 = _locate(ends_ptr, tl.where(live, pid, 0), n_tiles, tiles, cum, BLOCK_M, BLOCK_N)
    return e, row0, end, live, col0


@triton.jit
def _grouped_mm_probe_kernel(
    a_desc, b_desc, c_ptr, ends_ptr, n_cols, k_dim, stride_c,
    NUM_E: tl.constexpr, E_BLOCK: tl.constexpr, B_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The layer's plain grouped GEMM with B optionally K-major (``n_cols`` a multiple of BLOCK_N)."""
    e, row0, end, live, col0 = _program_tile(ends_ptr, n_cols, NUM_E, E_BLOCK, BLOCK_M, BLOCK_N)
    if live:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_dim, BLOCK_K):
            a = a_desc.load([row0, k])
            if B_KMAJOR:
                b = b_desc.load([e * n_cols + col0, k]).T
            else:
                b = b_desc.load([e * k_dim + k, col0])
            acc = tl.dot(a, b, acc)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < end)[:, None] & (cols < n_cols)[None, :])


@triton.jit
def _swiglu_gemm_one_acc_kernel(
    a_desc, b3_desc, w_ptr, ends_ptr, act_ptr, hidden, ffn, stride_act, NUM_E: tl.constexpr,
    E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The fused first GEMM with one [BLOCK_M, 2 * BLOCK_N] accumulator: W1 read as [E * hidden, 2, ffn]
    boxes of [BLOCK_K, 2, BLOCK_N] (gate and up columns side by side), split in the epilogue."""
    e, row0, end, live, col0 = _program_tile(ends_ptr, ffn, NUM_E, E_BLOCK, BLOCK_M, BLOCK_N)
    if live:
        b_row = e * hidden
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(0, hidden, BLOCK_K):
            b = tl.reshape(b3_desc.load([b_row + k, 0, col0]), (BLOCK_K, 2 * BLOCK_N))
            acc = tl.dot(a_desc.load([row0, k]), b, acc)
        g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        g = g.to(act_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(act_ptr.dtype.element_ty).to(tl.float32)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        cols = col0 + tl.arange(0, BLOCK_N)
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        act = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _swiglu_gemm_half_tail_kernel(
    a_desc, a_half_desc, b_desc, w_ptr, ends_ptr, act_ptr, hidden, ffn, stride_act, NUM_E: tl.constexpr,
    E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The layer's TMA first GEMM (no ``h``, persistent) where a segment's last row tile holding at most
    ``BLOCK_M // 2`` rows runs at that height in place (a branch per tile): fewer products for nothing."""
    tiles, cum = _tile_counts(ends_ptr, NUM_E, E_BLOCK, BLOCK_M)
    n_tiles = ffn // BLOCK_N
    for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0) * n_tiles, tl.num_programs(0)):
        e, row0, end, col0 = _locate(ends_ptr, tile, n_tiles, tiles, cum, BLOCK_M, BLOCK_N)
        if end - row0 <= BLOCK_M // 2:  # names of their own: a branch's values keep one shape in Triton
            half_g, half_u = _swiglu_acc(a_half_desc, b_desc, row0, e * hidden, col0, hidden, ffn, BLOCK_M // 2,
                                         BLOCK_N, BLOCK_K)
            half_rows = row0 + tl.arange(0, BLOCK_M // 2)
            half_w = tl.load(w_ptr + half_rows, mask=half_rows < end, other=0.0)
            _swiglu_store(half_g, half_u, half_w, half_rows, half_rows < end, col0, act_ptr, act_ptr, ffn, 0,
                          stride_act, False, BLOCK_N)
        else:
            acc_g, acc_u = _swiglu_acc(a_desc, b_desc, row0, e * hidden, col0, hidden, ffn, BLOCK_M, BLOCK_N, BLOCK_K)
            rows = row0 + tl.arange(0, BLOCK_M)
            w = tl.load(w_ptr + rows, mask=rows < end, other=0.0)
            _swiglu_store(acc_g, acc_u, w, rows, rows < end, col0, act_ptr, act_ptr, ffn, 0, stride_act, False,
                          BLOCK_N)


# fmt: on


def swiglu_half_tail(a, w, w1, ends):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = 128, 128, 64
    e, hidden, ffn = w1.shape[0], w1.shape[1], w1.shape[2] // 2
    act = torch.empty(a.shape[0], ffn, dtype=a.dtype, device=a.device)
    grid = (torch.cuda.get_device_properties(a.device).multi_processor_count,)
    _swiglu_gemm_half_tail_kernel[grid](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(a, [bm // 2, bk]),
        TensorDescriptor.from_tensor(w1.view(e * hidden, 2 * ffn), [bk, bn]), w, ends, act, hidden, ffn,
        act.stride(0), NUM_E=e, E_BLOCK=max(2, triton.next_power_of_2(e)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=8, num_stages=4,
    )  # fmt: skip
    return act


class _Energy:
    """The GPU's energy counter (NVML ``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded),
    read through ctypes: energy per call = the counter's rise over a long loop of calls."""

    def __init__(self) -> None:
        import ctypes

        self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
        assert self._nvml.nvmlInit_v2() == 0
        self._handle = ctypes.c_void_p()
        index = torch.cuda.current_device()
        assert self._nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)) == 0
        self._ct = ctypes

    def mj(self) -> int:
        value = self._ct.c_ulonglong()
        assert self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle, self._ct.byref(value)) == 0
        return int(value.value)


def _energy_of(fn: Any, energy: _Energy, seconds: float = 2.0) -> dict[str, Any]:
    """GPU time, loop time (50 calls, as the bench) and, over a loop of about ``seconds``, the loop time and
    the energy per call (mJ) with the mean power (W)."""
    import time

    from lck_runtime.benchmarking import time_loop

    out = _measure(fn, loop_iters=50, loop_warmup=5)
    n = max(50, int(seconds / (out["loop_ms"] * 1e-3)))
    torch.cuda.synchronize()
    time.sleep(0.5)  # let the counter and the clocks settle after the shorter loops
    e0 = energy.mj()
    ms = time_loop(fn, iters=n, warmup=0) * n  # synchronised at both ends: the counter brackets the loop
    e1 = energy.mj()
    out.update(long_loop_calls=n, long_loop_ms=ms / n, mj_per_call=(e1 - e0) / n, mean_w=(e1 - e0) / ms)
    return out


def swiglu_one_acc(a, w, w1, ends, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages = cfg
    e, hidden, ffn = w1.shape[0], w1.shape[1], w1.shape[2] // 2
    act = torch.empty(a.shape[0], ffn, dtype=a.dtype, device=a.device)
    grid = ((triton.cdiv(a.shape[0], bm) + e) * (ffn // bn),)
    _swiglu_gemm_one_acc_kernel[grid](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w1.view(e * hidden, 2, ffn), [bk, 2, bn]),
        w, ends, act, hidden, ffn, act.stride(0), NUM_E=e, E_BLOCK=max(2, triton.next_power_of_2(e)), BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return act


def triton_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, cfg: tuple[int, int, int, int, int], kmajor: bool
) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]``; ``b`` ``[E, K, N]`` (``kmajor``: a transposed ``[E, N, K]``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages = cfg
    m, k = a.shape
    e, _, n = b.shape
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    if kmajor:
        b2 = b.transpose(1, 2).reshape(e * n, k)  # a view: b is the transpose of a contiguous [E, N, K]
        b_desc = TensorDescriptor.from_tensor(b2, [bn, bk])
    else:
        b_desc = TensorDescriptor.from_tensor(b.reshape(e * k, n), [bk, bn])
    grid = ((triton.cdiv(m, bm) + e) * triton.cdiv(n, bn),)
    _grouped_mm_probe_kernel[grid](
        a_desc, b_desc, out, ends, n, k, out.stride(0), NUM_E=e, E_BLOCK=triton.next_power_of_2(e),
        B_KMAJOR=kmajor, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4),
    (128, 64, 64, 4, 5),
]


def _tiles(lay: Any, x_e: Any, w1: Any, w2: Any, t: int, k: int) -> list[dict[str, Any]]:
    """gemm_swiglu at several tiles; gather_rows and reduce_rows kernels at several block shapes."""
    from lck_ep.moe import grouped, kernels, launch

    out: list[dict[str, Any]] = []
    w_e = torch.rand(x_e.shape[0], device=x_e.device)
    rows = int(lay.ends[-1])
    want = None
    for cfg in [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4),
                (64, 128, 64, 4, 4), (128, 128, 32, 8, 4)]:  # fmt: skip
        tiles = grouped.Tiles(grouped.GemmTile(*cfg), grouped.GemmTile(128, 256, 64, 8, 4))
        for keep_h in (True, False):
            rec: dict[str, Any] = {
                "gemm": "gemm_swiglu",
                "provider": "lck_{}x{}x{}_w{}_s{}".format(*cfg) + ("_h" * keep_h),
            }
            try:
                fn = lambda tiles=tiles, keep_h=keep_h: grouped.gemm_swiglu(
                    x_e, w_e, w1, lay.ends, tiles, keep_h
                )[1]
                got = fn()[:rows].float()
                want = got if want is None else want
                rec["max_rel_diff"] = float((got - want).abs().max() / want.abs().max())
                rec.update(_measure(fn))
            except Exception as exc:
                rec["error"] = repr(exc)[:400]
            out.append(rec)
            print(rec, flush=True)
    x = torch.randn(t, x_e.shape[1], device=x_e.device, dtype=x_e.dtype)
    wf = torch.rand(t * k, device=x_e.device)
    m, hd = lay.entry.numel(), x.shape[1]
    for bm, bn, warps in [(2, 1024, 4), (4, 1024, 4), (8, 1024, 8), (1, 2048, 8), (4, 2048, 8), (8, 256, 4)]:
        o = torch.empty(m, hd, device=x.device, dtype=x.dtype)
        wo = torch.empty(m, device=x.device)

        def gather(bm=bm, bn=bn, warps=warps, o=o, wo=wo):
            kernels._gather_rows_kernel[(launch.triton_cdiv(m, bm), launch.triton_cdiv(hd, bn))](
                x, wf, lay.entry, o, wo, m, hd, k, x.stride(0), o.stride(0), HAS_W=True, BLOCK_M=bm,
                BLOCK_N=bn, num_warps=warps,
            )  # fmt: skip

        rec = {"gemm": "gather_rows", "provider": f"bm{bm}_bn{bn}_w{warps}", **_measure(gather)}
        out.append(rec)
        print(rec, flush=True)
    y = torch.randn(m, hd, device=x.device, dtype=x.dtype)
    for bn, warps in [(1024, 4), (2048, 4), (2048, 8), (512, 2), (512, 4), (256, 2)]:
        o = torch.empty(t, hd, device=x.device, dtype=x.dtype)

        def reduce(bn=bn, warps=warps, o=o):
            kernels._reduce_rows_kernel[(t, launch.triton_cdiv(hd, bn))](
                y, lay.index, o, hd, k, y.stride(0), o.stride(0), BLOCK_N=bn, num_warps=warps
            )

        rec = {"gemm": "reduce_rows", "provider": f"bn{bn}_w{warps}", **_measure(reduce)}
        out.append(rec)
        print(rec, flush=True)
    return out


def _tiles2(lay: Any, x_e: Any, act: Any, w1: Any, w2: Any) -> list[dict[str, Any]]:
    """The fused first GEMM with one accumulator (W1 as gate/up boxes) and two-accumulator tiles with deeper
    steps; the second GEMM at more tiles."""
    from lck_ep.moe import grouped

    out: list[dict[str, Any]] = []
    w_e = torch.rand(x_e.shape[0], device=x_e.device)
    rows = int(lay.ends[-1])
    base = grouped.Tiles(grouped.GemmTile(128, 128, 64, 8, 4), grouped.GemmTile(128, 256, 64, 8, 4))
    want1 = grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, base, False)[1][:rows].float()
    want2 = grouped.mm_tiled(act, w2, lay.ends, base)[:rows].float()
    runs: dict[tuple[str, str], Any] = {}
    for cfg in [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4)]:
        runs[("one_acc", "{}x{}x{}_w{}_s{}".format(*cfg))] = lambda cfg=cfg: swiglu_one_acc(
            x_e, w_e, w1, lay.ends, cfg
        )
    for cfg in [(128, 128, 64, 8, 4), (128, 128, 128, 8, 2), (128, 128, 128, 8, 3)]:
        tl_ = grouped.Tiles(grouped.GemmTile(*cfg), base.gemm2)
        runs[("two_acc", "{}x{}x{}_w{}_s{}".format(*cfg))] = lambda t_=tl_: grouped.gemm_swiglu(
            x_e, w_e, w1, lay.ends, t_, False
        )[1]
    for cfg in [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 128, 8, 2), (128, 256, 128, 8, 3),
                (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 128, 4, 4), (64, 256, 128, 4, 3)]:  # fmt: skip
        tl_ = grouped.Tiles(base.gemm1, grouped.GemmTile(*cfg))
        runs[("gemm2", "{}x{}x{}_w{}_s{}".format(*cfg))] = lambda t_=tl_: grouped.mm_tiled(
            act, w2, lay.ends, t_
        )
    for (kind, name), fn in runs.items():
        rec: dict[str, Any] = {"gemm": kind, "provider": name}
        try:
            got = fn()[:rows].float()
            want = want2 if kind == "gemm2" else want1
            rec["max_rel_diff"] = float((got - want).abs().max() / want.abs().max())
            rec.update(_measure(fn))
        except Exception as exc:
            rec["error"] = repr(exc)[:600]
        out.append(rec)
        print(rec, flush=True)
    return out


def _persist(lay: Any, x_e: Any, act: Any, w1: Any, w2: Any, layer_run: Any) -> list[dict[str, Any]]:
    """Pairs of launch choices for the two forward GEMMs (one program per tile; persistent grids with the
    tile and K loops flattened or not, warp specialisation), each GEMM alone and the layer's forward with the
    pair (``grouped.forward_tiles`` replaced), the layer twice. (f2b9517 also tried Triton's
    ``disallow_acc_multi_buffer`` on the flattened first GEMM: no change, 0.92 ms.)"""
    from lck_ep.moe import grouped

    out: list[dict[str, Any]] = []
    w_e = torch.rand(x_e.shape[0], device=x_e.device)
    rows = int(lay.ends[-1])
    g1, g2 = grouped.GemmTile(128, 128, 64, 8, 4), grouped.GemmTile(128, 256, 64, 8, 4)
    p = {"programs_per_sm": 1}
    pf = {**p, "flatten": True}
    pairs = {  # name: (first GEMM's changes, second GEMM's changes)
        "per_tile": ({}, {}),
        "persistent/flat": (p, pf),
        "flat/flat": (pf, pf),
        "flat_ws/flat": ({**pf, "warp_specialize": True}, pf),
        "persistent_ws/flat": ({**p, "warp_specialize": True}, pf),
    }
    base = grouped.Tiles(g1, g2)
    want1 = grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, base, False)[1][:rows].float()
    want2 = grouped.mm_tiled(act, w2, lay.ends, base)[:rows].float()
    real = grouped.forward_tiles
    results: dict[tuple[str, Any], bool] = {}
    for mode, (c1, c2) in pairs.items():
        tiles = grouped.Tiles(g1._replace(**c1), g2._replace(**c2))
        runs = {
            "gemm1": lambda t_=tiles: grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, t_, False)[1],
            "gemm2": lambda t_=tiles: grouped.mm_tiled(act, w2, lay.ends, t_),
        }
        for kind, fn in runs.items():
            key = (kind, tiles.gemm1 if kind == "gemm1" else tiles.gemm2)
            if key in results:
                continue
            rec: dict[str, Any] = {"gemm": kind, "provider": mode, "tile": list(key[1])}
            try:
                got = fn()[:rows].float()
                want = want1 if kind == "gemm1" else want2
                rec["max_rel_diff"] = float((got - want).abs().max() / want.abs().max())
                rec.update(_measure(fn))
                results[key] = True
            except Exception as exc:
                rec["error"] = repr(exc)[-600:]
                results[key] = False
            out.append(rec)
            print(rec, flush=True)
        if not (results[("gemm1", tiles.gemm1)] and results[("gemm2", tiles.gemm2)]):
            continue
        grouped.forward_tiles = lambda *a, t_=tiles: t_
        try:
            for _ in range(2):  # twice: the spread between the two is the noise
                rec = {"gemm": "layer_fwd", "provider": mode, **_measure(layer_run)}
                out.append(rec)
                print(rec, flush=True)
        finally:
            grouped.forward_tiles = real
    return out


def _pingpong(lay: Any, x_e: Any, act: Any, w1: Any, w2: Any, layer_run: Any) -> list[dict[str, Any]]:
    """Two persistent programs per SM on smaller tiles (one program's epilogue can then overlap the other's
    main loop), against the chosen pair; each GEMM alone and the layer with each pair, twice."""
    from lck_ep.moe import grouped

    out: list[dict[str, Any]] = []
    w_e = torch.rand(x_e.shape[0], device=x_e.device)
    rows = int(lay.ends[-1])
    chosen = grouped.Tiles(
        grouped.GemmTile(128, 128, 64, 8, 4, 1), grouped.GemmTile(128, 256, 64, 8, 4, 1, True)
    )
    want1 = grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, chosen, False)[1][:rows].float()
    want2 = grouped.mm_tiled(act, w2, lay.ends, chosen)[:rows].float()
    g1 = {
        "chosen": chosen.gemm1,
        "2/sm 128x64 w8 s4": grouped.GemmTile(128, 64, 64, 8, 4, 2),
        "2/sm 128x64 w4 s4": grouped.GemmTile(128, 64, 64, 4, 4, 2),
        "2/sm 128x128 w8 s2": grouped.GemmTile(128, 128, 64, 8, 2, 2),
        "1/sm 128x128 k128 s2": grouped.GemmTile(128, 128, 128, 8, 2, 1),
    }
    g2 = {
        "chosen": chosen.gemm2,
        "2/sm 128x128 w8 s4 flat": grouped.GemmTile(128, 128, 64, 8, 4, 2, True),
        "2/sm 128x128 w4 s4 flat": grouped.GemmTile(128, 128, 64, 4, 4, 2, True),
        "2/sm 128x128 w8 s4": grouped.GemmTile(128, 128, 64, 8, 4, 2),
    }
    best: dict[str, tuple[float, Any]] = {}
    for kind, table in (("gemm1", g1), ("gemm2", g2)):
        for name, t in table.items():
            tiles = chosen._replace(**{kind: t})
            fn = (
                (lambda t_=tiles: grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, t_, False)[1])
                if kind == "gemm1"
                else (lambda t_=tiles: grouped.mm_tiled(act, w2, lay.ends, t_))
            )
            rec: dict[str, Any] = {"gemm": kind, "provider": name, "tile": list(t)}
            try:
                got = fn()[:rows].float()
                want = want1 if kind == "gemm1" else want2
                rec["max_rel_diff"] = float((got - want).abs().max() / want.abs().max())
                rec.update(_measure(fn))
                if rec["max_rel_diff"] == 0.0 and rec["loop_ms"] < best.get(kind, (1e9, None))[0]:
                    best[kind] = (rec["loop_ms"], t)
            except Exception as exc:
                rec["error"] = repr(exc)[-600:]
            out.append(rec)
            print(rec, flush=True)
    real = grouped.forward_tiles
    pairs = {"chosen": chosen}
    if all(k in best for k in ("gemm1", "gemm2")):
        pairs["best"] = grouped.Tiles(best["gemm1"][1], best["gemm2"][1])
    try:
        for _ in range(2):
            for mode, tiles in pairs.items():
                grouped.forward_tiles = lambda *a, t_=tiles: t_
                rec = {
                    "gemm": "layer_fwd",
                    "provider": mode,
                    "tiles": [list(tiles.gemm1), list(tiles.gemm2)],
                    **_measure(layer_run),
                }
                out.append(rec)
                print(rec, flush=True)
    finally:
        grouped.forward_tiles = real
    return out


def _gather_fused(idx: Any, x: Any, wt: Any, w1: Any, w2: Any) -> list[dict[str, Any]]:
    """The row gather plus the TMA first GEMM (no ``h``) against the layer's kernel that gathers its rows
    itself (``grouped.gemm_swiglu_gather``), and each of the first two alone; outputs compared on the rows in
    use. (866c072 and 328ffee also timed a copy of that kernel at 3 stages, with 32-bit row offsets and
    writing ``h``: none faster.)"""
    from lck_ep.moe import grouped, launch
    from lck_ep.moe.permute import build_local_layout

    e, k = w1.shape[0], wt.shape[1]
    tiles = grouped.forward_tiles(x, w1, w2)
    lay = build_local_layout(idx, e, 1)
    wf = wt.reshape(-1).float().contiguous()
    rows = int(lay.ends[-1])
    x_e, w_e = launch.gather_rows(x, lay.entry, k, wf)

    def separate() -> Any:
        return grouped.gemm_swiglu(*launch.gather_rows(x, lay.entry, k, wf), w1, lay.ends, tiles, False)[1]

    runs = {
        "gather_then_tma_gemm": separate,
        "gather_alone": lambda: launch.gather_rows(x, lay.entry, k, wf)[0],
        "tma_gemm_alone": lambda: grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, tiles, False)[1],
        "fused_gather_layer_kernel": lambda: grouped.gemm_swiglu_gather(
            x, lay.entry, wf, k, w1, lay.ends, tiles
        ),
    }
    want = {"fused_gather_layer_kernel": separate()[:rows].float()}
    return _records("gemm1_gather", runs, want, lambda fn: _measure(fn, loop_iters=50, loop_warmup=5))


def _records(gemm: str, runs: dict[str, Any], want: dict[str, Any], measure: Any) -> list[dict[str, Any]]:
    """One record per run: its largest difference from ``want[name]`` relative to that output's largest
    magnitude (on the reference's rows) where given, then ``measure(fn)``; a failure is recorded."""
    out: list[dict[str, Any]] = []
    for name, fn in runs.items():
        rec: dict[str, Any] = {"gemm": gemm, "provider": name}
        try:
            if name in want:
                ref = want[name]
                got = fn()[: ref.shape[0]].float()
                rec["max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
            rec.update(measure(fn))
        except Exception as exc:
            rec["error"] = repr(exc)[-600:]
        out.append(rec)
        print(rec, flush=True)
    return out


def _energy(
    idx: Any, x: Any, wt: Any, w1: Any, w2: Any, only: list[str] | None = None
) -> list[dict[str, Any]]:
    """Energy per forward of the layer's steps and of the whole forward without backward, two ways: the
    row gather then the TMA first GEMM, or the first GEMM gathering its rows (the layer's choice now), and
    the TMA first GEMM with half-height last tiles in place. Each row: GPU time, the bench's loop of 50,
    a loop of about 2 s with its energy per call and mean power."""
    from lck_ep.moe import grouped, launch
    from lck_ep.moe.permute import build_local_layout

    e, k = w1.shape[0], wt.shape[1]
    tiles = grouped.forward_tiles(x, w1, w2)
    wf = wt.reshape(-1).float().contiguous()
    energy = _Energy()
    lay = build_local_layout(idx, e, 1)
    x_e, w_e = launch.gather_rows(x, lay.entry, k, wf)
    act = grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, tiles, False)[1]
    y_e = grouped.mm_tiled(act, w2, lay.ends, tiles)
    rows = int(lay.ends[-1])

    def forward(gathering: bool) -> Any:
        lay_ = build_local_layout(idx, e, 1)
        if gathering:
            a = grouped.gemm_swiglu_gather(x, lay_.entry, wf, k, w1, lay_.ends, tiles)
        else:
            xe, we = launch.gather_rows(x, lay_.entry, k, wf)
            a = grouped.gemm_swiglu(xe, we, w1, lay_.ends, tiles, False)[1]
        return launch.reduce_rows(grouped.mm_tiled(a, w2, lay_.ends, tiles), lay_.index)

    runs = {
        "layer_fwd_gather_then_gemm": lambda: forward(False),
        "layer_fwd_gathering_gemm": lambda: forward(True),
        "gather_rows": lambda: launch.gather_rows(x, lay.entry, k, wf)[0],
        "gemm1_tma": lambda: grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, tiles, False)[1],
        "gemm1_tma_half_tail": lambda: swiglu_half_tail(x_e, w_e, w1, lay.ends),
        "gemm1_gathering": lambda: grouped.gemm_swiglu_gather(x, lay.entry, wf, k, w1, lay.ends, tiles),
        "gemm2_tma": lambda: grouped.mm_tiled(act, w2, lay.ends, tiles),
        "reduce_rows": lambda: launch.reduce_rows(y_e, lay.index),
    }
    if only:
        runs = {name: fn for name, fn in runs.items() if name in only}
    want = {"layer_fwd_gathering_gemm": forward(False).float(), "gemm1_tma_half_tail": act[:rows].float()}
    return _records("energy", runs, want, lambda fn: _energy_of(fn, energy))


def _zeros(idx: Any, x: Any, wt: Any, w1: Any, w2: Any) -> list[dict[str, Any]]:
    """Whether the rows a partial tile computes for nothing cost less when they are zeros: the same tiles on
    the unpadded layout (a segment's last tile reads the next expert's rows) and on the layout padded with
    zero rows to 128 (same tile count, same products for every row in use). Loops of 50 calls, as the bench."""
    from lck_ep.moe import grouped, launch
    from lck_ep.moe.permute import build_local_layout

    e, k = w1.shape[0], wt.shape[1]
    tiles = grouped.forward_tiles(x, w1, w2)
    out: list[dict[str, Any]] = []
    for align in (1, 128, 1, 128):
        lay = build_local_layout(idx, e, align)
        x_e, w_e = launch.gather_rows(x, lay.entry, k, wt.reshape(-1).float())
        act = grouped.gemm_swiglu(x_e, w_e, w1, lay.ends, tiles, False)[1]
        runs = {
            "gemm1": lambda x_e=x_e, w_e=w_e, lay=lay: grouped.gemm_swiglu(
                x_e, w_e, w1, lay.ends, tiles, False
            ),
            "gemm2": lambda act=act, lay=lay: grouped.mm_tiled(act, w2, lay.ends, tiles),
        }
        for kind, fn in runs.items():
            rec: dict[str, Any] = {"gemm": kind, "provider": f"alignment {align}", "rows": int(lay.ends[-1])}
            rec.update(_measure(fn, loop_iters=50, loop_warmup=5))  # the bench's loop
            out.append(rec)
            print(rec, flush=True)
    return out


def _measure(fn: Any, loop_iters: int = 20, loop_warmup: int = 3) -> dict[str, Any]:
    from lck_runtime.benchmarking import host_ms, summarize, time_cuda, time_loop

    out = summarize(time_cuda(fn, warmup=3, iters=20))
    out["host_ms"] = host_ms(fn, iters=10, warmup=2)
    out["loop_ms"] = time_loop(fn, iters=loop_iters, warmup=loop_warmup)
    return out


def main(argv: list[str] | None = None) -> int:
    from lck_ep.moe import MoEExperts
    from lck_ep.moe.permute import build_local_layout
    from lck_runtime.benchmarking import gpu_slug, provenance

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--part",
        choices=["all", "tiles", "tiles2", "persist", "pingpong", "zeros", "gather", "energy"],
        default="all",
    )
    p.add_argument("--only", nargs="+", help="--part energy: these rows only")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    t, h, f, e, k = 8192, 2048, 768, 128, 8
    idx = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k].contiguous()
    lay = build_local_layout(idx, e, 1)
    rows = int(lay.ends[-1])
    x_e = torch.randn(t * k, h, device=dev, dtype=torch.bfloat16)
    act = torch.randn(t * k, f, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(e, h, 2 * f, device=dev, dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, f, h, device=dev, dtype=torch.bfloat16) / f**0.5
    w1_km = w1.transpose(1, 2).contiguous().transpose(1, 2)  # same values, K contiguous
    w2_km = w2.transpose(1, 2).contiguous().transpose(1, 2)
    records: list[dict[str, Any]] = []
    if args.part == "tiles":
        records += _tiles(lay, x_e, w1, w2, t, k)
    if args.part == "tiles2":
        records += _tiles2(lay, x_e, act, w1, w2)
    if args.part == "gather":
        xt = torch.randn(t, h, device=dev, dtype=torch.bfloat16) * 0.5
        records += _gather_fused(idx, xt, torch.rand(t, k, device=dev).softmax(-1), w1, w2)
    if args.part == "energy":
        xt = torch.randn(t, h, device=dev, dtype=torch.bfloat16) * 0.5
        records += _energy(idx, xt, torch.rand(t, k, device=dev).softmax(-1), w1, w2, args.only)
    if args.part == "zeros":
        xt = torch.randn(t, h, device=dev, dtype=torch.bfloat16) * 0.5
        records += _zeros(idx, xt, torch.rand(t, k, device=dev).softmax(-1), w1, w2)
    if args.part in ("persist", "pingpong"):
        layer = MoEExperts(e, h, f, dtype=torch.bfloat16, device=dev)
        with torch.no_grad():  # the data `lck bench moe` times (normal weights, inputs of std 0.5)
            layer.weight1.copy_(w1)
            layer.weight2.copy_(w2)
        xt = torch.randn(t, h, device=dev, dtype=torch.bfloat16) * 0.5
        wt = torch.rand(t, k, device=dev).softmax(-1)

        def layer_fwd() -> Any:
            with torch.no_grad():
                return layer(xt, idx, wt)

        part = _persist if args.part == "persist" else _pingpong
        records += part(lay, x_e, act, w1, w2, layer_fwd)
    for gemm, a, w, w_km, flops in (
        ()
        if args.part != "all"
        else (
            ("gemm1", x_e, w1, w1_km, 2.0 * rows * h * 2 * f),
            ("gemm2", act, w2, w2_km, 2.0 * rows * f * h),
        )
    ):
        want = torch._grouped_mm(a, w, offs=lay.ends)[:rows].float()
        scale = float(want.abs().max())
        runs: dict[str, Any] = {
            "torch_grouped_mm": lambda a=a, w=w: torch._grouped_mm(a, w, offs=lay.ends),
            "torch_grouped_mm_kmajor": lambda a=a, w=w_km: torch._grouped_mm(a, w, offs=lay.ends),
        }
        for cfg in CONFIGS:
            for km in (False, True):
                name = "triton_{}x{}x{}_w{}_s{}".format(*cfg) + ("_kmajor" if km else "")
                runs[name] = lambda a=a, w=(w_km if km else w), cfg=cfg, km=km: triton_grouped_mm(
                    a, w, lay.ends, cfg, km
                )
        for name, fn in runs.items():
            rec: dict[str, Any] = {"gemm": gemm, "provider": name}
            try:
                got = fn()[:rows].float()
                rec["max_rel_diff"] = float((got - want).abs().max()) / scale
                rec.update(_measure(fn))
                rec["tflops"] = flops / (rec["median_ms"] * 1e-3) / 1e12
            except Exception as exc:  # a configuration Triton cannot build: recorded, not fatal
                rec["error"] = repr(exc)[:400]
            records.append(rec)
            print(
                gemm,
                name,
                {kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in rec.items()},
                flush=True,
            )
    # Kernel breakdown of the layer's forward (no grad) and forward with grad.
    layer = MoEExperts(e, h, f, dtype=torch.bfloat16, device=dev)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    w = torch.rand(t, k, device=dev).softmax(-1)
    profiles = {}
    for label, grad in (("fwd_no_grad", False), ("fwd_grad", True)):

        def run(grad: bool = grad) -> Any:
            with torch.set_grad_enabled(grad):
                return layer(x.requires_grad_(grad), idx, w)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        profiles[label] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(label, "\n", profiles[label], flush=True)
        rec = {"gemm": "layer", "provider": f"lck_{label}"}
        rec.update(_measure(run))
        records.append(rec)
        print(rec, flush=True)
    stamp = _dt.date.today().isoformat()
    commit = os.environ.get("LCK_COMMIT", "unknown")[:7]
    path = args.out / f"grouped-gemm-probe-{gpu_slug()}-{stamp}-{commit}.json"
    path.write_text(
        json.dumps({"provenance": provenance(), "records": records, "profiles": profiles}, indent=1)
    )
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
