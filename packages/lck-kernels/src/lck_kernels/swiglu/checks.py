"""Input checks of ``swiglu`` and ``swiglu_packed`` and their ops: ``TypeError`` / ``ValueError`` naming the
argument."""

from __future__ import annotations

import torch

from lck_kernels._common import check_same_device, check_tensor, rows_view


def check_swiglu_inputs(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    check_tensor(op, "a", a)
    check_tensor(op, "b", b, dtypes=(a.dtype,))
    check_same_device(op, a=a, b=b)
    if a.shape != b.shape:
        raise ValueError(
            f"{op}: a has shape {tuple(a.shape)} but b has shape {tuple(b.shape)}; they must match"
        )
    if a.dim() == 0 or a.shape[-1] == 0:
        raise ValueError(f"{op}: a and b need a non-empty last dimension, got shape {tuple(a.shape)}")
    rows_view(op, "a", a)
    rows_view(op, "b", b)


def check_swiglu_bwd_inputs(op: str, a: torch.Tensor, b: torch.Tensor, dc: torch.Tensor) -> None:
    check_swiglu_inputs(op, a, b)
    check_tensor(op, "dc", dc, dtypes=(a.dtype,))
    check_same_device(op, a=a, dc=dc)
    if dc.shape != a.shape:
        raise ValueError(f"{op}: dc has shape {tuple(dc.shape)} but a has shape {tuple(a.shape)}")
    rows_view(op, "dc", dc)


def check_swiglu_packed_inputs(op: str, y: torch.Tensor) -> None:
    check_tensor(op, "y", y)
    if y.dim() == 0 or y.shape[-1] == 0 or y.shape[-1] % 2:
        raise ValueError(
            f"{op}: y must be [..., 2n] with an even, non-zero last dimension (gate then up), got shape {tuple(y.shape)}"
        )
    rows_view(op, "y", y)


def check_swiglu_packed_bwd_inputs(op: str, y: torch.Tensor, dout: torch.Tensor) -> None:
    check_swiglu_packed_inputs(op, y)
    check_tensor(op, "dout", dout, dtypes=(y.dtype,))
    want = (*y.shape[:-1], y.shape[-1] // 2)
    if tuple(dout.shape) != want:
        raise ValueError(
            f"{op}: dout has shape {tuple(dout.shape)}; expected {want} for y of shape {tuple(y.shape)}"
        )
    if dout.device != y.device:
        raise ValueError(f"{op}: dout is on {dout.device} but y is on {y.device}")
    rows_view(op, "dout", dout)
