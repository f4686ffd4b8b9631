"""RMSNorm: ``y = x / sqrt(mean(x², -1) + eps) * (offset + weight)``, Triton forward and backward.

Casting modes (what is rounded where; reductions always accumulate in fp32, and ``offset + weight`` is
formed in fp32):

- ``"llama"`` (Hugging Face Llama): normalise in fp32, round the normalised row to ``x.dtype``, multiply by
  ``offset + weight`` in fp32, round the product to ``x.dtype``. With a weight in ``x.dtype`` and no
  offset this is the HF computation ``weight * (x.float() * rstd).to(x.dtype)`` (up to fp32 summation order).
- ``"gemma"`` (Hugging Face Gemma): everything in fp32, one rounding of the final product to ``x.dtype``:
  ``(x.float() * rstd * (offset + weight.float())).to(x.dtype)``.
- ``"none"``: no upcast of the elementwise steps, as eager code with every tensor in ``x.dtype``: ``rstd``
  (from the fp32 mean square), the normalised row, ``offset + weight`` and the product are each rounded to
  ``x.dtype``.

The output has ``x``'s dtype and shape (any rank ≥ 1; leading dimensions are rows). The backward is the
exact gradient of the unrounded function, computed in fp32 from ``x`` and the ``rstd`` saved by the forward.
The family's files: ``kernels.py`` (Triton), ``launch.py`` (launch configuration and launches), ``checks.py``
(input checks), ``ops.py`` (``torch.library`` ops and autograd); this module holds ``rms_norm`` and
``LckRMSNorm``.

``in_place=True`` writes ``dx`` into ``dy``'s buffer in the backward (no new activation-sized allocation).
Only use it when nothing else reads that gradient: a residual ``x + norm(x)`` hands the same gradient tensor
to both branches, and overwriting it can corrupt the other branch's gradient.
"""

from __future__ import annotations

import torch

from lck_kernels import _host
from lck_kernels._common import FLOAT_DTYPES, check_choice
from lck_kernels.rms_norm.checks import CASTING_MODES, check_rms_norm_inputs
from lck_kernels.rms_norm.launch import MAX_BLOCK, bwd_config, fwd_config
from lck_kernels.rms_norm.ops import RMSNormFunction, rms_norm_apply


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale by ``offset + weight``.

    Args:
        x: ``[..., hidden]`` float32/float16/bfloat16 CUDA tensor (CPU under ``TRITON_INTERPRET=1``); its
            leading dimensions must collapse into rows without a copy (contiguous, or a column slice).
        weight: ``[hidden]`` contiguous float tensor on ``x``'s device (any of the three float dtypes).
        eps: added to the mean square before the reciprocal square root (finite, ≥ 0).
        offset: added to ``weight`` (Gemma uses 1.0 with a zero-initialised weight).
        casting_mode: ``"llama"``, ``"gemma"`` or ``"none"`` (module docstring says exactly what each rounds).
        in_place: write ``dx`` into the incoming gradient's buffer in backward (see the module docstring
            for when that is unsafe).

    Returns ``y`` with ``x``'s shape and dtype (contiguous). Differentiable in ``x`` and ``weight``.
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong dtype, device, shape or stride.
    """
    host = _host.ready(x, weight)
    if host is not None:  # the C++ path (a backward node); None when it does not take these arguments
        y = host.rms_norm(x, weight, eps, offset, casting_mode, in_place)
        if y is not None:
            return y
    check_rms_norm_inputs("rms_norm", x, weight, eps, offset, casting_mode)
    if not isinstance(in_place, bool):
        raise TypeError(f"rms_norm: in_place must be a bool, got {type(in_place).__name__}")
    return rms_norm_apply(x, weight, float(eps), float(offset), casting_mode, in_place)


class LckRMSNorm(torch.nn.Module):
    """RMSNorm layer: ``rms_norm(x, self.weight, eps, offset, casting_mode, in_place)``.

    ``weight`` is ``[hidden_size]``, filled with ``init`` (1.0 for Llama; 0.0 with ``offset=1.0`` for Gemma).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        in_place: bool = False,
        init: float = 1.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"LckRMSNorm: hidden_size must be a positive int, got {hidden_size!r}")
        check_choice("LckRMSNorm", "casting_mode", casting_mode, CASTING_MODES)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"LckRMSNorm: dtype must be float32, float16 or bfloat16, got {dtype}")
        self.hidden_size, self.eps, self.offset = hidden_size, float(eps), float(offset)
        self.casting_mode, self.in_place = casting_mode, bool(in_place)
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), float(init), device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, self.casting_mode, self.in_place)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, "
            f"casting_mode={self.casting_mode!r}, in_place={self.in_place}"
        )


# MAX_BLOCK and the launch configs are re-exported: tests and the tuning script read them here.
__all__ = [
    "CASTING_MODES",
    "MAX_BLOCK",
    "LckRMSNorm",
    "RMSNormFunction",
    "bwd_config",
    "fwd_config",
    "rms_norm",
]
