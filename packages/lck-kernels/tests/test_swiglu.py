"""Two-tensor SwiGLU ``silu(a) * b`` and ``LckSwiGLUMLP`` against float64 references, layouts, errors, opcheck,
compile. CPU runs use ``TRITON_INTERPRET=1`` at small sizes; ``gpu`` parameters run at real sizes.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from _device import COMPILE_BACKENDS, DEVICE, DTYPES, gpu, needs_triton_device
from _errors import bad_input_test
from _tolerances import assert_close

from lck_kernels import LckSwiGLUMLP, swiglu
from lck_kernels._common import interpreting, tuning
from lck_kernels.swiglu.launch import elementwise_config

pytestmark = needs_triton_device


def check(a, b, dc):
    """Forward and backward of ``swiglu(a, b)`` against float64 autograd of ``silu(a) * b``."""
    dtype = a.dtype
    a, b = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
    c = swiglu(a, b)
    assert c.shape == a.shape and c.dtype == dtype and c.is_contiguous()
    da, db = torch.autograd.grad(c, (a, b), dc)
    a64, b64 = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    ref = F.silu(a64) * b64
    da64, db64 = torch.autograd.grad(ref, (a64, b64), dc.double())
    assert_close(c, ref, dtype, name="c")
    assert_close(da, da64, dtype, name="da")
    assert_close(db, db64, dtype, name="db")


CPU_SHAPES = [(1, 1), (7, 33), (2, 3, 64), (3, 5120), (1, 4099)]
GPU_SHAPES = [(8192, 4096), (2048, 4, 4096), (1, 5120), (333, 11008), (512, 32768)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [*CPU_SHAPES, *(pytest.param(s, marks=gpu, id=f"gpu-{s}") for s in GPU_SHAPES)], ids=str
)
def test_matches_float64_reference(shape, dtype, poisoned):
    torch.manual_seed(zlib.crc32(repr((shape, str(dtype))).encode()))
    a = torch.randn(shape, device=DEVICE, dtype=dtype) * 3
    b = torch.randn(shape, device=DEVICE, dtype=dtype)
    check(a, b, torch.randn(shape, device=DEVICE, dtype=dtype))


@pytest.mark.parametrize(
    "shape", [(5, 2, 48), pytest.param((2048, 4, 2 * 4096), marks=gpu, id="gpu")], ids=str
)
def test_chunked_halves_are_read_in_place(shape, poisoned):
    """``torch.chunk`` of a packed buffer gives views with row stride 2n: accepted without a copy."""
    torch.manual_seed(5)
    y = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    a, b = y.chunk(2, dim=-1)
    assert not a.is_contiguous()
    check(a, b, torch.randn(a.shape, device=DEVICE, dtype=torch.bfloat16))


def test_non_contiguous_gradient():
    torch.manual_seed(6)
    a = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    swiglu(a, b).sum().backward()  # the gradient of sum() is an expanded (stride-0) tensor
    a64, b64 = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    (F.silu(a64) * b64).sum().backward()
    assert_close(a.grad, a64.grad, torch.float32, name="da")
    assert_close(b.grad, b64.grad, torch.float32, name="db")


def test_zero_rows():
    a = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    b = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    c = swiglu(a, b)
    assert c.shape == (0, 8)
    da, db = torch.autograd.grad(c, (a, b), torch.randn_like(c))
    assert da.shape == db.shape == (0, 8)


def _bad_calls(device):
    """(argument named in the error, exception type, call); ``device`` is the kernel device (meta to count)."""
    a = torch.randn(4, 8, device=device)
    return [
        ("a", TypeError, lambda: swiglu(a.tolist(), a)),
        ("a", TypeError, lambda: swiglu(a.to(torch.int32), a.to(torch.int32))),
        ("b", TypeError, lambda: swiglu(a, a.to(torch.float16))),
        ("a", ValueError, lambda: swiglu(a.to("meta"), a.to("meta"))),
        ("b", ValueError, lambda: swiglu(a, a.to("meta"))),
        ("a", ValueError, lambda: swiglu(a, a[:, :4])),
        ("a", ValueError, lambda: swiglu(a.t(), a.t())),
        ("b", ValueError, lambda: swiglu(a[:, :4], torch.randn(4, 4, device=device).t())),
        ("a", ValueError, lambda: swiglu(torch.randn(4, 0, device=device), torch.randn(4, 0, device=device))),
        ("a", ValueError, lambda: swiglu(torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))),
    ]


test_bad_input_names_the_argument = bad_input_test("swiglu", _bad_calls, count_on="meta")


@pytest.mark.parametrize("n_cols", [1, 3, 64, 1000, 4096, 5120, 32768])
@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("kernel", ["swiglu_fwd", "swiglu_bwd"])
def test_elementwise_config(kernel, n_cols, element_size):
    cfg = elementwise_config(kernel, n_cols, element_size)
    bm, bn, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]
    assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0 and warps & (warps - 1) == 0
    assert bn >= min(n_cols, 1024), "a tile covers a whole row or at least 1024 columns"
    # Whole 16-byte vectors per thread, hence no element held by two threads (the in-place backward needs that).
    assert warps * 32 * (16 // element_size) <= bm * bn
    with tuning(kernel, BLOCK_M=1, BLOCK_N=64, num_warps=1):
        assert elementwise_config(kernel, n_cols, element_size) == {
            "BLOCK_M": 1,
            "BLOCK_N": 64,
            "num_warps": 1,
        }
    with pytest.raises(ValueError, match="too many"), tuning(kernel, BLOCK_M=1, BLOCK_N=64, num_warps=4):
        elementwise_config(kernel, n_cols, element_size)


def test_small_tiles_match_reference(poisoned):
    """Several column tiles per row and several rows per tile, with ragged edges in both directions."""
    torch.manual_seed(8)
    with (
        tuning("swiglu_fwd", BLOCK_M=4, BLOCK_N=16, num_warps=1),
        tuning("swiglu_bwd", BLOCK_M=2, BLOCK_N=32, num_warps=1),
    ):
        a, b, dc = (torch.randn(11, 70, device=DEVICE) for _ in range(3))
        check(a, b, dc)


@pytest.mark.parametrize(
    "shape", [(5, 24), (2, 3, 24), pytest.param((4096, 4096), marks=gpu, id="gpu")], ids=str
)
def test_opcheck(shape):
    a, b, dc = (torch.randn(shape, device=DEVICE) for _ in range(3))
    torch.library.opcheck(torch.ops.lck.swiglu_fwd.default, (a, b))
    torch.library.opcheck(torch.ops.lck.swiglu_bwd.default, (a, b, dc))


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    torch.manual_seed(9)
    hidden, inter = (32, 80) if interpreting() else (1024, 2816)
    mlp = LckSwiGLUMLP(hidden, inter, device=DEVICE)
    x = torch.randn(2, 5, hidden, device=DEVICE, requires_grad=True)

    def step(x):
        return mlp(x).square().mean()

    loss = step(x)
    eager = torch.autograd.grad(loss, (x, *mlp.parameters()))
    compiled = torch.compile(step, fullgraph=True, backend=backend)  # any graph break is an error
    loss_c = compiled(x)
    got = torch.autograd.grad(loss_c, (x, *mlp.parameters()))
    # Inductor may pick different GEMM algorithms than eager: a little slack for fp32 accumulation order.
    assert_close(loss_c, loss, torch.float32, name="loss", scale=10.0)
    for g, e in zip(got, eager):
        assert_close(g, e, torch.float32, name="grad", scale=10.0)
