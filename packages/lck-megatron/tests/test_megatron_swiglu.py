"""LckMegatronSwiGLU: numerics against float64, the fallback policy, validation and the in-place guard.

CPU runs use Triton's interpreter (``TRITON_INTERPRET=1``) at small sizes; the ``gpu`` variants run the
same checks on CUDA at Megatron's real activation sizes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _helpers import assert_close, kernel_device, swiglu_ref

from lck_megatron.swiglu import LckMegatronSwiGLU

DTYPES = [torch.float32, torch.bfloat16]


def reference_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """A plain-torch stand-in with bias_swiglu_impl's signature, recording each call."""
    reference_impl.calls.append((bias is not None, fp8_input_store, cpu_offload_input))
    y = input if bias is None else input + bias
    a, b = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


reference_impl.calls = []


def _check_fwd_bwd(module: LckMegatronSwiGLU, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    y = x * 1.0  # a non-leaf activation buffer, like linear_fc1's output
    out = module(y, None, False, False)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    dout = torch.randn_like(out)
    xd = x.detach().double().requires_grad_(True)
    ref = swiglu_ref(xd)
    (ref * dout.double()).sum().backward()
    assert_close(out, ref, dtype, name="swiglu forward")
    out.backward(dout)
    assert_close(x.grad, xd.grad, dtype, name="swiglu input gradient")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 2 * 24), (5, 3, 2 * 40)], ids=["2d", "3d"])
@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
def test_forward_backward_matches_float64(shape, dtype, in_place) -> None:
    module = LckMegatronSwiGLU(fallback_impl=None, in_place=in_place)
    _check_fwd_bwd(module, shape, dtype, kernel_device())
    assert module.calls == {"lck": 1, "fallback": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ffn", [4096, 8192 + 64], ids=["4096", "odd"])
def test_forward_backward_matches_float64_cuda(ffn, dtype) -> None:
    # Megatron's [s, b, 2·ffn_local] layout at a real sequence length.
    for in_place in (False, True):
        module = LckMegatronSwiGLU(fallback_impl=None, in_place=in_place)
        _check_fwd_bwd(module, (1024, 2, 2 * ffn), dtype, torch.device("cuda"))


def test_in_place_writes_the_gradient_into_the_activation_buffer() -> None:
    device = kernel_device()
    x = torch.randn(6, 2, 32, device=device, requires_grad=True)
    y = x * 1.0
    ptr = y.data_ptr()
    out = LckMegatronSwiGLU(fallback_impl=None, in_place=True)(y, None, False, False)
    out.backward(torch.randn_like(out))
    # dY landed in linear_fc1's output buffer: no new [.., 2n] allocation in backward.
    assert y.data_ptr() == ptr
    torch.testing.assert_close(y.detach(), x.grad)


def test_in_place_second_backward_raises() -> None:
    device = kernel_device()
    x = torch.randn(4, 16, device=device, requires_grad=True)
    out = LckMegatronSwiGLU(fallback_impl=None, in_place=True)(x * 1.0, None, False, False)
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_copy_mode_allows_second_backward() -> None:
    device = kernel_device()
    x = torch.randn(4, 16, device=device, requires_grad=True)
    out = LckMegatronSwiGLU(fallback_impl=None)(x * 1.0, None, False, False)
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    g1 = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * g1)


