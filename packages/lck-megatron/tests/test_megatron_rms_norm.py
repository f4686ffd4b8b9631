"""LckMegatronRMSNorm and the LckWrappedTorchNorm factory Megatron's norm slots receive."""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_close, kernel_device

from lck_megatron.rms_norm import LckMegatronRMSNorm, LckWrappedTorchNorm


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch.nn.RMSNorm's numerics in float64: normalise, round to the input dtype, scale by the weight."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(dtype).double() * w.double()


def _check(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    hidden = shape[-1]
    norm = LckMegatronRMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5 + 1.0)
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    y = norm(x)
    assert norm.calls == {"lck": 1, "torch": 0}, norm.calls
    assert y.shape == x.shape and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    ref.backward(dy.double())
    assert_close(y, _rms_ref(x.detach(), norm.weight.detach(), 1e-5, dtype), dtype, name="rms_norm forward")
    assert_close(x.grad, x64.grad, dtype, name="rms_norm input gradient")
    # The weight gradient sums over every row (float32 partials in lck): loosened for the long reduction.
    assert_close(norm.weight.grad, w64.grad, dtype, name="rms_norm weight gradient", scale=4.0)
    # Same numbers as the torch module it replaces (to the dtype's tolerance).
    stock = torch.nn.RMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    stock.load_state_dict(norm.state_dict())
    assert_close(y, stock(x.detach()), dtype, name="lck vs torch.nn.RMSNorm", scale=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(9, 40), (5, 2, 64)], ids=["2d", "3d"])
def test_matches_float64_and_torch(shape, dtype) -> None:
    _check(shape, dtype, kernel_device())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(4096, 4096), (2048, 4, 5120)], ids=["2d", "3d"])
def test_matches_float64_and_torch_cuda(shape, dtype) -> None:
    _check(shape, dtype, torch.device("cuda"))


def test_state_dict_is_torch_rmsnorms() -> None:
    norm = LckMegatronRMSNorm(16, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert list(norm.state_dict()) == list(torch.nn.RMSNorm(16).state_dict()) == ["weight"]
    assert norm.tensor_model_parallel is False  # read by Megatron's FSDP adapter: replicated


def test_cases_the_kernel_does_not_take_run_torch() -> None:
    x = torch.randn(4, 8)
    no_affine = LckMegatronRMSNorm(8, elementwise_affine=False)
    torch.testing.assert_close(no_affine(x), torch.nn.RMSNorm(8, elementwise_affine=False)(x))
    assert no_affine.calls == {"lck": 0, "torch": 1}
    assert any("elementwise_affine" in r for r in no_affine._log.seen)
    mixed = LckMegatronRMSNorm(8)  # fp32 weight, bf16 input: whatever torch does, exactly
    torch.testing.assert_close(mixed(x.bfloat16()), torch.nn.RMSNorm(8)(x.bfloat16()))
    assert mixed.calls == {"lck": 0, "torch": 1}


def test_validation() -> None:
    norm = LckMegatronRMSNorm(8)
    with pytest.raises(ValueError, match="trailing"):
        norm(torch.randn(4, 7))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        norm([1.0] * 8)


def test_cpu_without_interpreter_runs_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    norm = LckMegatronRMSNorm(8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(8)(x))
    assert norm.calls == {"lck": 0, "torch": 1}


@pytest.mark.megatron
def test_factory_builds_lck_for_rmsnorm_and_megatrons_otherwise() -> None:
    from _helpers import transformer_config

    made = LckWrappedTorchNorm(config=transformer_config(), hidden_size=32, eps=1e-5)
    assert type(made) is LckMegatronRMSNorm and made.eps == 1e-5 and made.normalized_shape == (32,)
    positional = LckWrappedTorchNorm(transformer_config(), 24)
    assert type(positional) is LckMegatronRMSNorm and positional.normalized_shape == (24,)
    ln = LckWrappedTorchNorm(config=transformer_config(normalization="LayerNorm"), hidden_size=32)
    assert type(ln) is torch.nn.LayerNorm
    # Options torch norms reject are rejected exactly as Megatron's factory rejects them.
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        LckWrappedTorchNorm(config=transformer_config(layernorm_zero_centered_gamma=True), hidden_size=32)
    with pytest.raises(TypeError):
        LckWrappedTorchNorm(transformer_config(), 32, 1e-5, bogus_argument=1)
    with pytest.raises(ValueError, match="hidden_size"):
        LckWrappedTorchNorm(config=transformer_config(), hidden_size=0)


def test_deepcopy_and_torch_save_of_a_model_with_lck_norms() -> None:
    import copy
    import io

    device = kernel_device()
    model = torch.nn.Sequential(LckMegatronRMSNorm(16), torch.nn.Linear(16, 4)).to(device)
    x = torch.randn(3, 16, device=device)
    want = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert type(clone[0]) is LckMegatronRMSNorm
        torch.testing.assert_close(clone(x), want)
        assert clone[0].calls["lck"] >= 1
