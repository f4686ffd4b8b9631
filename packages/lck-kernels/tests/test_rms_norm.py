"""RMSNorm against a float64 reference, its casting modes, in-place dX, layouts, errors, opcheck, compile.

On CPU these run under ``TRITON_INTERPRET=1`` at small sizes; the ``gpu`` parameters run the same functions
at real sizes on a CUDA device.
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch
from _device import COMPILE_BACKENDS, DEVICE, DTYPES, gpu, needs_triton_device
from _errors import bad_input_test
from _tolerances import assert_close

from lck_kernels import LckRMSNorm, rms_norm
from lck_kernels._common import interpreting, tuning
from lck_kernels.rms_norm.launch import MAX_BLOCK, bwd_config, fwd_config

pytestmark = needs_triton_device
MODES = ["llama", "gemma", "none"]


def reference(x, w, eps, offset):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())


def emulate(x, w, eps, offset, mode):
    """Each casting mode's definition in plain torch (see lck_kernels.rms_norm)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    weff = w.float() + offset
    if mode == "llama":
        return ((xf * rstd).to(x.dtype).float() * weff).to(x.dtype)
    if mode == "gemma":
        return (xf * rstd * weff).to(x.dtype)
    xn = (xf * rstd.to(x.dtype).float()).to(x.dtype).float()
    return (xn * weff.to(x.dtype).float()).to(x.dtype)


def check_against_reference(shape, dtype, mode, offset, *, in_place=False, w_dtype=None, eps=1e-6):
    torch.manual_seed(zlib.crc32(repr((shape, str(dtype), mode, offset)).encode()))
    x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3 + 0.5
    w = torch.rand(shape[-1], device=DEVICE, dtype=w_dtype or dtype) + 0.5
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = rms_norm(x, w, eps=eps, offset=offset, casting_mode=mode, in_place=in_place)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    dx, dw = torch.autograd.grad(y, (x, w), dy.clone())
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref = reference(x64, w64, eps, offset)
    dx64, dw64 = torch.autograd.grad(ref, (x64, w64), dy.double())
    # "none" rounds four times in x's dtype; the other modes at most twice.
    scale = 2.0 if mode == "none" else 1.0
    assert_close(y, ref, dtype, name="y", scale=scale)
    assert_close(dx, dx64, dtype, name="dx")
    assert dw.dtype == w.dtype
    assert_close(dw, dw64, w.dtype if w.dtype != torch.float32 else dtype, name="dweight", scale=2.0)


CPU_SHAPES = [(1, 8), (7, 33), (2, 3, 64), (3, 5120)]
# Every dtype and mode at moderate GPU sizes (one row, odd widths, 3-D, the widest fused row, a tiled row) ...
GPU_SHAPES = [(1, 5120), (333, 7168), (2, 1024, 5120), (256, 16384), (64, 20000)]
# ... and the headline training shapes per dtype (float64 checks of 67M elements take seconds each).
GPU_LARGE = [((16384, 4096), "llama"), ((16384, 4096), "gemma"), ((4, 2048, 5120), "none")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [*CPU_SHAPES, *(pytest.param(s, marks=gpu, id=f"gpu-{s}") for s in GPU_SHAPES)], ids=str
)
def test_matches_float64_reference(shape, dtype, mode, poisoned):
    check_against_reference(shape, dtype, mode, offset=0.0 if mode == "llama" else 1.0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "mode"), GPU_LARGE, ids=str)
def test_large_shapes_match_float64_reference(shape, mode, dtype, poisoned):
    check_against_reference(shape, dtype, mode, offset=0.0 if mode == "llama" else 1.0)


