"""SwiGLU's C++ host path (``swiglu/csrc/host.h``): the same numbers as the Python Functions, from C++.

On a GPU: ``swiglu`` and ``swiglu_packed`` (which take the C++ backward nodes in plain eager calls)
against the Python ``SwiGLUFunction`` / ``SwiGLUPackedFunction`` on the same inputs, bit for bit, outputs and
gradients, over dtypes, 2-D and 3-D shapes, odd widths, zero rows (which the Python op takes), column-slice
and misaligned inputs, non-contiguous gradients and the packed in-place backward (gradient written into the
buffer, version bump, second-backward guard); the launches counted as made from C++, and a repeated call
making none through Python. Arguments the entries refuse answer None (and the Python errors still raise).
On CPU: the plans handed to C++ give launch.py's grids, CPU tensors never reach the host path, and (under
``TRITON_INTERPRET=1``) the header's entries and backward nodes, compiled with their launches handed to the
Triton interpreter, give the Python Functions' outputs and gradients bit for bit (column slices, unit
dimensions, expanded and non-contiguous gradients, the in-place packed backward with its version bump and
buffer reuse), and keep the autograd contract (second backward refused, modified inputs refused, no graph
under no_grad, forward AD left to Python).
"""

from __future__ import annotations

import pytest
import torch
from _device import gpu
from _host_harness import assert_bits_equal, harness_slots, interpreted_harness

import lck_kernels as L
from lck_kernels import _host
from lck_kernels._common import cdiv, interpreting
from lck_kernels.swiglu import launch as swiglu_launch
from lck_kernels.swiglu.ops import SwiGLUFunction, SwiGLUPackedFunction

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _randn(shape, dtype, g, scale=3.0):
    return (scale * torch.randn(shape, device="cuda", dtype=torch.float32, generator=g)).to(dtype)


def _via_host(t: torch.Tensor) -> bool:
    # The C++ nodes are named lck_host::...; the Python Functions' nodes carry no namespace.
    return t.grad_fn is not None and "lck_host::" in t.grad_fn.name()


