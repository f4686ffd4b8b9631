"""SwiGLU's C++ host path (``swiglu/csrc/host.h``): the same numbers as the Python Functions, from C++.

On a GPU: ``swiglu`` and ``swiglu_packed`` (which take the C++ autograd Functions in plain eager calls)
against the Python ``SwiGLUFunction`` / ``SwiGLUPackedFunction`` on the same inputs, bit for bit, outputs and
gradients, over dtypes, 2-D and 3-D shapes, odd widths, zero rows (which the Python op takes), column-slice
and misaligned inputs, non-contiguous gradients and the packed in-place backward (gradient written into the
buffer, version bump, second-backward guard); the launches counted as made from C++, and a repeated call
making none through Python. Arguments the entries refuse answer None (and the Python errors still raise).
On CPU: the plans handed to C++ give launch.py's grids, CPU tensors never reach the host path, and (under
``TRITON_INTERPRET=1``) the header's autograd Functions, compiled with a stand-in for the kernel launch that
logs its arguments and computes with torch ops, make exactly the launches the Python Functions make (slot,
grid, tensor shapes, strides, dtypes and aliasing, integers) and the same outputs, gradients, version bumps
and in-place buffer reuse.
"""

from __future__ import annotations

import pytest
import torch
from _device import gpu
from _host_harness import load_harness

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
    # A C++ Function's node is torch::autograd::CppNode<lck_host::...Fn>; the Python ones end in "Backward".
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
# CPU: host.h's Functions with the launch stood in for (no GPU needed)
# ---------------------------------------------------------------------------------------------------------

# launch_args<8> / launch_args<12> (the forward and backward kernels' runtime arguments) specialised before host.h is
# included: log (slot, grid, args) and compute with torch ops, bumping no version (as a kernel launch); the
# CUDA guard becomes a no-op so CPU tensors pass.
_HARNESS = r"""
#include <c10/cuda/CUDAGuard.h>
#include "@HOST@/launcher.h"
namespace c10::cuda { struct FakeGuard { explicit FakeGuard(c10::Device) {} }; }
#define CUDAGuard FakeGuard
namespace lck_host {
inline py::list& fake_log() { static py::list* l = new py::list(); return *l; }
template <size_t N> void fake_record(int slot, std::array<unsigned, 3> grid, const std::array<Arg, N>& args) {
  py::gil_scoped_acquire gil;
  py::tuple out(N);
  for (size_t k = 0; k < N; ++k) {
    const Arg& a = args[k];
    if (a.kind == Arg::kPtr) {
      const at::Tensor& t = *a.tensor;
      py::list sh, st;
      for (int64_t d = 0; d < t.dim(); ++d) { sh.append(py::int_(t.size(d))); st.append(py::int_(t.stride(d))); }
      out[k] = py::make_tuple(py::int_(reinterpret_cast<uintptr_t>(t.data_ptr())), py::tuple(sh), py::tuple(st),
                              py::str(c10::toString(t.scalar_type())));
    } else if (a.kind == Arg::kInt) {
      out[k] = py::int_(a.i);
    } else {
      out[k] = py::float_(a.f);
    }
  }
  fake_log().append(py::make_tuple(py::int_(slot), py::make_tuple(py::int_(grid[0]), py::int_(grid[1]),
                                   py::int_(grid[2])), out));
}
template <> void launch_args<8>(int slot, std::array<unsigned, 3> grid, int, const std::array<Arg, 8>& args) {
  fake_record(slot, grid, args);
  at::Tensor a = args[0].tensor->to(at::kFloat), b = args[1].tensor->to(at::kFloat);
  at::AutoDispatchBelowADInplaceOrView below;
  at::Tensor(*args[2].tensor).copy_(a * at::sigmoid(a) * b);
}
template <> void launch_args<12>(int slot, std::array<unsigned, 3> grid, int, const std::array<Arg, 12>& args) {
  fake_record(slot, grid, args);
  at::Tensor a = args[0].tensor->to(at::kFloat), b = args[1].tensor->to(at::kFloat);
  at::Tensor dc = args[2].tensor->to(at::kFloat), s = at::sigmoid(a), silu = a * s;
  at::Tensor da = dc * b * (s + silu * (1 - s)), db = dc * silu;
  at::AutoDispatchBelowADInplaceOrView below;
  at::Tensor(*args[3].tensor).copy_(da);
  at::Tensor(*args[4].tensor).copy_(db);
}
}  // namespace lck_host
#include "@PKG@/swiglu/csrc/host.h"
PYBIND11_MODULE(_swiglu_host_harness, m) {
  lck_host::bind_swiglu(m);
  m.def("apply", [](at::Tensor a, at::Tensor b) { return lck_host::SwiGLUFn::apply(a, b); });
  m.def("apply_packed", [](at::Tensor y, bool ip) { return lck_host::SwiGLUPackedFn::apply(y, ip); });
  m.def("take_log", [] {
    py::list out = lck_host::fake_log().attr("copy")();
    lck_host::fake_log().attr("clear")();
    return out;
  });
}
"""


@pytest.fixture(scope="module")
def harness():
    """The harness module, built once per machine into the LCK JIT cache (tens of seconds)."""
    module = load_harness("_swiglu_host_harness", _HARNESS, "swiglu host harness")
    return module