# Triton's interpreter truncates fp32 -> bf16 (GPUs round to nearest even), so bit-level rounding checks run
# in fp16 on CPU and in both half types on the GPU.
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((64, 96), torch.float16),
        pytest.param((4096, 4096), torch.float16, marks=gpu, id="gpu-fp16"),
        pytest.param((4096, 4096), torch.bfloat16, marks=gpu, id="gpu-bf16"),
    ],
)
def test_casting_modes_follow_their_definitions(shape, dtype):
    torch.manual_seed(1)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    outs, emus = {}, {}
    for mode in MODES:
        outs[mode] = rms_norm(x, w, offset=0.25, casting_mode=mode)
        emus[mode] = emulate(x, w, 1e-6, 0.25, mode)
        # Same roundings as the definition; only the fp32 sum order differs, which rarely flips a rounding.
        mismatch = (outs[mode] != emus[mode]).float().mean().item()
        assert mismatch < 0.01, f"{mode}: {mismatch:.2%} of elements differ from the mode's definition"
        assert_close(outs[mode], emus[mode], dtype, name=mode)
    # The modes really are different computations on this data (so the check above can tell them apart).
    for a, b in [("llama", "gemma"), ("llama", "none"), ("gemma", "none")]:
        assert (emus[a] != emus[b]).float().mean().item() > 0.02, (a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape", [(5, 100), (2, 3, 300), pytest.param((512, 40000), marks=gpu, id="gpu")], ids=str
)
def test_tiled_rows_match_reference(shape, mode, poisoned):
    """Rows wider than one block: forced on CPU with small blocks, natural on GPU (hidden > MAX_BLOCK)."""
    if shape[-1] > MAX_BLOCK:
        check_against_reference(shape, torch.bfloat16, mode, 0.5)
        return
    with tuning("rms_norm_fwd", BLOCK_N=32, ROWS=1), tuning("rms_norm_bwd", BLOCK_N=64, ROWS=2):
        assert fwd_config(shape[-1], 4)["BLOCK_N"] < shape[-1]
        check_against_reference(shape, torch.float32, mode, 0.5)


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((23, 64), torch.float32), pytest.param((4099, 4096), torch.bfloat16, marks=gpu, id="gpu")],
    ids=str,
)
def test_backward_prefetch_matches_reference(shape, dtype, in_place, poisoned):
    """The look-ahead backward (next rows loaded before this step's reduction) over ragged row ranges: the
    last program's range ends mid-step, and in place ``dx`` lands in rows the look-ahead has left behind."""
    with tuning("rms_norm_bwd", PREFETCH=1, ROWS=2, PROGRAMS_PER_SM=1):
        assert bwd_config(shape[-1], 4)["PREFETCH"] == 1
        check_against_reference(shape, dtype, "llama", 0.0, in_place=in_place)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_dtype_may_differ_from_x(w_dtype):
    check_against_reference((9, 48), torch.bfloat16, "llama", 0.0, w_dtype=w_dtype)


@pytest.mark.parametrize(
    "shape", [(6, 40), (2, 3, 40), pytest.param((8192, 4096), marks=gpu, id="gpu")], ids=str
)
def test_in_place_writes_dx_into_dy(shape, poisoned):
    torch.manual_seed(2)
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    dy = torch.randn(shape, device=DEVICE)
    grads = {}
    for in_place in (False, True):
        g = dy.clone()
        y = rms_norm(x, w, casting_mode="gemma", in_place=in_place)
        dx, dw = torch.autograd.grad(y, (x, w), g)
        assert (dx.data_ptr() == g.data_ptr()) == in_place, "in_place decides whether dx reuses dy's buffer"
        grads[in_place] = (dx.clone(), dw)
    assert_close(grads[True][0], grads[False][0], torch.float32, name="dx")
    assert_close(grads[True][1], grads[False][1], torch.float32, name="dweight")
    check_against_reference(shape, torch.float32, "llama", 0.0, in_place=True)


@gpu
def test_in_place_saves_an_activation_sized_buffer():
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    peaks = {}
    for in_place in (False, True):
        y = rms_norm(x, w, in_place=in_place)
        g = torch.randn_like(y)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(y, (x, w), g)
        torch.cuda.synchronize()
        peaks[in_place] = torch.cuda.max_memory_allocated() - base
    saved = peaks[False] - peaks[True]
    assert saved >= 0.9 * x.nbytes, (
        f"in_place saved {saved / 2**20:.1f} MiB, expected ~{x.nbytes / 2**20:.0f} MiB"
    )


@gpu
def test_offsets_past_2_31_elements():
    """524296 x 4096 bf16 has more than 2**31 elements: the last rows need 64-bit offsets, and each persistent
    backward program walks ~2000 rows."""
    rows, hidden = 2**31 // 4096 + 8, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.ops.lck.rms_norm_fwd(x, w, 1e-6, 0.0, "gemma")
    dx, dw = torch.ops.lck.rms_norm_bwd(dy, x, w, rstd, 0.0, "gemma")
    tail = slice(rows - 16, rows)
    x64 = x[tail].double().requires_grad_(True)
    ref = reference(x64, w, 1e-6, 0.0)
    (dx64,) = torch.autograd.grad(ref, x64, dy[tail].double())
    assert_close(y[tail], ref, torch.bfloat16, name="y (last rows)")
    assert_close(dx[tail], dx64, torch.bfloat16, name="dx (last rows)")
    dw_ref = torch.zeros(hidden, device="cuda", dtype=torch.float64)
    for chunk in range(0, rows, 65536):  # sum(dy * x * rstd) over all rows, in chunks to bound memory
        part = slice(chunk, min(rows, chunk + 65536))
        xf = x[part].double()
        dw_ref += (dy[part].double() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0)
    assert_close(dw, dw_ref, torch.bfloat16, name="dweight", scale=2.0)


