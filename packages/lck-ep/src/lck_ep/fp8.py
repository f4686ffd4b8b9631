"""FP8 token rows for dispatch: e4m3 values with one float32 scale per 128 channels, moved as one row.

A dispatch of ``(x_fp8 [T, H], x_scales [T, H / 128])`` (the layout DeepSeek-V3-style training quantises
activations to) travels as one byte row per token, ``H`` fp8 bytes then ``H / 32`` scale bytes, so both
backends and the expanded layout move it like any other row, in half the bytes of bf16; the receiver gets
the pair back. Combine stays in bf16/fp16/fp32 (partial sums need the range).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "pack", "unpack"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128  # channels per scale


def pack(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[T, H + 4 * H / 128]`` uint8: each row's fp8 bytes, then its scales' bytes."""
    t = x.shape[0]
    return torch.cat([x.view(torch.uint8), scales.view(torch.uint8).reshape(t, -1)], dim=1)


def unpack(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(x_fp8 [N, H], x_scales [N, H / 128])`` pair of packed rows, each contiguous."""
    n = rows.shape[0]
    x = rows[:, :hidden].contiguous().view(FP8_DTYPE)
    scales = rows[:, hidden:].contiguous().view(torch.float32).reshape(n, hidden // FP8_BLOCK)
    return x, scales
