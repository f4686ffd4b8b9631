"""Launch configuration and launches of the SwiGLU kernels (``kernels.py``), for both forms.

Nothing here validates input: the ops in ``ops.py`` do that before launching.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lck_kernels._common import VECTOR_BYTES, cdiv, config_cache, next_power_of_2, rows_view, tuned, warps_for
from lck_kernels._eager import Launch, direct, launch_for
from lck_kernels.swiglu.kernels import _swiglu_bwd_kernel, _swiglu_fwd_kernel


def elementwise_config(kernel: str, n_cols: int, element_size: int, *, tile: int = 2048) -> dict[str, int]:
    """``BLOCK_M`` × ``BLOCK_N`` tile (about ``tile`` elements, a row first) and ``num_warps`` for ``kernel``
    (``"swiglu_fwd"`` or ``"swiglu_bwd"``).

    By default each thread gets two 16-byte vectors per tensor: on an H200 (2026-11-30) 2048-element tiles
    × 4 warps ran the [8192, 2×4096] bf16 forward in 0.053 ms against 0.061 ms for 4096 × 4 (four vectors
    per thread), and matched the best tried at [8192, 2×32768] within 1%. A tile always has at least one element per thread:
    Triton then lays it out without replication, so no element is held by two threads, which the in-place
    packed backward relies on (a replica could load an element after another thread overwrote it). Raises
    ``ValueError`` for an override that breaks that.
    """
    block_n = min(next_power_of_2(n_cols), tile)
    block_m = max(1, tile // block_n)
    vec = max(1, VECTOR_BYTES // element_size)
    full_vectors = max(1, block_m * block_n // (32 * vec))
    defaults = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "num_warps": min(full_vectors, 2 * warps_for(tile, element_size)),
    }
    cfg = tuned(kernel, defaults)
    if cfg["num_warps"] * 32 > cfg["BLOCK_M"] * cfg["BLOCK_N"]:
        raise ValueError(
            f"{kernel}: num_warps={cfg['num_warps']} is too many for a {cfg['BLOCK_M']}x{cfg['BLOCK_N']} tile "
            f"(fewer elements than threads: threads would share elements)"
        )
    return cfg


@config_cache
def _plan(kernel: str, n_rows: int, n_cols: int, element_size: int) -> tuple[tuple[int], Launch]:
    cfg = elementwise_config(kernel, n_cols, element_size)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    fn = _swiglu_fwd_kernel if kernel == "swiglu_fwd" else _swiglu_bwd_kernel
    return (cdiv(n_rows, bm) * cdiv(n_cols, bn),), launch_for(
        fn, BLOCK_M=bm, BLOCK_N=bn, num_warps=cfg["num_warps"]
    )


def launch_fwd(a2: torch.Tensor, b2: torch.Tensor, c2: torch.Tensor) -> None:
    """``c2 = silu(a2) * b2`` on ``[rows, n]`` views with unit column stride."""
    n_rows, n_cols = a2.shape
    if n_rows == 0:
        return
    grid, launch = _plan("swiglu_fwd", n_rows, n_cols, a2.element_size())
    launch(grid, a2, b2, c2, n_rows, n_cols, a2.stride(0), b2.stride(0), c2.stride(0))


def launch_bwd(
    a2: torch.Tensor, b2: torch.Tensor, dc2: torch.Tensor, da2: torch.Tensor, db2: torch.Tensor
) -> None:
    """``da2``, ``db2`` = gradients of ``silu(a2) * b2`` for ``dc2``; ``da2``/``db2`` may be ``a2``/``b2``."""
    n_rows, n_cols = a2.shape
    if n_rows == 0:
        return
    grid, launch = _plan("swiglu_bwd", n_rows, n_cols, a2.element_size())
    launch(
        grid, a2, b2, dc2, da2, db2, n_rows, n_cols,
        a2.stride(0), b2.stride(0), dc2.stride(0), da2.stride(0), db2.stride(0),
    )  # fmt: skip


def _halves(op: str, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up views ``[rows, n]`` of ``y`` (row stride that of ``y``, no copy; ``y`` checked)."""
    y2 = y.view(-1, y.shape[-1]) if direct() else rows_view(op, "y", y)
    n = y2.shape[1] // 2
    return y2[:, :n], y2[:, n:]


def host_plans(slot: Callable[[Launch], int]) -> tuple[Callable[[int, int], tuple[int, int, int]], ...]:
    """The plan callbacks of the C++ SwiGLU (``csrc/host.h``), given ``slot`` (a Launch's C++ registry id):
    ``_plan``'s configurations for the forward and the backward kernel, asked once per (row width, element
    size); C++ computes the grid from the tile as ``_plan`` does."""

    def plan(kernel: str) -> Callable[[int, int], tuple[int, int, int]]:
        def for_width(n_cols: int, element_size: int) -> tuple[int, int, int]:
            _, launch = _plan(kernel, 1, n_cols, element_size)
            return slot(launch), launch.meta["BLOCK_M"], launch.meta["BLOCK_N"]

        return for_width

    return plan("swiglu_fwd"), plan("swiglu_bwd")
