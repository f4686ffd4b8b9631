"""SwiGLU: ``silu(a) * b`` on two tensors (``swiglu``), and fused gate-up on one packed buffer
(``swiglu_packed``: ``y[..., :n]`` is the gate, ``y[..., n:]`` the up projection); the Llama-style MLP using
them (``LckSwiGLUMLP``).

Numerics: ``a`` and ``b`` are read in their dtype and everything is computed in fp32 (``silu(a) = a *
sigmoid(a)``, the product, and in backward ``db = dc * silu(a)``, ``da = dc * b * (s + silu(a) * (1 - s))``
with ``s = sigmoid(a)``); each output is rounded once to the input dtype. The backward recomputes ``silu``
from ``a`` instead of saving it.

Layout: ``a`` and ``b`` may be any tensors whose leading dimensions collapse into rows without a copy and
whose last dimension has unit stride, so the two halves of a packed ``[..., 2n]`` buffer (``torch.chunk``
views, row stride ``2n``) are read in place. Outputs are contiguous.

The packed form is the layout Megatron-Core's fused MLP produces (one GEMM into ``[tokens, 2n]`` or ``[seq,
batch, 2n]``). Both halves are read straight from the packed buffer (row stride ``2n``, no ``torch.chunk``
copies); numerics and Triton kernels are those of ``swiglu``.

``in_place=True`` (packed form) makes the backward write the input gradient ``[..., 2n]`` into ``y`` itself
instead of a new buffer: the largest activation-sized allocation of the MLP backward disappears (about 20%
of this block's activation memory). ``y`` then holds the gradient, so the graph can be differentiated only
once; a second backward (``retain_graph=True``) raises ``RuntimeError`` instead of silently using a gradient
as input. Under ``torch.compile`` the in-place write is functionalised (a fresh buffer is used, gradients
stay correct); the memory saving applies to eager execution.

The family's files: ``kernels.py`` (Triton), ``launch.py``, ``checks.py``, ``ops.py`` (``torch.library`` ops
and autograd); this module holds the functional API and the modules.
"""

from __future__ import annotations

import torch

from lck_kernels import _host
from lck_kernels._common import FLOAT_DTYPES
from lck_kernels.swiglu.checks import check_swiglu_inputs, check_swiglu_packed_inputs
from lck_kernels.swiglu.launch import elementwise_config
from lck_kernels.swiglu.ops import SwiGLUFunction, SwiGLUPackedFunction, swiglu_apply, swiglu_packed_apply

__all__ = [
    "LckSwiGLUMLP",
    "LckSwiGLUPacked",
    "SwiGLUFunction",
    "SwiGLUPackedFunction",
    "elementwise_config",
    "swiglu",
    "swiglu_packed",
]


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b``, computed in fp32 and rounded once to the input dtype.

    ``a`` (gate) and ``b`` (up) are float32/float16/bfloat16 tensors of one shape and dtype on the kernel
    device (CUDA; CPU under ``TRITON_INTERPRET=1``), each with unit stride in its last dimension and leading
    dimensions that collapse into rows without a copy (views from ``torch.chunk(y, 2, -1)`` qualify).
    Returns a contiguous tensor of that shape and dtype; differentiable in both inputs.
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong dtype, device, shape or stride.
    """
    host = _host.ready(a, b)
    if host is not None:  # the C++ autograd Function, which checks what it takes
        c = host.swiglu(a, b)
        if c is not None:  # None: a call it does not take (zero rows, bad input) runs the Python checks
            return c
    check_swiglu_inputs("swiglu", a, b)
    return swiglu_apply(a, b)


def swiglu_packed(y: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``silu(y[..., :n]) * y[..., n:]`` for a packed gate-up buffer ``y`` of shape ``[..., 2n]``.

    ``y`` is a float32/float16/bfloat16 tensor on the kernel device (CUDA; CPU under ``TRITON_INTERPRET=1``)
    with an even last dimension of unit stride and leading dimensions that collapse into rows without a copy
    (2-D ``[tokens, 2n]`` and Megatron's 3-D ``[seq, batch, 2n]`` both qualify). Returns a contiguous
    ``[..., n]`` tensor in ``y``'s dtype. With ``in_place=True`` the backward writes the gradient into ``y``
    (``y``'s contents are lost; a second backward through the graph raises ``RuntimeError``).
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong dtype, device, shape or stride.
    """
    host = _host.ready(y)
    if host is not None:  # the C++ autograd Function, as in swiglu
        out = host.swiglu_packed(y, in_place)
        if out is not None:
            return out
    check_swiglu_packed_inputs("swiglu_packed", y)
    if not isinstance(in_place, bool):
        raise TypeError(f"swiglu_packed: in_place must be a bool, got {type(in_place).__name__}")
    return swiglu_packed_apply(y, in_place)


class LckSwiGLUPacked(torch.nn.Module):
    """The fused gate-up activation as a module: ``swiglu_packed(y, in_place)`` on ``[..., 2n]`` input.

    For models whose first projection emits gate and up in one buffer (Megatron's ``linear_fc1``, a fused
    ``gate_up_proj``). ``in_place=True`` writes the backward's gradient into that buffer (the buffer is not
    kept for anything else; a second backward through the graph raises). No parameters.
    """

    def __init__(self, in_place: bool = False):
        super().__init__()
        if not isinstance(in_place, bool):
            raise TypeError(f"LckSwiGLUPacked: in_place must be a bool, got {type(in_place).__name__}")
        self.in_place = in_place

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu_packed(y, in_place=self.in_place)

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"


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
