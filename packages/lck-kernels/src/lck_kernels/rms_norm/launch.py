"""Launch configuration and launches of the RMSNorm kernels (``kernels.py``).

Nothing here validates input: the ops in ``ops.py`` do that before launching.
"""

from __future__ import annotations

import torch

from lck_kernels._common import cdiv, config_cache, num_sms, row_block, tuned, warps_for
from lck_kernels._eager import Launch, launch_for
from lck_kernels.rms_norm.kernels import (
    _rms_norm_bwd_dot_kernel,
    _rms_norm_bwd_kernel,
    _rms_norm_bwd_tiled_kernel,
    _rms_norm_dw_kernel,
    _rms_norm_fwd_kernel,
)

# Widest row one program holds in registers; wider rows are tiled.
MAX_BLOCK = 16384
# Tile of a tiled row, and its warps. Measured on an H200 (2026-12-01, bf16, kernels alone, commit ee4201e,
# `tune_rms_norm_swiglu.py --wide`): 4096-wide tiles with 16 warps against the 16384-wide ones before, whose
# last tile of a 20480 row was three quarters padding: forward 0.095 / 0.086 / 0.079 ms against 0.123 /
# 0.122 / 0.079 at 4096x20480 / 4096x18432 / 2048x28672; backward (16 warps, 2 programs per SM) 0.232 /
# 0.215 / 0.179 against 0.261 / 0.245 / 0.192, within 3% of the best candidate at each shape.
TILE_BLOCK, TILE_WARPS = 4096, 16