def _assert_same(host, python) -> None:
    for k, (a, b) in enumerate(zip(host, python, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"item {k}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert torch.equal(a, b), f"item {k} differs: max |diff| {(a.float() - b.float()).abs().max()}"


def _two(a, b, dc, use_host):
    ai, bi = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    if use_host:
        c = L.swiglu(ai, bi)
    else:
        c = SwiGLUFunction.apply(ai, bi)
    da, db = torch.autograd.grad(c, (ai, bi), dc)
    return c, (c, da, db)


def _packed(y0, dout, in_place, use_host):
    """Output, the gradient of ``y`` and ``leaf.grad`` for a non-leaf ``y = leaf * 1`` (as a GEMM output)."""
    leaf = y0.detach().clone().requires_grad_(True)
    y = leaf * 1
    out = L.swiglu_packed(y, in_place) if use_host else SwiGLUPackedFunction.apply(y, in_place)
    out.backward(dout)
    return out, y, leaf


# ---------------------------------------------------------------------------------------------------------
# GPU: bit for bit against the Python Functions
# ---------------------------------------------------------------------------------------------------------

TWO_SHAPES = [(4096, 4096), (333, 1000), (2, 3, 640), (1, 7), (5, 1), (17, 2049), (0, 512)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", TWO_SHAPES, ids=str)
@gpu
@needs_cuda
def test_host_swiglu_equals_python_function_bit_for_bit(shape, dtype, poisoned) -> None:
    g = torch.Generator(device="cuda").manual_seed(sum(shape) + dtype.itemsize)
    a, b, dc = _randn(shape, dtype, g), _randn(shape, dtype, g), _randn(shape, dtype, g, 1.0)
    before = sum(_host.launch_counts())
    c_host, host = _two(a, b, dc, True)
    c_py, python = _two(a, b, dc, False)
    _assert_same(host, python)
    assert c_host.is_contiguous() and not _via_host(c_py)
    if shape[0] == 0:  # zero rows: the entry refuses, the Python op runs
        assert not _via_host(c_host)
        return
    assert _host.module() is not None, "the host module did not build"
    assert _via_host(c_host), c_host.grad_fn.name()
    assert sum(_host.launch_counts()) >= before + 2, "forward and backward did not launch from C++"
    # Every variant is known now: the same call again launches from C++ only.
    direct, through_python = _host.launch_counts()
    _two(a, b, dc, True)
    assert _host.launch_counts() == (direct + 2, through_python), "a known variant went through Python"


PACKED_SHAPES = [(4096, 2 * 4096), (333, 2 * 1001), (256, 4, 2 * 1024), (1, 2), (3, 2 * 5), (0, 8)]


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
@gpu
@needs_cuda
def test_host_swiglu_packed_equals_python_function_bit_for_bit(shape, dtype, in_place, poisoned) -> None:
    g = torch.Generator(device="cuda").manual_seed(sum(shape) + dtype.itemsize + in_place)
    y0 = _randn(shape, dtype, g)
    dout = _randn((*shape[:-1], shape[-1] // 2), dtype, g, 1.0)
    before = sum(_host.launch_counts())
    out_h, y_h, leaf_h = _packed(y0, dout, in_place, True)
    out_p, y_p, leaf_p = _packed(y0, dout, in_place, False)
    # y holds its gradient after an in-place backward, and is untouched otherwise.
    _assert_same((out_h, leaf_h.grad, y_h.detach()), (out_p, leaf_p.grad, y_p.detach()))
    assert y_h._version == y_p._version, "the in-place backward bumps y's version once, as the Python op"
    assert out_h.is_contiguous()
    if shape[0] == 0:
        assert not _via_host(out_h)
        return
    assert _via_host(out_h), out_h.grad_fn.name()
    assert sum(_host.launch_counts()) >= before + 2
    direct, through_python = _host.launch_counts()
    _packed(y0, dout, in_place, True)
    assert _host.launch_counts() == (direct + 2, through_python), "a known variant went through Python"


@gpu
@needs_cuda
@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
def test_packed_gradient_from_autograd_grad(in_place) -> None:
    """``autograd.grad`` of ``y`` itself: in place, the gradient is ``y``'s own buffer in both paths."""
    g = torch.Generator(device="cuda").manual_seed(3)
    y0, dout = _randn((64, 2 * 384), torch.bfloat16, g), _randn((64, 384), torch.bfloat16, g)
    grads = []
    for use_host in (True, False):
        y = y0.clone().requires_grad_(True) * 1
        out = L.swiglu_packed(y, in_place) if use_host else SwiGLUPackedFunction.apply(y, in_place)
        assert _via_host(out) == use_host
        (dy,) = torch.autograd.grad(out, y, dout)
        assert (dy.data_ptr() == y.data_ptr()) == in_place
        grads.append(dy)
    _assert_same(grads[:1], grads[1:])


@gpu
@needs_cuda
def test_packed_second_backward_through_in_place_graph_raises() -> None:
    g = torch.Generator(device="cuda").manual_seed(4)
    y = _randn((6, 32), torch.float32, g).requires_grad_(True) * 1
    dout = _randn((6, 16), torch.float32, g)
    out = L.swiglu_packed(y, in_place=True)
    assert _via_host(out)
    out.backward(dout, retain_graph=True)
    with pytest.raises(RuntimeError, match=r"in_place=True.*second backward"):
        out.backward(dout)
    # Out of place, twice gives the same gradient.
    y = _randn((6, 32), torch.float32, g).requires_grad_(True) * 1
    out = L.swiglu_packed(y, in_place=False)
    (g1,) = torch.autograd.grad(out, y, dout, retain_graph=True)
    (g2,) = torch.autograd.grad(out, y, dout)
    assert torch.equal(g1, g2)


def _layouts(dtype):
    """(name, a, b, dc) cases the host path takes that are not plain contiguous tensors."""
    g = torch.Generator(device="cuda").manual_seed(5)
    packed = _randn((48, 2 * 320), dtype, g)
    wide = _randn((2, 24, 1000), dtype, g)
    flat = _randn((2 * 40 * 256 + 1,), dtype, g)
    off = flat[1 : 1 + 40 * 256].view(40, 256)  # one element off: another alignment variant
    off_b = flat[1 + 40 * 256 :].view(40, 256)
    dc = _randn((48, 320), dtype, g)
    return [
        ("chunk-halves", *packed.chunk(2, -1), dc),
        ("column-slices-3d", wide[..., 10:330], wide[..., 400:720], _randn((2, 24, 320), dtype, g)),
        ("misaligned", off, off_b, _randn((40, 256), dtype, g)),
        ("transposed-grad", *packed.chunk(2, -1), dc.t().contiguous().t()),
        ("expanded-grad", *packed.chunk(2, -1), torch.ones((), device="cuda", dtype=dtype).expand(48, 320)),
    ]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_host_swiglu_non_contiguous_layouts_bit_for_bit(dtype) -> None:
    for name, a, b, dc in _layouts(dtype):
        c_host, host = _two(a, b, dc, True)
        _, python = _two(a, b, dc, False)
        assert _via_host(c_host), name
        _assert_same(host, python)


@gpu
@needs_cuda
@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
def test_host_swiglu_packed_column_slice_and_odd_gradients(in_place) -> None:
    """A packed buffer inside a wider one (row stride > 2n), 3-D, with a non-contiguous gradient: the
    in-place backward writes only its columns, in both paths alike."""
    g = torch.Generator(device="cuda").manual_seed(6)
    wide0 = _randn((7, 3, 300), torch.bfloat16, g)
    dout = _randn((3, 7, 128), torch.bfloat16, g).transpose(0, 1)  # non-contiguous
    results = []
    for use_host in (True, False):
        leaf = wide0.clone().requires_grad_(True)
        wide = leaf * 1
        y = wide[..., 20:276]
        out = L.swiglu_packed(y, in_place) if use_host else SwiGLUPackedFunction.apply(y, in_place)
        assert _via_host(out) == use_host
        out.backward(dout)
        results.append((out, leaf.grad, wide.detach()))
        assert wide._version == (1 if in_place else 0)
    _assert_same(results[0], results[1])


@gpu
@needs_cuda
def test_overlapping_rows_in_place_stay_on_the_python_path() -> None:
    """An expanded buffer (rows overlap) cannot take its gradient in place: the entry refuses it and the
    Python op raises in backward; out of place the host path takes it."""
    g = torch.Generator(device="cuda").manual_seed(7)
    base = _randn((1, 64), torch.float32, g).requires_grad_(True)
    y = base.expand(5, 64)
    host = _host.module()
    assert host is not None
    assert host.swiglu_packed(y, True) is None
    out = L.swiglu_packed(y, in_place=True)
    assert not _via_host(out)
    with pytest.raises(ValueError, match="overlap"):
        out.backward(torch.ones(5, 32, device="cuda"))
    results = []
    for use_host in (True, False):
        b = base.detach().clone().requires_grad_(True)
        ye = b.expand(5, 64)
        out = L.swiglu_packed(ye) if use_host else SwiGLUPackedFunction.apply(ye, False)
        assert _via_host(out) == use_host
        out.backward(torch.arange(160.0, device="cuda").view(5, 32))
        results.append((out, b.grad))
    _assert_same(results[0], results[1])


@gpu
@needs_cuda
def test_entries_refuse_what_they_do_not_take_and_python_errors_still_raise() -> None:
    host = _host.module()
    assert host is not None
    a = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    refused = [
        host.swiglu(a, a.float()),  # dtype mismatch
        host.swiglu(a, a[:, :32]),  # shape mismatch
        host.swiglu(a.to(torch.int32), a.to(torch.int32)),
        host.swiglu(a, a.cpu()),
        host.swiglu(a.cpu(), a.cpu()),
        host.swiglu(a.t(), a.t()),  # column stride != 1
        host.swiglu(a[:0], a[:0]),  # zero rows
        host.swiglu(a, None),
        host.swiglu_packed(y[:, :127], False),  # odd width
        host.swiglu_packed(y, 1),  # in_place not a bool
        host.swiglu_packed(y.to(torch.int32), False),
        host.swiglu_packed(y.view(2, 4, 128).transpose(0, 1), False),  # rows do not collapse
        host.swiglu_packed(y[:0], True),
    ]
    assert all(r is None for r in refused)
    with pytest.raises(TypeError, match="b"):
        L.swiglu(a, a.float())
    with pytest.raises(ValueError, match="shape"):
        L.swiglu(a, a[:, :32])
    with pytest.raises(ValueError, match="stride"):
        L.swiglu(a.t(), a.t())
    with pytest.raises(ValueError, match="even"):
        L.swiglu_packed(y[:, :127])
    with pytest.raises(TypeError, match="in_place"):
        L.swiglu_packed(y, in_place=1)
    with pytest.raises(ValueError, match="without a copy"):
        L.swiglu_packed(y.view(2, 4, 128).transpose(0, 1))


@gpu
@needs_cuda
def test_mlp_modules_take_the_host_path() -> None:
    torch.manual_seed(8)
    for fused in (False, True):
        mlp = L.LckSwiGLUMLP(64, 96, fused_gate_up=fused, in_place=fused, device="cuda")
        x = torch.randn(4, 64, device="cuda", requires_grad=True)
        before = sum(_host.launch_counts())
        mlp(x).sum().backward()
        assert sum(_host.launch_counts()) >= before + 2
        assert x.grad is not None and torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------------------------
# CPU: plans and routing
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("n_cols", [1, 7, 640, 1000, 4096, 11008, 32768])
def test_host_plans_give_launch_pys_configuration_and_grid(n_cols: int, element_size: int) -> None:
    slots: list[object] = []
    fwd, bwd = swiglu_launch.host_plans(lambda launch: slots.append(launch) or len(slots) - 1)
    for kernel, plan in (("swiglu_fwd", fwd), ("swiglu_bwd", bwd)):
        slot, block_m, block_n = plan(n_cols, element_size)
        for rows in (1, 3, 333, 8192):
            grid, launch = swiglu_launch._plan(kernel, rows, n_cols, element_size)
            assert slots[slot] is launch
            assert grid == (cdiv(rows, block_m) * cdiv(n_cols, block_n),)  # host.h's swiglu_grid


def test_cpu_tensors_never_reach_the_host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args):
        raise AssertionError("CPU tensors must not reach the host module")

    monkeypatch.setattr(_host, "module", refuse)  # ready() answers None for them before asking for it
    a, b = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    y = torch.randn(4, 32, requires_grad=True)
    if not interpreting():  # no kernel device for CPU tensors: the Python checks raise, as before
        with pytest.raises(ValueError, match="device"):
            L.swiglu(a, b)
        with pytest.raises(ValueError, match="device"):
            L.swiglu_packed(y)
        return
    c = L.swiglu(a, b)
    assert "SwiGLUFunction" in c.grad_fn.name()
    torch.autograd.grad(c, (a, b), torch.ones_like(c))
    out = L.swiglu_packed(y * 1, in_place=True)
    assert "SwiGLUPackedFunction" in out.grad_fn.name()
    out.sum().backward()


# ---------------------------------------------------------------------------------------------------------
# CPU: host.h's entries and nodes with their launches interpreted (no GPU needed)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    """host.h with its launches handed to the Triton interpreter (argument counts 8 for the forward, 12 for the
    backward) and the plans wired in, built once per machine into the LCK JIT cache (tens of seconds)."""
    module = interpreted_harness("swiglu", (8, 12), ("swiglu",), "swiglu host harness")
    module.swiglu_set_plans(*swiglu_launch.host_plans(harness_slots(module)))
    return module


HARNESS_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HARNESS_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "cols"),
    [((5, 7), None), ((2, 3, 40), None), ((1, 1), None), ((6, 1), None), ((3, 2100), None),
     ((4, 3, 50), (5, 25)), ((2, 1, 3, 16), None)],  # column slices of a wider buffer; a unit dimension
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("grad", ["plain", "expanded"])
def test_harness_swiglu_equals_python_function_bit_for_bit(harness, shape, cols, dtype, grad) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    a0, b0 = (torch.randn(shape, generator=g) * 3).to(dtype), torch.randn(shape, generator=g).to(dtype)
    out_shape = (*shape[:-1], cols[1] - cols[0]) if cols else shape
    dc = (
        torch.randn(out_shape, generator=g).to(dtype)
        if grad == "plain"
        else torch.ones((), dtype=dtype).expand(out_shape)
    )
    results = []
    for host in (True, False):
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        av, bv = (a[..., cols[0] : cols[1]], b[..., cols[0] : cols[1]]) if cols else (a, b)
        c = harness.swiglu(av, bv) if host else SwiGLUFunction.apply(av, bv)
        assert (c.grad_fn.name() == "lck_host::SwiGLUBackward") == host
        c.backward(dc)
        results.append((c.detach(), a.grad, b.grad))
    for name, x, y in zip(("out", "da", "db"), *results):
        assert_bits_equal(x, y, name)
    assert results[0][0].is_contiguous()


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("dtype", HARNESS_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "cols"),
    [((5, 14), None), ((2, 3, 80), None), ((1, 2), None), ((3, 2 * 1001), None), ((4, 3, 100), (10, 74)),
     ((32,), None)],  # a packed buffer inside a wider one; a single 1-D row
    ids=str,
)  # fmt: skip
def test_harness_swiglu_packed_equals_python_function_bit_for_bit(
    harness, shape, cols, dtype, in_place
) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    y0 = (torch.randn(shape, generator=g) * 3).to(dtype)
    width = cols[1] - cols[0] if cols else shape[-1]
    dout = torch.randn((*shape[:-1], width // 2), generator=g).to(dtype)
    if len(shape) > 1:
        dout = dout.transpose(0, -2).contiguous().transpose(0, -2)  # non-contiguous
    results = []
    for host in (True, False):
        base = y0.clone().requires_grad_(True) * 1
        y = base[..., cols[0] : cols[1]] if cols else base
        out = harness.swiglu_packed(y, in_place) if host else SwiGLUPackedFunction.apply(y, in_place)
        assert (out.grad_fn.name() == "lck_host::SwiGLUPackedBackward") == host
        (dy,) = torch.autograd.grad(out, y, dout)
        reused = dy.data_ptr() == y.data_ptr()
        results.append((out.detach(), dy.clone(), base.detach().clone(), base._version, reused))
    for name, k in (("out", 0), ("dy", 1), ("buffer", 2)):
        assert_bits_equal(results[0][k], results[1][k], name)
    assert results[0][3] == results[1][3] == int(in_place), "the in-place backward bumps the version once"
    assert results[0][4] == results[1][4] == in_place


def test_harness_autograd_contract(harness) -> None:
    y = torch.randn(6, 32, requires_grad=True) * 1
    out = harness.swiglu_packed(y, True)
    out.backward(torch.ones(6, 16), retain_graph=True)
    with pytest.raises(RuntimeError, match=r"in_place=True.*second backward"):
        out.backward(torch.ones(6, 16))
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    c = harness.swiglu(a, b)  # b needs no gradient: one edge only
    (da,) = torch.autograd.grad(c, a, torch.ones(4, 8))
    assert torch.equal(da, torch.autograd.grad(SwiGLUFunction.apply(a, b), a, torch.ones(4, 8))[0])
    c = harness.swiglu(a, b)
    c.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        c.sum().backward()
    c = harness.swiglu(a, b)
    with torch.no_grad():
        a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()
    with torch.no_grad():
        assert harness.swiglu(a, b).grad_fn is None
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(a.detach(), torch.ones(4, 8))
        assert harness.swiglu(dual, b) is None  # forward AD: the Python path
    assert harness.swiglu(torch.randn(4, 8), torch.randn(4, 9)) is None
    assert harness.swiglu_packed(torch.randn(4, 7), False) is None
