"""SwiGLU benchmark suite, bf16, forward and forward+backward.

- ``swiglu_packed``: the fused gate-up form on one ``[..., 2n]`` buffer: ``[8192, 2×32768]``, ``[8192, 2×4096]``
  and Megatron's 3-D ``[2048, 4, 2n]`` for n = 4096 and 32768. Providers: lck, lck_in_place, torch eager and
  torch.compile (``torch.chunk`` + ``silu(gate) * up``, as Megatron's unfused path), and Liger-Kernel's fused
  gate-up function when installed (on a 2-D view of 3-D inputs: Liger 0.8.5 returns a 2-D gradient for 3-D
  input), else Liger's two-tensor kernel on ``torch.chunk`` views as a user would call it.
- ``swiglu``: the two-tensor form ``silu(a) * b`` at ``[8192, 4096]`` and ``[8192, 32768]``; Liger's
  ``LigerSiLUMulFunction`` when installed.

``quick``: small shapes only. Gradients are taken with ``torch.autograd.grad`` (nothing accumulates between
iterations). The in-place providers overwrite their input with its gradient each iteration, so later
iterations run on drifting values: the kernels' speed does not depend on them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lck_kernels.bench._harness import Case, compiled, have


def _silu_mul_chunked(y: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


def _silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def _closures(fn, inputs: dict[str, Any], names: tuple[str, ...]):
    args, g = tuple(inputs[n] for n in names), inputs["g"]

    def fwd():
        return fn(*args)

    def fwd_bwd():
        return torch.autograd.grad(fn(*args), args, g)

    return fwd, fwd_bwd


def _packed_providers() -> dict[str, Any]:
    from lck_kernels.swiglu import swiglu_packed

    def wrap(fn):
        return lambda inp: _closures(fn, inp, ("y",))

    providers = {
        "lck": wrap(swiglu_packed),
        "lck_in_place": wrap(lambda y: swiglu_packed(y, in_place=True)),
        "torch": wrap(_silu_mul_chunked),
        "torch_compile": wrap(compiled(_silu_mul_chunked)),
    }
    if have("liger_kernel"):

        def liger(inp):
            try:
                from liger_kernel.ops import LigerFusedGateUpSiLUMulFunction as Fused
            except ImportError:
                from liger_kernel.ops.swiglu import LigerSiLUMulFunction

                return _closures(
                    lambda y: LigerSiLUMulFunction.apply(*torch.chunk(y, 2, dim=-1)), inp, ("y",)
                )

            def fused(y):
                out = Fused.apply(y.view(-1, y.shape[-1]), False)
                return out.view(*y.shape[:-1], y.shape[-1] // 2)

            return _closures(fused, inp, ("y",))

        providers["liger"] = liger
    return providers


def _two_tensor_providers() -> dict[str, Any]:
    from lck_kernels.swiglu import swiglu

    def wrap(fn):
        return lambda inp: _closures(fn, inp, ("a", "b"))

    providers = {"lck": wrap(swiglu), "torch": wrap(_silu_mul), "torch_compile": wrap(compiled(_silu_mul))}
    if have("liger_kernel"):

        def liger(inp):
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return _closures(LigerSiLUMulFunction.apply, inp, ("a", "b"))

        providers["liger"] = liger
    return providers


def _bytes(rows: int, n: int, es: int) -> dict[str, float]:
    fwd = 3 * rows * n * es  # read gate and up, write out
    return {"fwd": fwd, "fwd_bwd": fwd + 5 * rows * n * es}  # bwd: read gate, up, dout; write dgate, dup


def _packed_case(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> Case:
    rows = 1
    for s in shape[:-1]:
        rows *= s
    out_shape = (*shape[:-1], shape[-1] // 2)

    def make_inputs() -> dict[str, Any]:
        return {
            "y": torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True),
            "g": torch.randn(out_shape, device="cuda", dtype=dtype),
        }

    return Case(
        bench="swiglu_packed",
        shape="x".join(str(s) for s in shape[:-1]) + f"x2*{shape[-1] // 2}",
        dtype=dtype,
        make_inputs=make_inputs,
        providers=_packed_providers(),
        bytes=_bytes(rows, shape[-1] // 2, torch.finfo(dtype).bits // 8),
    )


def _two_tensor_case(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> Case:
    rows = 1
    for s in shape[:-1]:
        rows *= s

    def make_inputs() -> dict[str, Any]:
        return {
            "a": torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True),
            "b": torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True),
            "g": torch.randn(shape, device="cuda", dtype=dtype),
        }

    return Case(
        bench="swiglu",
        shape="x".join(str(s) for s in shape),
        dtype=dtype,
        make_inputs=make_inputs,
        providers=_two_tensor_providers(),
        bytes=_bytes(rows, shape[-1], torch.finfo(dtype).bits // 8),
    )


def cases(quick: bool) -> list[Case]:
    if quick:
        return [
            _packed_case((1024, 2 * 4096)),
            _packed_case((256, 4, 2 * 4096)),
            _two_tensor_case((1024, 4096)),
        ]
    # Megatron's 3-D [s, b, 2n] layout at both ffn sizes is in `lck bench megatron`.
    packed = [(8192, 2 * 32768), (8192, 2 * 4096), (2048, 4, 2 * 32768)]
    return [_packed_case(s) for s in packed] + [_two_tensor_case((8192, 4096))]
