"""Per-dtype tolerances for comparing against float64 references, shared by every kernel test.

``assert_close(out, ref, dtype)`` compares by the relative Frobenius error ‖out − ref‖ / ‖ref‖ (robust
to a few large elements) and, separately, elementwise with atol/rtol; NaN never passes.
"""

from __future__ import annotations

import torch

# (relative Frobenius error, atol, rtol) per input dtype.
TOL = {
    torch.float32: (1e-5, 1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3, 1e-2),
    torch.bfloat16: (1e-2, 1.6e-2, 3e-2),
}


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, name: str = "output", scale: float = 1.0
) -> None:
    """``scale`` loosens every tolerance (for long reductions, e.g. a weight gradient over many rows)."""
    rel, atol, rtol = (t * scale for t in TOL[dtype])
    out64, ref64 = out.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    assert out64.shape == ref64.shape, f"{name}: shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(out64).any(), f"{name}: NaN in output"
    denom = ref64.norm().clamp_min(1e-30)
    err = ((out64 - ref64).norm() / denom).item()
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel:.1e} ({dtype})"
    torch.testing.assert_close(
        out64,
        ref64,
        atol=atol * max(1.0, ref64.abs().max().item()),
        rtol=rtol,
        msg=lambda m: f"{name} ({dtype}): {m}",
    )


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so an element the kernel never wrote fails the comparison."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-12345)