def test_strided_and_3d_inputs():
    torch.manual_seed(3)
    wide = torch.randn(10, 80, device=DEVICE)
    x = wide[:, :64]  # row stride 80: read in place, no copy
    w = torch.randn(64, device=DEVICE)
    assert_close(rms_norm(x, w), reference(x, w, 1e-6, 0.0), torch.float32)
    x3 = torch.randn(3, 10, 80, device=DEVICE)[:, :, 16:]
    assert_close(rms_norm(x3, w), reference(x3, w, 1e-6, 0.0), torch.float32)
    x1 = torch.randn(64, device=DEVICE)
    assert_close(rms_norm(x1, w), reference(x1, w, 1e-6, 0.0), torch.float32)


def test_zero_rows():
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (0, 16)
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros_like(w))


def _bad_calls(device):
    """(argument named in the error, exception type, call); ``device`` is the kernel device (meta to count)."""
    ok_x = torch.randn(4, 8, device=device)
    ok_w = torch.randn(8, device=device)
    return [
        ("x", TypeError, lambda: rms_norm(ok_x.tolist(), ok_w)),
        ("x", TypeError, lambda: rms_norm(ok_x.to(torch.int32), ok_w)),
        ("x", ValueError, lambda: rms_norm(ok_x.to("meta"), ok_w)),
        ("x", ValueError, lambda: rms_norm(ok_x.t(), ok_w[:4])),
        ("x", ValueError, lambda: rms_norm(torch.randn(4, 6, 8, device=device).transpose(0, 1), ok_w)),
        ("x", ValueError, lambda: rms_norm(torch.randn(4, 0, device=device), ok_w[:0])),
        ("weight", ValueError, lambda: rms_norm(ok_x, ok_w[:7])),
        ("weight", ValueError, lambda: rms_norm(ok_x, ok_w.view(2, 4))),
        ("weight", TypeError, lambda: rms_norm(ok_x, ok_w.to(torch.int64))),
        ("weight", ValueError, lambda: rms_norm(ok_x, torch.randn(16, device=device)[::2])),
        ("weight", ValueError, lambda: rms_norm(ok_x, ok_w.to("meta"))),
        ("eps", ValueError, lambda: rms_norm(ok_x, ok_w, eps=-1.0)),
        ("eps", ValueError, lambda: rms_norm(ok_x, ok_w, eps=float("nan"))),
        ("offset", ValueError, lambda: rms_norm(ok_x, ok_w, offset=float("inf"))),
        ("casting_mode", ValueError, lambda: rms_norm(ok_x, ok_w, casting_mode="mistral")),
        ("in_place", TypeError, lambda: rms_norm(ok_x, ok_w, in_place="yes")),
    ]


test_bad_input_names_the_argument = bad_input_test("rms_norm", _bad_calls, count_on="meta")


def test_module():
    norm = LckRMSNorm(48, eps=1e-5, offset=1.0, casting_mode="gemma", init=0.0, device=DEVICE)
    assert torch.equal(norm.weight.detach(), torch.zeros(48, device=DEVICE))
    assert "casting_mode='gemma'" in repr(norm)
    x = torch.randn(5, 48, device=DEVICE)
    assert_close(norm(x), reference(x, norm.weight.detach(), 1e-5, 1.0), torch.float32)
    with pytest.raises(ValueError, match="hidden_size"):
        LckRMSNorm(0)
    with pytest.raises(ValueError, match="casting_mode"):
        LckRMSNorm(8, casting_mode="bad")


