"""``LckSwiGLUMLP``: the Llama-style gated MLP over lck's SwiGLU, separate or fused gate-up projections."""

from __future__ import annotations

import torch

from lck_kernels._common import FLOAT_DTYPES
from lck_kernels.swiglu import swiglu
from lck_kernels.swiglu_packed import swiglu_packed

__all__ = ["LckSwiGLUMLP"]


class LckSwiGLUMLP(torch.nn.Module):
    """Llama-style gated MLP: ``down_proj(swiglu(gate_proj(x), up_proj(x)))``.

    ``x``: ``[..., hidden_size]``; returns ``[..., hidden_size]``. The projections are ``nn.Linear`` layers
    (``bias`` for all of them), named as in Hugging Face checkpoints. ``fused_gate_up=True`` holds gate and
    up as one ``gate_up_proj`` (rows ``[0, n)`` gate, ``[n, 2n)`` up): one GEMM into a packed buffer that
    ``swiglu_packed`` reads without copies, with ``in_place=True`` (fused form only) writing the activation's
    gradient into that buffer.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        fused_gate_up: bool = False,
        in_place: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LckSwiGLUMLP: {name} must be a positive int, got {value!r}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"LckSwiGLUMLP: dtype must be float32, float16 or bfloat16, got {dtype}")
        for name, value in (("fused_gate_up", fused_gate_up), ("in_place", in_place)):
            if not isinstance(value, bool):
                raise TypeError(f"LckSwiGLUMLP: {name} must be a bool, got {type(value).__name__}")
        if in_place and not fused_gate_up:
            raise ValueError(
                "LckSwiGLUMLP: in_place=True needs fused_gate_up=True (it reuses the packed buffer)"
            )
        kw = {"bias": bool(bias), "device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.fused_gate_up, self.in_place = fused_gate_up, in_place
        if fused_gate_up:
            self.gate_up_proj = torch.nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        else:
            self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
            self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            return self.down_proj(swiglu_packed(self.gate_up_proj(x), in_place=self.in_place))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