def fwd_config(n_cols: int, element_size: int) -> dict[str, int]:
    """Forward launch parameters: ``BLOCK_N`` (columns per tile), ``ROWS`` (rows per program), ``num_warps``.

    Small rows are packed several to a program so each program still moves ~8 KiB per tensor.
    """
    block = row_block(n_cols, MAX_BLOCK)
    if block < n_cols:
        return tuned("rms_norm_fwd", {"BLOCK_N": TILE_BLOCK, "ROWS": 1, "num_warps": TILE_WARPS})
    rows = max(1, min(16, 4096 // block))
    return tuned(
        "rms_norm_fwd", {"BLOCK_N": block, "ROWS": rows, "num_warps": warps_for(rows * block, element_size)}
    )


def bwd_config(n_cols: int, element_size: int) -> dict[str, int]:
    """Backward launch parameters; ``PROGRAMS_PER_SM`` sizes the persistent grid.

    Half-precision rows up to 8192 wide use the look-ahead kernel (``PREFETCH``: the next rows load during
    this step's reduction). Measured on an H200 (2026-11-30, bf16, backward kernel alone): at 16384×4096,
    2 rows × 16 warps, one program per SM, 0.120 ms against 0.152 ms without look-ahead (2 rows × 8 warps
    × 2 per SM); at 16384×1024, 2 rows × 4 warps × 8 per SM, 0.045 ms against 0.059 ms; at 16384×8192,
    1 row × 8 warps × 2 per SM, 0.234 ms against 0.270 ms. Packing 4 rows of 4096 or 8 rows spilled
    registers (2.3–2.6 ms). Other whole rows and float32 keep the earlier setting (no look-ahead: its doubled
    input registers would not fit beside the fp32 ``dweight`` partials); tiled rows take ``TILE_BLOCK``-wide
    tiles (measured above ``TILE_BLOCK``).
    """
    block = row_block(n_cols, MAX_BLOCK)
    whole = block >= n_cols
    half = element_size <= 2  # measured in bf16; fp32 rows double the look-ahead's registers
    if whole and half and block == 4096:
        cfg = {"ROWS": 2, "num_warps": 16, "PROGRAMS_PER_SM": 1, "PREFETCH": 1}
    elif whole and half and block == 8192:
        cfg = {"ROWS": 1, "num_warps": 8, "PROGRAMS_PER_SM": 2, "PREFETCH": 1}
    elif whole and half and block < 4096:
        rows = max(1, min(16, 2048 // block))
        warps = min(32, 2 * warps_for(block, element_size, lo=2))
        cfg = {"ROWS": rows, "num_warps": warps, "PROGRAMS_PER_SM": 8, "PREFETCH": 1}
    elif not whole:
        block = TILE_BLOCK
        cfg = {"ROWS": 1, "num_warps": TILE_WARPS, "PROGRAMS_PER_SM": 2, "PREFETCH": 0}
    else:
        rows = max(1, min(16, (8192 if block >= 4096 else 2048) // block))
        warps = min(32, 2 * warps_for(block, element_size, lo=2))
        cfg = {"ROWS": rows, "num_warps": warps, "PROGRAMS_PER_SM": 2, "PREFETCH": 0}
    return tuned("rms_norm_bwd", {"BLOCK_N": block, **cfg})


@config_cache
def _fwd_plan(n_rows: int, n_cols: int, element_size: int, casting: int) -> tuple[tuple[int], Launch]:
    cfg = fwd_config(n_cols, element_size)
    block, rows = cfg["BLOCK_N"], cfg["ROWS"]
    launch = launch_for(
        _rms_norm_fwd_kernel, CASTING=casting, ROWS=rows, BLOCK_N=block, TILED=block < n_cols,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return (cdiv(n_rows, rows),), launch


def launch_fwd(x2, weight, y2, rstd, eps, offset, casting) -> None:
    n_rows, n_cols = x2.shape
    grid, launch = _fwd_plan(n_rows, n_cols, x2.element_size(), casting)
    launch(grid, x2, weight, y2, rstd, n_rows, n_cols, x2.stride(0), y2.stride(0), float(eps), float(offset))


@config_cache
def _bwd_plan(n_rows: int, n_cols: int, element_size: int, casting: int, device: torch.device):
    """(programs, rows per program, column tiles, launches): the persistent row kernel, or the tiled
    path's two."""
    cfg = bwd_config(n_cols, element_size)
    block, rows = cfg["BLOCK_N"], cfg["ROWS"]
    programs = max(1, min(num_sms(device) * cfg["PROGRAMS_PER_SM"], cdiv(n_rows, rows)))
    # Whole multiples of ROWS per program, so only the last program sees a ragged tail.
    per_program = cdiv(cdiv(n_rows, programs), rows) * rows
    programs = cdiv(n_rows, per_program)
    warps = cfg["num_warps"]
    if block >= n_cols:
        prefetch = bool(cfg["PREFETCH"])
        kw = {"CASTING": casting, "ROWS": rows, "BLOCK_N": block, "PREFETCH": prefetch, "num_warps": warps}
        return programs, per_program, 1, (launch_for(_rms_norm_bwd_kernel, **kw),)
    dot = launch_for(_rms_norm_bwd_dot_kernel, CASTING=casting, BLOCK_N=block, num_warps=warps)
    tiled = launch_for(_rms_norm_bwd_tiled_kernel, CASTING=casting, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return programs, per_program, cdiv(n_cols, block), (dot, tiled)


# Columns per program of the dweight reduction over the backward's programs (a few hundred partial rows): 64
# columns give 64 programs at hidden 4096, each reading 32 partial rows per step.
DW_BLOCK_N, DW_BLOCK_P = 64, 32
_DW_SUM = launch_for(_rms_norm_dw_kernel, BLOCK_P=DW_BLOCK_P, BLOCK_N=DW_BLOCK_N, num_warps=4)


def launch_bwd(dy2, x2, weight, rstd, dx2, offset, casting) -> torch.Tensor:
    """Launch the backward; return ``dweight`` in ``weight``'s dtype (the programs' fp32 partials summed)."""
    n_rows, n_cols = x2.shape
    programs, per_program, tiles, launches = _bwd_plan(n_rows, n_cols, x2.element_size(), casting, x2.device)
    partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x2.device)
    offset = float(offset)
    if len(launches) == 1:
        launches[0](
            (programs,), dy2, x2, weight, rstd, dx2, partial, n_rows, n_cols, per_program,
            dy2.stride(0), x2.stride(0), dx2.stride(0), offset,
        )  # fmt: skip
    else:
        dot = torch.empty((n_rows,), dtype=torch.float32, device=x2.device)
        launches[0](
            (n_rows,), dy2, x2, weight, rstd, dot, n_rows, n_cols, dy2.stride(0), x2.stride(0), offset
        )
        # dot is complete before dx overwrites dy (in place): kernels on one stream run in order.
        launches[1](
            (tiles, programs), dy2, x2, weight, rstd, dot, dx2, partial, n_rows, n_cols,
            per_program, dy2.stride(0), x2.stride(0), dx2.stride(0), offset,
        )  # fmt: skip
    dw = torch.empty((n_cols,), dtype=weight.dtype, device=x2.device)
    _DW_SUM((cdiv(n_cols, DW_BLOCK_N),), partial, dw, programs, n_cols)
    return dw


def host_plans(slot):
    """The plan callbacks of the C++ RMSNorm (``csrc/host.h``), given ``slot`` (a Launch's C++ registry id):
    the same configurations as ``launch_fwd`` / ``launch_bwd``, asked once per shape."""

    def fwd(n_cols: int, element_size: int, casting: int) -> tuple[int, int]:
        _, launch = _fwd_plan(1, n_cols, element_size, casting)
        return slot(launch), launch.meta["ROWS"]

    def bwd(n_rows: int, n_cols: int, element_size: int, casting: int, device: int):
        dev = torch.device("cuda", device)
        programs, per_program, tiles, launches = _bwd_plan(n_rows, n_cols, element_size, casting, dev)
        a = slot(launches[0])
        b = slot(launches[1]) if len(launches) > 1 else -1
        return programs, per_program, tiles, cdiv(n_cols, DW_BLOCK_N), a, b, slot(_DW_SUM)

    return fwd, bwd
