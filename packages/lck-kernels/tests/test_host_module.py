"""The C++ host path (``lck_kernels._host``): the same numbers as the Python ops, launched from C++.

On a GPU: ``rms_norm`` (which takes the C++ backward node in plain eager calls) against the Python
``RMSNormFunction`` on the same inputs, bit for bit, forward and both gradients, over the launch plans
(whole rows with and without look-ahead, tiled rows, float32), casting modes, in-place backward, a 3-D input,
a weight without gradient and zero rows; the launches counted as made from C++. On CPU: the variant
description the launcher relies on, from a stand-in compiled kernel, and the routing rules.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _device import gpu

import lck_kernels as L
from lck_kernels import _host
from lck_kernels.rms_norm.ops import RMSNormFunction

CUDA = torch.cuda.is_available()


def _describe_case(signature: dict, **md):
    meta = {
        "num_ctas": 1,
        "shared": 1024,
        "num_warps": 4,
        "global_scratch_size": 0,
        "profile_scratch_size": 0,
    }
    meta.update(md)
    compiled = SimpleNamespace(
        metadata=SimpleNamespace(**meta), src=SimpleNamespace(signature=signature), function=77
    )
    launch = SimpleNamespace(fn=SimpleNamespace(arg_names=list(signature)))
    return compiled, launch


def test_describe_maps_triton_signature_to_parameter_codes() -> None:
    sig = {"x": "*bf16", "n": "i32", "one": "constexpr", "big": "i64", "eps": "fp32", "BLOCK": "constexpr"}
    compiled, launch = _describe_case(sig)
    args = (torch.empty(1), 5, 1, 1 << 40, 0.5)
    assert _host._describe(compiled, launch, args) == (77, 128, 1024, 2, bytes([1, 2, 0, 3, 4]))


@pytest.mark.parametrize(
    "md",
    [{"num_ctas": 2}, {"global_scratch_size": 64}, {"profile_scratch_size": 8}, {"launch_pdl": True}],
    ids=["cluster", "global-scratch", "profile-scratch", "pdl"],
)
def test_describe_refuses_what_only_triton_can_launch(md: dict) -> None:
    compiled, launch = _describe_case({"x": "*fp32", "n": "i32"}, **md)
    assert _host._describe(compiled, launch, (torch.empty(1), 3)) is None


def test_describe_refuses_a_type_mismatch() -> None:
    compiled, launch = _describe_case({"x": "*fp32", "n": "i32"})
    assert (
        _host._describe(compiled, launch, (torch.empty(1), 3.0)) is None
    )  # a float where Triton took an int
    compiled, launch = _describe_case({"x": "nvTmaDesc", "n": "i32"})
    assert _host._describe(compiled, launch, (torch.empty(1), 3)) is None


def test_cpu_tensors_never_take_the_host_path() -> None:
    assert _host.ready(torch.empty(2, 2), torch.empty(2)) is None


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LCK_KERNELS_HOST", "0")
    assert not _host.enabled()


def _pair(shape, dtype, casting, in_place, weight_grad, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)).to(dtype)
    dy = torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    outs = []
    for use_host in (True, False):
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(weight_grad)
        if use_host:
            y = L.rms_norm(xi, wi, 1e-6, 0.0, casting, in_place)
            if xi.numel():  # empty inputs take the Python path
                assert y.grad_fn.name() == "lck_host::RMSNormBackward", y.grad_fn.name()
        else:
            y = RMSNormFunction.apply(xi, wi, 1e-6, 0.0, casting, in_place)
        inputs = (xi, wi) if weight_grad else (xi,)
        grads = torch.autograd.grad(y, inputs, dy.clone())
        outs.append((y, *grads))
    return outs


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((4096, 4096), torch.bfloat16),  # look-ahead row kernel
        ((2048, 8192), torch.bfloat16),
        ((333, 1000), torch.float16),  # several rows per program
        ((64, 20480), torch.bfloat16),  # tiled rows: dot + tiled kernels
        ((257, 4096), torch.float32),
        ((2, 3, 640), torch.bfloat16),  # a 3-D input
        ((0, 512), torch.bfloat16),  # no rows
    ],
)
@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
def test_host_rms_norm_equals_python_function_bit_for_bit(shape, dtype, casting) -> None:
    before = _host.launch_counts()
    for in_place, weight_grad in ((False, True), (True, True), (False, False)):
        host, python = _pair(shape, dtype, casting, in_place, weight_grad, seed=sum(shape) + len(casting))
        for a, b in zip(host, python):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
    if shape[0] > 0:
        assert _host.module() is not None, "the host module did not build"
        assert _host.launch_counts()[0] > before[0], "no launch went through C++"
        # Every variant is known now: the same calls again never go back to Python.
        python_before = _host.launch_counts()[1]
        _pair(shape, dtype, casting, False, True, seed=1)
        assert _host.launch_counts()[1] == python_before, "a known variant was launched through Python"


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_arguments_the_host_path_refuses_still_raise_the_python_errors() -> None:
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="eps"):
        L.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="casting_mode"):
        L.rms_norm(x, w, casting_mode="bogus")
    with pytest.raises(TypeError, match="in_place"):
        L.rms_norm(x, w, in_place=1)
    with pytest.raises(ValueError, match="weight"):
        L.rms_norm(x, torch.ones(32, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        L.rms_norm(x.to(torch.int32), w)
    y = L.rms_norm(x[:, :32], w[:32])  # a column slice takes the host path and matches a contiguous copy
    assert torch.equal(y, L.rms_norm(x[:, :32].contiguous(), w[:32]))