@pytest.mark.parametrize(
    ("arg", "call"),
    [
        (
            "bias",
            lambda m, y: m(
                y, torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype, device=y.device), False, False
            ),
        ),
        ("fp8_input_store", lambda m, y: m(y, None, True, False)),
        ("cpu_offload_input", lambda m, y: m(y, None, False, True)),
    ],
    ids=["bias", "fp8_input_store", "cpu_offload_input"],
)
def test_fallback_policy(arg, call, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lck_megatron")
    y = torch.randn(4, 3, 16, device=kernel_device())
    module = LckMegatronSwiGLU(fallback_impl=reference_impl)
    reference_impl.calls.clear()
    out1 = call(module, y)
    out2 = call(module, y)
    assert len(reference_impl.calls) == 2, "the fallback must receive every such call"
    assert module.calls == {"lck": 0, "fallback": 2}
    torch.testing.assert_close(out1, out2)
    logged = [r.getMessage() for r in caplog.records if arg in r.getMessage()]
    assert len(logged) == 1, f"expected one log line for {arg}, got {logged}"
    # The same call without a fallback is refused with an error that names the argument.
    strict = LckMegatronSwiGLU(fallback_impl=None)
    with pytest.raises(ValueError, match=arg):
        call(strict, y)


def test_extra_arguments_of_newer_versions() -> None:
    def newer_impl(input, bias, fp8_input_store=False, cpu_offload_input=False, clamp_value=None):
        newer_impl.calls += 1
        return reference_impl(input, bias)

    newer_impl.calls = 0
    device = kernel_device()
    y = torch.randn(4, 16, device=device)
    module = LckMegatronSwiGLU(fallback_impl=newer_impl)
    module(y, None, False, False, None)  # positional, at its default: lck runs it
    module(y, None, False, False, clamp_value=None)
    assert module.calls == {"lck": 2, "fallback": 0}
    module(y, None, False, False, clamp_value=7.0)  # a behaviour lck lacks: Megatron runs it
    assert module.calls["fallback"] == 1 and newer_impl.calls == 1
    with pytest.raises(TypeError, match="unexpected_kw"):
        module(y, None, False, False, unexpected_kw=1)
    with pytest.raises(TypeError, match="positional"):
        module(y, None, False, False, None, 1)


def test_cpu_without_interpreter_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module = LckMegatronSwiGLU(fallback_impl=reference_impl)
    y = torch.randn(4, 16)
    torch.testing.assert_close(module(y, None, False, False), reference_impl(y, None))
    assert module.calls == {"lck": 0, "fallback": 1}
    assert any("TRITON_INTERPRET" in r for r in module.fallback_reasons)
    with pytest.raises(ValueError, match="input"):
        LckMegatronSwiGLU(fallback_impl=None)(y, None, False, False)


def test_validation_names_the_argument() -> None:
    m = LckMegatronSwiGLU(fallback_impl=None)
    with pytest.raises(ValueError, match=r"last dimension.*even"):
        m(torch.randn(4, 15), None, False, False)
    with pytest.raises(ValueError, match=r"2-D .* or 3-D"):
        m(torch.randn(2, 2, 2, 16), None, False, False)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        m(torch.ones(4, 16, dtype=torch.int32), None, False, False)
    with pytest.raises(TypeError, match=r"input must be a torch\.Tensor"):
        m([1.0, 2.0], None, False, False)
    with pytest.raises(TypeError, match="bias"):
        m(torch.randn(4, 16), 3.0, False, False)
    with pytest.raises(TypeError, match="in_place"):
        LckMegatronSwiGLU(fallback_impl=None, in_place="yes")
    with pytest.raises(TypeError, match="fallback_impl"):
        LckMegatronSwiGLU(fallback_impl=42)


def test_non_contiguous_input_is_copied() -> None:
    device = kernel_device()
    base = torch.randn(8, 40, device=device)
    y = base[:, :32]  # row stride 40: not Megatron's layout, but accepted
    out = LckMegatronSwiGLU(fallback_impl=None)(y, None, False, False)
    assert_close(out, swiglu_ref(y), torch.float32, name="non-contiguous forward")


@pytest.mark.megatron
def test_default_fallback_is_megatrons_original_even_when_patched() -> None:
    from megatron.core.fusions import fused_bias_swiglu

    from lck_megatron import apply_lck_to_megatron

    original = fused_bias_swiglu.bias_swiglu_impl
    assert LckMegatronSwiGLU().fallback_impl is original
    apply_lck_to_megatron(rms_norm=False, swiglu=True)
    assert LckMegatronSwiGLU().fallback_impl is original
    # A module given another LckMegatronSwiGLU as fallback never calls back into lck.
    assert LckMegatronSwiGLU(fallback_impl=fused_bias_swiglu.bias_swiglu_impl).fallback_impl is original


@pytest.mark.megatron
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_falls_back_to_megatron_with_megatrons_numerics(dtype) -> None:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    device = kernel_device()
    y = torch.randn(5, 2, 32, dtype=dtype, device=device, requires_grad=True)
    bias = torch.randn(32, dtype=dtype, device=device, requires_grad=True)
    module = LckMegatronSwiGLU()
    out = module(y, bias, False, False)
    assert module.calls["fallback"] == 1
    ref = bias_swiglu_impl(y.detach(), bias.detach(), False, False)
    torch.testing.assert_close(out.detach(), ref)
    assert_close(out, swiglu_ref(y.double() + bias.double()), dtype, name="bias fallback")


def test_deepcopy_and_pickle_keep_the_module_working() -> None:
    import copy
    import io

    device = kernel_device()
    module = LckMegatronSwiGLU(fallback_impl=reference_impl, in_place=True)
    module(torch.randn(4, 16, device=device), torch.ones(16, device=device), False, False)  # log a reason
    for clone in (copy.deepcopy(module), _pickled(module, io)):
        assert clone.in_place is True and clone.fallback_impl is reference_impl
        assert clone.fallback_reasons == module.fallback_reasons
        y = torch.randn(4, 16, device=device)
        assert_close(clone(y, None, False, False), swiglu_ref(y), torch.float32, name="copied module")


def _pickled(module, io):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
