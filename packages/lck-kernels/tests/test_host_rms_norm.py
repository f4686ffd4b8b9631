"""RMSNorm's C++ backward node (``rms_norm/csrc/host.h``, ``_host/node.h``) without a GPU.

Under ``TRITON_INTERPRET=1``, ``host.h`` is compiled into a harness module whose launches go to the Triton
interpreter on CPU tensors (everything else as built for the GPU), and compared with the Python
``RMSNormFunction`` bit for bit: the output and both gradients over the launch plans (whole rows, several rows
per program, tiled rows), dtypes, casting modes, the in-place backward, a weight without gradient, an input
without gradient, a 3-D input with a unit dimension and a column slice. Then the autograd contract a node
written by hand must keep: the node's name, a second backward over a freed graph and an input modified after
the forward both refused with torch's errors, ``autograd.grad`` asking for one input only, no graph under
``no_grad``, and a forward-mode dual input sent to the Python path. The GPU comparison is in
``test_host_module.py``.
"""

from __future__ import annotations

import pytest
import torch
from _host_harness import harness_slots, interpreted_harness, on_device_0

from lck_kernels.rms_norm import launch as rms_launch
from lck_kernels.rms_norm.ops import RMSNormFunction


@pytest.fixture(scope="module")
def harness():
    """host.h with its launches interpreted and the plans wired in (built once per machine into the JIT cache):
    launch counts 4 (the dweight sum), 9 (the tiled path's dot), 10 (the forward), 13 (the row backward) and
    14 (the tiled backward)."""
    module = interpreted_harness("rms_norm", (4, 9, 10, 13, 14), ("rms_norm",), "RMSNorm host harness")
    module.rms_norm_set_plans(*(on_device_0(p) for p in rms_launch.host_plans(harness_slots(module))))
    return module


@pytest.fixture
def fake_sms(monkeypatch: pytest.MonkeyPatch):
    """Backward plans computed with 4 SMs on any device, as num_sms answers for CPU tensors."""
    monkeypatch.setattr(rms_launch, "num_sms", lambda device: 4)
    rms_launch._bwd_plan.cache_clear()
    yield
    rms_launch._bwd_plan.cache_clear()


CASTING = ("llama", "gemma", "none")


def _run(harness, x, w, dy, casting: str, in_place: bool, host: bool, inputs: str = "xw"):
    """(y, grads...) of one forward and backward on fresh leaves; ``inputs`` names which require grad."""
    xi = x.clone().requires_grad_("x" in inputs)
    wi = w.clone().requires_grad_("w" in inputs)
    if host:
        y = harness.rms_norm(xi, wi, 1e-6, 0.25, casting, in_place)
        assert y is not None and y.grad_fn is not None and y.grad_fn.name() == "lck_host::RMSNormBackward"
    else:
        y = RMSNormFunction.apply(xi, wi, 1e-6, 0.25, casting, in_place)
    wanted = [t for t, name in ((xi, "x"), (wi, "w")) if name in inputs]
    return (y.detach(), *torch.autograd.grad(y, wanted, dy.clone()))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((7, 13), torch.float32),
        ((16, 100), torch.bfloat16),  # several rows per program
        ((2, 1, 3, 64), torch.float16),  # a unit leading dimension
        ((3, 9000), torch.float32),  # tiled rows: the dot and tiled kernels
    ],
)
@pytest.mark.parametrize("casting", CASTING)
def test_harness_equals_python_function_bit_for_bit(harness, fake_sms, shape, dtype, casting) -> None:
    g = torch.Generator().manual_seed(sum(shape) + len(casting))
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    for in_place, inputs in ((False, "xw"), (True, "xw"), (False, "x"), (False, "w")):
        host = _run(harness, x, w, dy, casting, in_place, True, inputs)
        python = _run(harness, x, w, dy, casting, in_place, False, inputs)
        for k, (a, b) in enumerate(zip(host, python)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), f"output {k} differs (in_place={in_place}, inputs={inputs})"


def test_harness_column_slice(harness, fake_sms) -> None:
    """A column slice (rows far apart) takes the host path and matches a contiguous copy."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 96, generator=g, requires_grad=True)
    w, dy = torch.randn(40, generator=g), torch.randn(6, 40, generator=g)
    y_slice = harness.rms_norm(wide[:, :40], w, 1e-6, 0.0, "llama", False)
    dx_slice = torch.autograd.grad(y_slice, wide, dy)[0]
    xc = wide.detach()[:, :40].contiguous().requires_grad_(True)
    y = harness.rms_norm(xc, w, 1e-6, 0.0, "llama", False)
    assert torch.equal(y_slice, y)
    assert torch.equal(dx_slice[:, :40], torch.autograd.grad(y, xc, dy)[0])
    assert not dx_slice[:, 40:].any()


def test_harness_autograd_contract(harness, fake_sms) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32, generator=g, requires_grad=True)
    w = torch.randn(32, generator=g, requires_grad=True)
    dy = torch.randn(4, 32, generator=g)

    y = harness.rms_norm(x, w, 1e-6, 0.0, "llama", False)
    torch.autograd.grad(y, (x, w), dy)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y, (x, w), dy)

    y = harness.rms_norm(x, w, 1e-6, 0.0, "llama", False)
    dx_only = torch.autograd.grad(y, x, dy)[0]  # the weight's gradient not asked for
    assert dx_only.shape == x.shape

    xm = x.detach().clone().requires_grad_(True)
    xv = xm * 1.0  # a non-leaf the test may modify after the forward
    y = harness.rms_norm(xv, w, 1e-6, 0.0, "llama", False)
    with torch.no_grad():
        xv.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, (xm, w), dy)

    with torch.no_grad():
        y = harness.rms_norm(x, w, 1e-6, 0.0, "llama", False)
    assert y.grad_fn is None and not y.requires_grad

    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.randn_like(x))
        assert harness.rms_norm(dual, w, 1e-6, 0.0, "llama", False) is None  # the Python path's business
