"""The host path of every op stays cheap, checked without a GPU (issue 28).

Each op's eager forward+backward (through ``torch.autograd.grad``, as a training step runs it) is run with
the kernel launches stubbed out, and the Python-level calls made inside ``lck_kernels`` are counted against
a committed budget. Counting calls, not time, keeps the test exact on a shared CPU machine; counting only
our own frames keeps it independent of torch's version. A regression (a check done twice, a
configuration recomputed per call, the dispatcher taken in eager mode) shows up as more calls. Budgets are
today's counts plus a small margin: raise one only with a reason in the commit message.

On a GPU the same path also replaces Triton's generic launch with the compiled kernel's own launcher
(``_eager.Launch``); ``benchmarks/host_overhead.py`` times that against torch and Liger.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lck_kernels as L
from lck_kernels._common import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="counts the host path with launches stubbed under TRITON_INTERPRET=1"
)

PACKAGE = str(Path(L.__file__).resolve().parent)

# Python-level calls inside lck_kernels per eager forward+backward, launches stubbed (measured 2026-12-02:
# 33 / 41 / 32 / 46 / 56 / 97 / 98; counting torch's frames too, the eager fast path took RMSNorm from 184 to
# 97 calls, SwiGLU from 173 to 75, cross entropy from 173 to 79). RMSNorm 37 since its dweight sum became a
# third launch (replacing torch's sum and cast, which this count does not see). Cross entropy 51 since its
# sum/mean finalize became a launch (replacing torch's sum, division and fill, likewise unseen here).
BUDGET = {
    "rms_norm": 38,
    "swiglu": 45,
    "swiglu_packed": 35,
    "cross_entropy": 53,
    "cross_entropy_none": 62,
    "fused_linear_cross_entropy": 110,
    "fused_linear_scaled_cross_entropy": 110,
}


def _steps() -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    x = torch.randn(16, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    dy = torch.randn(16, 64)
    a, b = torch.randn(16, 64, requires_grad=True), torch.randn(16, 64, requires_grad=True)
    y = torch.randn(16, 128, requires_grad=True)
    logits = torch.randn(16, 100, requires_grad=True)
    t = torch.randint(0, 100, (16,))
    h = torch.randn(16, 32, requires_grad=True)
    proj = torch.randn(100, 32, requires_grad=True)
    g = torch.ones(16)
    return {
        "rms_norm": lambda: torch.autograd.grad(L.rms_norm(x, w), (x, w), dy),
        "swiglu": lambda: torch.autograd.grad(L.swiglu(a, b), (a, b), dy),
        "swiglu_packed": lambda: torch.autograd.grad(L.swiglu_packed(y), y, dy),
        "cross_entropy": lambda: torch.autograd.grad(L.cross_entropy(logits, t), logits),
        "cross_entropy_none": lambda: torch.autograd.grad(
            L.cross_entropy(logits, t, reduction="none"), logits, g
        ),
        "fused_linear_cross_entropy": lambda: torch.autograd.grad(
            L.fused_linear_cross_entropy(h, proj, t), (h, proj)
        ),
        "fused_linear_scaled_cross_entropy": lambda: torch.autograd.grad(
            L.fused_linear_scaled_cross_entropy(h, proj, t, reduction="mean")[0], (h, proj)
        ),
    }


def _calls_inside_package(fn: Callable[[], object]) -> Counter:
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            code = frame.f_code
            calls[f"{os.path.relpath(code.co_filename, PACKAGE)}:{code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.fixture
def stubbed_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(InterpretedFunction, "__getitem__", lambda self, grid: lambda *a, **k: None)


@pytest.mark.parametrize("op", sorted(BUDGET))
def test_host_calls_within_budget(op: str, stubbed_launches: None) -> None:
    step = _steps()[op]
    step()  # first call: configurations computed and cached, as at the first step of training
    calls = _calls_inside_package(step)
    total = sum(calls.values())
    detail = ", ".join(f"{k} x{v}" for k, v in calls.most_common(12))
    assert total <= BUDGET[op], (
        f"{op}: {total} Python calls inside lck_kernels (budget {BUDGET[op]}): {detail}"
    )


def test_eager_calls_skip_the_dispatcher(stubbed_launches: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain eager calls never enter the registered ops; the same call under a dispatch mode does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lck_kernels._eager import EagerOp

    entered: list[str] = []
    real = EagerOp.__call__

    def spy(self, *args, **kwargs):
        op = self.op
        self.op = lambda *a, **k: entered.append("op") or op(*a, **k)
        try:
            return real(self, *args, **kwargs)
        finally:
            self.op = op

    monkeypatch.setattr(EagerOp, "__call__", spy)
    step = _steps()["rms_norm"]
    step()
    norm = L.LckRMSNorm(64)  # a module's weight is an nn.Parameter: still a direct call
    x = torch.randn(4, 64, requires_grad=True)
    torch.autograd.grad(norm(x).sum(), (x, norm.weight))
    assert entered == []

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        step()
    assert entered, "under a dispatch mode the op (and its checks) must run"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pre-bound launcher runs on a CUDA device")
def test_prebound_launch_matches_generic_launch() -> None:
    """After the first call of each argument specialisation the kernel runs through its compiled handle; an
    input of another alignment (a view 2 bytes off) gets its own handle, and every call, first or later,
    matches a float64 reference."""
    from lck_kernels import _eager
    from lck_kernels.rms_norm.launch import _fwd_plan

    torch.manual_seed(0)
    rows, hidden = 64, 512
    aligned = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    misaligned = torch.empty(rows * hidden + 1, device="cuda", dtype=torch.bfloat16)[1:].view(rows, hidden)
    misaligned.copy_(aligned.detach())
    misaligned.requires_grad_(True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def reference(x):
        xf = x.detach().double().requires_grad_(True)
        wf = w.detach().double().requires_grad_(True)
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double() * wf
        return torch.autograd.grad(y, (xf, wf), dy.double())

    for x in (aligned, aligned, misaligned, misaligned, aligned):
        dx, dw = torch.autograd.grad(L.rms_norm(x, w), (x, w), dy)
        rx, rw = reference(x)
        torch.testing.assert_close(dx.double(), rx, atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(dw.double(), rw, atol=5e-1, rtol=5e-2)
    _, launch = _fwd_plan(rows, hidden, 2, 0)
    if _eager._FAST:
        assert len(launch._compiled) >= 2, "one compiled handle per alignment of x"
