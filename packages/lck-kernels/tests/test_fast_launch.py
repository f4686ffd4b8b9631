"""The eager fast path launches through the compiled kernel's own launcher, not Triton's generic path.

Triton 3.6 keeps each launch hook as a chain object that is never None; the fast path once read that as "a
profiler is attached" and sent every launch down Triton's generic ``JITFunction.run`` (issue 28). The CPU
test pins the hook check; the GPU test counts generic launches in repeated eager calls of every op family.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.jit import JITFunction

import lck_kernels as L
from lck_kernels import _eager


class _Chain:  # the shape of Triton's HookChain: a list of calls, empty when nothing is hooked
    def __init__(self, *calls):
        self.calls = list(calls)


def test_an_empty_hook_chain_is_no_hook():
    assert not _eager._hook_set(None)
    assert not _eager._hook_set(_Chain())
    assert _eager._hook_set(_Chain(print))
    assert _eager._hook_set(print)  # older Triton: a plain callable
    try:
        from triton.knobs import HookChain
    except ImportError:  # a Triton whose hooks are plain attributes
        return
    chain = HookChain()
    assert not _eager._hook_set(chain)
    chain.add(print)
    assert _eager._hook_set(chain)


def test_a_tma_descriptor_is_keyed_by_dtype_block_and_dims():
    """Host TMA descriptors (lck-ep's grouped GEMMs) share a compiled launcher only where Triton would."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def key(t, block):
        return _eager._specialisation((TensorDescriptor.from_tensor(t, block), 3))

    a = torch.empty(64, 32, dtype=torch.bfloat16)
    assert key(a, [16, 16]) == key(torch.empty(128, 32, dtype=torch.bfloat16), [16, 16])
    assert key(a, [16, 16]) != key(a.half(), [16, 16])
    assert key(a, [16, 16]) != key(a, [32, 16])
    assert key(a, [16, 16]) != key(torch.empty(72, 32, dtype=torch.bfloat16), [16, 16])  # rows not % 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled launcher needs a CUDA device")
def test_repeated_eager_calls_take_no_generic_launch(monkeypatch):
    assert _eager._FAST, "the fast launch path is off on this GPU (see _eager._fast_launch_available)"
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(256, 512, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(512, device=dev, dtype=bf, requires_grad=True)
    a = torch.randn(256, 512, device=dev, dtype=bf, requires_grad=True)
    b = torch.randn(256, 512, device=dev, dtype=bf, requires_grad=True)
    logits = torch.randn(256, 1000, device=dev, dtype=bf, requires_grad=True)
    target = torch.randint(0, 1000, (256,), device=dev)
    proj = torch.randn(1000, 512, device=dev, dtype=bf, requires_grad=True)
    steps = {
        "rms_norm": lambda: torch.autograd.grad(L.rms_norm(x, w).float().sum(), (x, w)),
        "swiglu": lambda: torch.autograd.grad(L.swiglu(a, b).float().sum(), (a, b)),
        "cross_entropy": lambda: torch.autograd.grad(L.cross_entropy(logits, target), (logits,)),
        "fused_linear_cross_entropy": lambda: torch.autograd.grad(
            L.fused_linear_cross_entropy(x, proj, target), (x, proj)
        ),
    }
    for step in steps.values():  # first calls compile and remember each launcher
        step()
    generic = []
    real_run = JITFunction.run

    def counting(self, *args, **kwargs):
        generic.append(getattr(self, "__name__", repr(self)))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counting)
    for name, step in steps.items():
        generic.clear()
        step()
        assert generic == [], f"{name}: eager forward+backward took Triton's generic launch for {generic}"
    torch.cuda.synchronize()