@pytest.fixture
def logged(harness, monkeypatch: pytest.MonkeyPatch):
    """(harness, take_python_log): both sides' launches logged alike, slots shared."""
    from lck_kernels._eager import Launch

    slots: dict[int, int] = {}

    def slot(launch) -> int:
        return slots.setdefault(id(launch), len(slots))

    harness.swiglu_set_plans(*swiglu_launch.host_plans(slot))
    python_log: list = []
    real = Launch.__call__

    def record(self, grid, *args):
        desc = tuple(
            (a.data_ptr(), tuple(a.shape), a.stride(), str(a.dtype)) if isinstance(a, torch.Tensor) else a
            for a in args
        )
        python_log.append((slot(self), (*grid, *(1,) * (3 - len(grid))), desc))
        return real(self, grid, *args)

    monkeypatch.setattr(Launch, "__call__", record)

    def take_python_log() -> list:
        out = list(python_log)
        python_log.clear()
        return out

    harness.take_log()
    return harness, take_python_log


_TORCH_DTYPE = {"Float": "torch.float32", "Half": "torch.float16", "BFloat16": "torch.bfloat16"}


def _canonical(log) -> list:
    """Launches with each pointer replaced by its first position among the launch's tensors (aliasing)."""
    out = []
    for slot, grid, args in log:
        seen: dict[int, int] = {}
        canon = []
        for a in args:
            if isinstance(a, tuple):
                ptr, shape, stride, dtype = a
                canon.append(
                    (
                        seen.setdefault(ptr, len(seen)),
                        tuple(shape),
                        tuple(stride),
                        _TORCH_DTYPE.get(dtype, dtype),
                    )
                )
            else:
                canon.append(a)
        out.append((slot, tuple(grid), tuple(canon)))
    return out


def _close(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape, what
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2  # the stand-in computes with torch, not the kernel
    torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


HARNESS_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HARNESS_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "cols"),
    [((5, 7), None), ((2, 3, 40), None), ((1, 1), None), ((6, 1), None), ((3, 2100), None), ((0, 8), None),
     ((4, 3, 50), (5, 25))],  # the last: column slices of a wider buffer
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("grad", ["plain", "expanded"])
def test_harness_swiglu_launches_as_the_python_function(logged, shape, cols, dtype, grad) -> None:
    harness, take_python_log = logged
    torch.manual_seed(len(shape) + shape[-1])
    a0, b0 = (torch.randn(shape) * 3).to(dtype), torch.randn(shape).to(dtype)
    out_shape = (*shape[:-1], cols[1] - cols[0]) if cols else shape
    dc = (
        torch.randn(out_shape).to(dtype) if grad == "plain" else torch.ones((), dtype=dtype).expand(out_shape)
    )
    results, logs = [], []
    for apply in (harness.apply, SwiGLUFunction.apply):
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        av, bv = (a[..., cols[0] : cols[1]], b[..., cols[0] : cols[1]]) if cols else (a, b)
        c = apply(av, bv)
        c.backward(dc)
        results.append((c, a.grad, b.grad))
        logs.append(
            _canonical(harness.take_log()) if apply is harness.apply else _canonical(take_python_log())
        )
    assert logs[0] == logs[1]
    assert len(logs[0]) == (2 if shape[0] else 0)
    for k, (x, y) in enumerate(zip(*results)):
        _close(x, y, f"item {k}")
    assert results[0][0].is_contiguous()


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("dtype", HARNESS_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "cols"),
    [((5, 14), None), ((2, 3, 80), None), ((1, 2), None), ((3, 2 * 1001), None), ((0, 8), None),
     ((4, 3, 100), (10, 74))],  # the last: a packed buffer inside a wider one
    ids=str,
)  # fmt: skip
def test_harness_swiglu_packed_launches_as_the_python_function(logged, shape, cols, dtype, in_place) -> None:
    harness, take_python_log = logged
    torch.manual_seed(len(shape) + shape[-1])
    y0 = (torch.randn(shape) * 3).to(dtype)
    width = cols[1] - cols[0] if cols else shape[-1]
    dout = torch.randn((*shape[:-1], width // 2)).to(dtype)
    if len(shape) > 1:
        dout = dout.transpose(0, -2).contiguous().transpose(0, -2)  # non-contiguous
    results, logs = [], []
    for host in (True, False):
        base = y0.clone().requires_grad_(True) * 1
        y = base[..., cols[0] : cols[1]] if cols else base
        out = harness.apply_packed(y, in_place) if host else SwiGLUPackedFunction.apply(y, in_place)
        (dy,) = torch.autograd.grad(out, y, dout)
        reused = dy.data_ptr() == y.data_ptr() if y.numel() else in_place
        results.append((out, dy.clone(), base.detach().clone(), base._version, reused))
        logs.append(_canonical(harness.take_log()) if host else _canonical(take_python_log()))
    assert logs[0] == logs[1]
    assert len(logs[0]) == (2 if shape[0] else 0)
    for k in range(3):
        _close(results[0][k], results[1][k], f"item {k}")
    assert results[0][3] == results[1][3] == int(in_place), "the in-place backward bumps the version once"
    assert results[0][4] == results[1][4] == in_place


def test_harness_second_backward_through_in_place_graph_raises(logged) -> None:
    harness, _ = logged
    y = torch.randn(6, 32, requires_grad=True) * 1
    out = harness.apply_packed(y, True)
    out.backward(torch.ones(6, 16), retain_graph=True)
    with pytest.raises(RuntimeError, match=r"in_place=True.*second backward"):
        out.backward(torch.ones(6, 16))