@pytest.mark.parametrize("n_cols", [1, 5, 64, 1000, 4096, 5120, 16384, 16385, 65536])
@pytest.mark.parametrize("element_size", [2, 4])
def test_launch_configs(n_cols, element_size):
    for cfg in (fwd_config(n_cols, element_size), bwd_config(n_cols, element_size)):
        block, rows, warps = cfg["BLOCK_N"], cfg["ROWS"], cfg["num_warps"]
        assert block & (block - 1) == 0 and rows & (rows - 1) == 0 and warps & (warps - 1) == 0
        assert 1 <= warps <= 32 and block <= MAX_BLOCK
        assert (block >= n_cols) == (n_cols <= MAX_BLOCK), "tiled exactly when a row does not fit one block"
        assert rows == 1 or block >= n_cols, "several rows per program only for untiled rows"
    assert bwd_config(n_cols, element_size)["PROGRAMS_PER_SM"] >= 1
    with tuning("rms_norm_fwd", num_warps=2):
        assert fwd_config(n_cols, element_size)["num_warps"] == 2
    with pytest.raises(ValueError, match="unknown parameter"), tuning("rms_norm_fwd", BLOCK=4):
        fwd_config(n_cols, element_size)


def _op_args(shape, dtype=torch.float32):
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    y, rstd = torch.ops.lck.rms_norm_fwd(x, w, 1e-6, 0.5, "llama")
    return x, w, rstd, torch.randn_like(y)


@pytest.mark.parametrize(
    "shape", [(5, 24), (2, 3, 24), pytest.param((2048, 4096), marks=gpu, id="gpu")], ids=str
)
def test_opcheck(shape):
    x, w, rstd, dy = _op_args(shape)
    torch.library.opcheck(torch.ops.lck.rms_norm_fwd.default, (x, w, 1e-6, 0.5, "gemma"))
    torch.library.opcheck(torch.ops.lck.rms_norm_bwd.default, (dy, x, w, rstd, 0.5, "llama"))
    torch.library.opcheck(torch.ops.lck.rms_norm_bwd_.default, (dy.clone(), x, w, rstd, 0.5, "none"))


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("in_place", [False, True])
def test_torch_compile_fullgraph(backend, in_place):
    torch._dynamo.reset()
    torch.manual_seed(4)
    hidden = 48 if interpreting() else 4096
    norm = LckRMSNorm(hidden, casting_mode="llama", in_place=in_place, device=DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)

    def step(x):
        y = norm(x * 2.0)
        return (y * y).sum()

    x = torch.randn(2, 7, hidden, device=DEVICE, requires_grad=True)
    loss = step(x)
    eager = torch.autograd.grad(loss, (x, norm.weight))
    # fullgraph=True: any graph break is an error, so passing means the op traced without one.
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss_c = compiled(x)
    got = torch.autograd.grad(loss_c, (x, norm.weight))
    assert_close(loss_c, loss, torch.float32, name="loss")
    assert_close(got[0], eager[0], torch.float32, name="dx")
    assert_close(got[1], eager[1], torch.float32, name="dweight")


def test_eager_calls_skip_the_dispatcher_and_keep_its_contract(monkeypatch):
    """Plain eager calls run the op's body directly (the dispatcher's host cost is several times a small
    kernel's GPU time); a dispatch mode, fake tensors or subclasses take the op. Both give the same bits, and
    the in-place backward bumps the version of the buffer it overwrites either way."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from lck_kernels._eager import plain_eager

    R = importlib.import_module("lck_kernels.rms_norm.ops")

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(5)
    x = torch.randn(7, 48, device=DEVICE, requires_grad=True)
    w = torch.randn(48, device=DEVICE, requires_grad=True)
    dy = torch.randn(7, 48, device=DEVICE)
    through_op = []
    op = R._rms_norm_fwd.op
    monkeypatch.setattr(R._rms_norm_fwd, "op", lambda *a: through_op.append(1) or op(*a))

    assert plain_eager((x, w))
    direct = torch.autograd.grad(rms_norm(x, w), (x, w), dy)
    assert through_op == []
    with Passthrough():
        assert not plain_eager((x, w))
        dispatched = torch.autograd.grad(rms_norm(x, w), (x, w), dy)
    assert through_op == [1]
    for a, b in zip(direct, dispatched):
        assert torch.equal(a, b)
    mode = FakeTensorMode()
    fake = mode.from_tensor(x.detach())
    assert not plain_eager((fake,)), "a fake tensor outside its mode still takes the op"
    with mode:
        assert not plain_eager((fake,))

    g = dy.clone()
    _, rstd = R._rms_norm_fwd(x.detach(), w.detach(), 1e-6, 0.0, "llama")
    before = g._version
    R._rms_norm_bwd_(g, x.detach(), w.detach(), rstd, 0.0, "llama")
    assert g._version > before, "the direct path must bump the version of the buffer it writes"
