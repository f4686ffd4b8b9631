"""fused_linear_scaled_cross_entropy (FLSCE): per-token NLL, lse and entropy of tempered logits vs float64.

Every output gets its own random upstream gradient (as an RL loss would: advantages on the log-probs, a
coefficient on the entropy, a z-loss on the lse). CPU: ``TRITON_INTERPRET=1``, float32, small shapes; the
``gpu`` parameters run 4096 tokens × 4096 → 128256 in bf16 on a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from _tolerances import assert_close, poison
from test_cross_entropy import assert_close_on_device
from test_fused_linear_cross_entropy import make_inputs, reference_linear

from lck_kernels._common import interpreting
from lck_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from lck_kernels.fused_linear_scaled_cross_entropy import (
    LckFusedLinearScaledCrossEntropy,
    fused_linear_scaled_cross_entropy,
)

DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.skipif(
    not interpreting() and not torch.cuda.is_available(),
    reason="Triton kernels need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors",
)
gpu = pytest.mark.gpu


@pytest.fixture
def poisoned(monkeypatch):
    """Every ``torch.empty`` in the test returns NaN-filled memory, so an element never written fails."""
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real(*a, **k)))


def check_against_reference(
    n, h, v, dtype, *, reduction, entropy, inverse_temperature, seed, bias=False, **kw
):
    x, w, b, t = make_inputs(n, h, v, dtype, seed=seed, bias=bias, ignore_every=5)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ba = b.clone().requires_grad_(True) if b is not None else None
    out = fused_linear_scaled_cross_entropy(
        xa,
        wa,
        t,
        bias=ba,
        inverse_temperature=inverse_temperature,
        return_entropy=entropy,
        reduction=reduction,
        **kw,
    )
    assert len(out) == (3 if entropy else 2)
    assert all(o.dtype == torch.float32 for o in out)
    assert out[0].shape == ((n,) if reduction == "none" else ()) and out[1].shape == (n,)
    gen = torch.Generator(DEVICE).manual_seed(seed + 100)
    grads = [torch.randn(o.shape, device=DEVICE, generator=gen) for o in out]
    torch.autograd.backward(list(out), grads)
    ref = reference_linear(
        x, w, t, b, reduction=reduction, g_loss=grads[0], g_lse=grads[1], g_entropy=grads[2] if entropy else None,
        inverse_temperature=inverse_temperature, mask_ignored_stats=True,
    )  # fmt: skip
    check = assert_close_on_device if n * v > 2**24 else assert_close
    # The outputs are float32 computed from logits in x's dtype: compare at x's dtype's tolerance.
    check(out[0], ref["loss"], dtype, name="nll")
    check(out[1], ref["lse"], dtype, name="lse")
    if entropy:
        check(out[2], ref["entropy"], dtype, name="entropy")
    check(xa.grad, ref["dx"], dtype, name="grad x")
    check(wa.grad, ref["dw"], dtype, name="grad weight", scale=2.0)
    if b is not None:
        check(ba.grad, ref["db"], dtype, name="grad bias", scale=2.0)


@pytest.mark.parametrize(
    ("reduction", "entropy", "inverse_temperature"),
    [
        ("none", True, 1.0),
        ("none", True, 1 / 0.7),
        ("none", False, 2.5),
        ("mean", True, 1.3),
        ("sum", False, 0.8),
    ],
    ids=str,
)
def test_matches_float64_reference(reduction, entropy, inverse_temperature, poisoned):
    check_against_reference(
        29, 16, 200, torch.float32, reduction=reduction, entropy=entropy, inverse_temperature=inverse_temperature,
        seed=1, max_chunk_tokens=8,
    )  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        (33, 16, 150, torch.float32, "none", True),  # bias, one chunk
        pytest.param((4096, 4096, 128256, torch.bfloat16, "none", True), marks=gpu, id="gpu-4096-entropy"),
        pytest.param((3000, 4096, 128256, torch.bfloat16, "mean", False), marks=gpu, id="gpu-3000-mean"),
        pytest.param((1024, 2048, 32000, torch.float16, "none", True), marks=gpu, id="gpu-fp16"),
    ],
    ids=str,
)
def test_real_sizes_match_float64_reference(case, poisoned):
    n, h, v, dtype, reduction, entropy = case
    check_against_reference(
        n,
        h,
        v,
        dtype,
        reduction=reduction,
        entropy=entropy,
        inverse_temperature=1 / 0.6,
        seed=2,
        bias=n < 100,
    )


def test_ignored_tokens_give_zeros_and_no_gradient():
    x, w, _, t = make_inputs(12, 8, 40, torch.float32, seed=3, ignore_every=0)
    t[[2, 7]] = -1
    xa = x.clone().requires_grad_(True)
    nll, lse, ent = fused_linear_scaled_cross_entropy(xa, w, t, return_entropy=True, ignore_index=-1)
    for name, out in (("nll", nll), ("lse", lse), ("entropy", ent)):
        assert torch.equal(out[[2, 7]], torch.zeros(2, device=DEVICE)), name
        assert (out[[0, 1, 3]] != 0).all(), name
    (nll.sum() + lse.sum() + ent.sum()).backward()
    assert torch.equal(xa.grad[[2, 7]], torch.zeros_like(xa.grad[[2, 7]]))
    assert xa.grad[[0, 1, 3]].abs().sum() > 0


def test_temperature_one_nll_is_fused_linear_cross_entropy():
    x, w, _, t = make_inputs(17, 8, 60, torch.float32, seed=4)
    grads = {}
    for name in ("scaled", "plain"):
        xa = x.clone().requires_grad_(True)
        if name == "scaled":
            nll, _ = fused_linear_scaled_cross_entropy(xa, w, t, max_chunk_tokens=4)
        else:
            nll = fused_linear_cross_entropy(xa, w, t, reduction="none", max_chunk_tokens=4)
        nll.sum().backward()
        grads[name] = (nll.detach(), xa.grad)
    torch.testing.assert_close(grads["scaled"][0], grads["plain"][0])
    torch.testing.assert_close(grads["scaled"][1], grads["plain"][1])


def test_no_grad_and_leading_dimensions():
    x, w, _, t = make_inputs(12, 8, 30, torch.float32, seed=5)
    x3, t3 = x.view(2, 6, 8), t.view(2, 6)
    with torch.no_grad():
        nll, lse, ent = fused_linear_scaled_cross_entropy(
            x3.requires_grad_(True), w, t3, inverse_temperature=2.0, return_entropy=True
        )
    assert nll.shape == lse.shape == ent.shape == (2, 6) and nll.grad_fn is None
    ref = reference_linear(
        x,
        w,
        t,
        reduction="none",
        g_loss=torch.ones(12, device=DEVICE),
        inverse_temperature=2.0,
        mask_ignored_stats=True,
    )
    assert_close(nll.reshape(-1), ref["loss"], torch.float32, name="nll")
    assert_close(ent.reshape(-1), ref["entropy"], torch.float32, name="entropy")


def _bad_calls():
    x, w, _, t = make_inputs(4, 8, 10, torch.float32, seed=6)
    f = fused_linear_scaled_cross_entropy
    return [
        ("x", TypeError, lambda: f(x.long(), w, t)),
        ("weight", TypeError, lambda: f(x.half(), w, t)),
        ("weight", ValueError, lambda: f(x, w[:, :4], t)),
        ("target", ValueError, lambda: f(x, w, t[:2])),
        ("bias", ValueError, lambda: f(x, w, t, bias=torch.randn(9, device=DEVICE))),
        ("inverse_temperature", ValueError, lambda: f(x, w, t, inverse_temperature=0.0)),
        ("inverse_temperature", ValueError, lambda: f(x, w, t, inverse_temperature=float("inf"))),
        ("inverse_temperature", TypeError, lambda: f(x, w, t, inverse_temperature=None)),
        ("return_entropy", TypeError, lambda: f(x, w, t, return_entropy="yes")),
        ("reduction", ValueError, lambda: f(x, w, t, reduction="token_mean")),
        ("ignore_index", TypeError, lambda: f(x, w, t, ignore_index=None)),
        ("chunk_bytes", ValueError, lambda: f(x, w, t, chunk_bytes=-1)),
    ]


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_bad_input_names_the_argument(i):
    name, exc, call = _bad_calls()[i]
    with pytest.raises(exc, match=rf"fused_linear_scaled_cross_entropy: {name}\b"):
        call()


def test_module():
    x, w, _, t = make_inputs(9, 8, 20, torch.float32, seed=7)
    mod = LckFusedLinearScaledCrossEntropy(inverse_temperature=1.5, return_entropy=True)
    assert "inverse_temperature=1.5" in repr(mod)
    nll, lse, ent = mod(x, w, t)
    assert nll.shape == lse.shape == ent.shape == (9,)
    ref = reference_linear(
        x,
        w,
        t,
        reduction="none",
        g_loss=torch.ones(9, device=DEVICE),
        inverse_temperature=1.5,
        mask_ignored_stats=True,
    )
    assert_close(lse, ref["lse"], torch.float32, name="lse")
    with pytest.raises(ValueError, match="LckFusedLinearScaledCrossEntropy: inverse_temperature"):
        LckFusedLinearScaledCrossEntropy(inverse_temperature=-1.0)


COMPILE_BACKENDS = [
    pytest.param(
        "aot_eager", marks=pytest.mark.skipif(not interpreting(), reason="CPU variant"), id="aot_eager"
    ),
    pytest.param("inductor", marks=gpu, id="gpu-inductor"),
]


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_fullgraph(backend):
    """An RL-style objective: advantage-weighted log-probs, an entropy bonus and a small z-loss."""
    torch._dynamo.reset()
    n, h, v = (16, 8, 40) if interpreting() else (2048, 4096, 128256)
    dtype = torch.float32 if interpreting() else torch.bfloat16
    x, w, _, t = make_inputs(n, h, v, dtype, seed=8)
    adv = torch.randn(n, device=DEVICE)
    x.requires_grad_(True)
    w.requires_grad_(True)

    def step(hidden, weight):
        nll, lse, ent = fused_linear_scaled_cross_entropy(
            hidden, weight, t, inverse_temperature=1.25, return_entropy=True
        )
        return (adv * nll).mean() - 0.01 * ent.mean() + 1e-4 * (lse**2).mean()

    eager = step(x, w)
    eager_grads = torch.autograd.grad(eager, (x, w))
    compiled = torch.compile(step, fullgraph=True, backend=backend)  # any graph break is an error
    got = compiled(x, w)
    got_grads = torch.autograd.grad(got, (x, w))
    check = assert_close if interpreting() else assert_close_on_device
    check(got, eager, torch.float32, name="objective")
    check(got_grads[0], eager_grads[0], dtype, name="grad x")
    check(got_grads[1], eager_grads[1], dtype, name="grad weight")
