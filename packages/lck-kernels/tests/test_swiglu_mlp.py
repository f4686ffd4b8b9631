"""``LckSwiGLUMLP`` (separate and fused gate-up projections) and the ``LckSwiGLUPacked`` activation module
against float64 references. CPU runs use ``TRITON_INTERPRET=1`` at small sizes; ``gpu`` parameters run at
real sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _device import DEVICE, DTYPES, gpu, needs_triton_device
from _tolerances import assert_close

from lck_kernels import LckSwiGLUMLP, LckSwiGLUPacked, swiglu_packed

pytestmark = needs_triton_device
SIZES = [(9, 32, 80), pytest.param(4096, 4096, 14336, marks=gpu, id="gpu")]


def _check_mlp(mlp, tokens, hidden, dtype, weights64):
    """Forward and every gradient of ``mlp`` against float64 autograd of the same MLP."""
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)
    out = mlp(x)
    grads = torch.autograd.grad(out, (x, *mlp.parameters()), dout)
    p64 = [p.detach().double().requires_grad_(True) for p in mlp.parameters()]
    x64 = x.detach().double().requires_grad_(True)
    ref = weights64(x64, *p64)
    ref_grads = torch.autograd.grad(ref, (x64, *p64), dout.double())
    # Three GEMMs around the activation, each rounding to the input dtype (fp32: accumulation order only).
    scale = 10.0 if dtype == torch.float32 else 2.0
    assert_close(out, ref, dtype, name="out", scale=scale)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close(g, r, dtype, name=f"grad {i}", scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "hidden", "inter"), SIZES)
def test_mlp_matches_reference(tokens, hidden, inter, dtype):
    torch.manual_seed(7)
    mlp = LckSwiGLUMLP(hidden, inter, device=DEVICE, dtype=dtype)
    assert [n for n, _ in mlp.named_parameters()] == [
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    ]
    _check_mlp(mlp, tokens, hidden, dtype, lambda x, g, u, d: (F.silu(x @ g.t()) * (x @ u.t())) @ d.t())


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "hidden", "inter"), SIZES)
def test_fused_gate_up_mlp_matches_reference(tokens, hidden, inter, dtype, in_place):
    torch.manual_seed(8)
    mlp = LckSwiGLUMLP(hidden, inter, fused_gate_up=True, in_place=in_place, device=DEVICE, dtype=dtype)
    assert [n for n, _ in mlp.named_parameters()] == ["gate_up_proj.weight", "down_proj.weight"]
    assert mlp.gate_up_proj.weight.shape == (2 * inter, hidden)

    def ref(x, gu, d):
        y = x @ gu.t()  # gate in columns [0, n), up in [n, 2n)
        return (F.silu(y[:, :inter]) * y[:, inter:]) @ d.t()

    _check_mlp(mlp, tokens, hidden, dtype, ref)


def test_fused_and_separate_mlps_agree_on_the_same_weights():
    torch.manual_seed(9)
    sep = LckSwiGLUMLP(32, 48, bias=True, device=DEVICE)
    fused = LckSwiGLUMLP(32, 48, bias=True, fused_gate_up=True, device=DEVICE)
    with torch.no_grad():
        fused.gate_up_proj.weight.copy_(torch.cat([sep.gate_proj.weight, sep.up_proj.weight]))
        fused.gate_up_proj.bias.copy_(torch.cat([sep.gate_proj.bias, sep.up_proj.bias]))
        fused.down_proj.load_state_dict(sep.down_proj.state_dict())
    x = torch.randn(5, 32, device=DEVICE)
    assert_close(fused(x), sep(x).double(), torch.float32, name="out", scale=4.0)


def test_mlp_with_bias_and_bad_arguments():
    mlp = LckSwiGLUMLP(16, 24, bias=True, device=DEVICE)
    assert mlp.gate_proj.bias is not None and mlp.down_proj.bias is not None
    assert mlp(torch.randn(3, 16, device=DEVICE)).shape == (3, 16)
    with pytest.raises(ValueError, match="intermediate_size"):
        LckSwiGLUMLP(16, 0)
    with pytest.raises(TypeError, match="dtype"):
        LckSwiGLUMLP(16, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="in_place=True needs fused_gate_up=True"):
        LckSwiGLUMLP(16, 8, in_place=True)
    with pytest.raises(TypeError, match="fused_gate_up must be a bool"):
        LckSwiGLUMLP(16, 8, fused_gate_up=1)


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
def test_packed_module_is_the_functional_op(in_place):
    torch.manual_seed(10)
    act = LckSwiGLUPacked(in_place=in_place)
    assert f"in_place={in_place}" in repr(act) and list(act.parameters()) == []
    leaf = torch.randn(3, 4, 2 * 24, device=DEVICE, requires_grad=True)
    dout = torch.randn(3, 4, 24, device=DEVICE)
    y = leaf * 1
    out = act(y)
    (dy,) = torch.autograd.grad(out, y, dout)
    y2 = leaf.detach().clone().requires_grad_(True)
    ref = swiglu_packed(y2)
    (dy2,) = torch.autograd.grad(ref, y2, dout)
    assert torch.equal(out, ref) and torch.equal(dy, dy2)
    assert (dy.data_ptr() == y.data_ptr()) == in_place
    with pytest.raises(TypeError, match="in_place must be a bool"):
        LckSwiGLUPacked(in_place="yes")
