"""fused_linear_cross_entropy against a float64 reference (plain torch), chunking, memory, errors, ops, compile.

On CPU these run under ``TRITON_INTERPRET=1`` at small sizes in float32 (the GEMMs are torch's; the row
kernels run in the interpreter); the ``gpu`` parameters run 4096–5000 tokens × 4096 → 128256 in bf16 on a
CUDA device, where the float64 reference is built chunk by chunk on the device.
"""

from __future__ import annotations

import pytest
import torch
from _device import COMPILE_BACKENDS, DEVICE, gpu, needs_triton_device
from _errors import bad_input_test
from _tolerances import assert_close
from test_cross_entropy import assert_close_on_device, reduction_scales, reference_rows

from lck_kernels._common import interpreting, tuning
from lck_kernels.linear_cross_entropy import (
    CHUNK_ALIGN,
    DEFAULT_CHUNK_BYTES,
    LckFusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
    plan_chunk_tokens,
)

pytestmark = needs_triton_device


# ---------------------------------------------------------------------------------------------------------
# float64 reference, chunked over tokens (also used by the scaled op's tests)
# ---------------------------------------------------------------------------------------------------------


def reference_linear(
    x,
    w,
    target,
    bias=None,
    *,
    reduction,
    g_loss,
    g_lse=None,
    g_entropy=None,
    rows_per_chunk=512,
    inverse_temperature=1.0,
    mask_ignored_stats=False,
    **options,
):
    """Float64 outputs and gradients of ``Σ g_loss·loss + g_lse·lse + g_entropy·H`` w.r.t. x, weight, bias.

    ``loss`` is cross entropy of ``inverse_temperature · (x Wᵀ + b)`` with ``options`` as in
    ``F.cross_entropy`` (plus z-loss and soft cap); ``lse``/``H`` are per token (zeroed on ignored tokens
    when ``mask_ignored_stats``). Returns a dict of float64 tensors on ``x``'s device.
    """
    ignore_index = options.get("ignore_index", -100)
    cweight = options.get("weight")
    cw, cz = reduction_scales(target, cweight, ignore_index, reduction)
    w64 = w.detach().double().requires_grad_(True)
    b64 = bias.detach().double().requires_grad_(True) if bias is not None else None
    n = x.shape[0]
    out = {"dx": torch.empty(x.shape, dtype=torch.float64, device=x.device), "dw": torch.zeros_like(w64)}
    out["db"] = torch.zeros_like(b64) if b64 is not None else None
    rows, lses, ents, total = [], [], [], 0.0
    for s in range(0, n, rows_per_chunk):
        e = min(n, s + rows_per_chunk)
        xc = x[s:e].detach().double().requires_grad_(True)
        z = xc @ w64.T
        if b64 is not None:
            z = z + b64
        z = z * inverse_temperature
        ce, zl = reference_rows(z, target[s:e], **options)
        zc = options["softcap"] * torch.tanh(z / options["softcap"]) if options.get("softcap") else z
        lse = torch.logsumexp(zc, -1)
        logp = torch.log_softmax(zc, -1)
        ent = -(logp.exp() * logp).sum(-1)
        if mask_ignored_stats:
            valid = target[s:e] != ignore_index
            lse, ent = lse * valid, ent * valid
        if reduction == "none":
            obj = ((ce + zl) * g_loss[s:e].double()).sum()
            rows.append((ce + zl).detach())
        else:
            part = ce.sum() * cw + zl.sum() * cz
            obj = part * g_loss.double()
            total = total + part.detach()
        if g_lse is not None:
            obj = obj + (lse * g_lse[s:e].double()).sum()
        if g_entropy is not None:
            obj = obj + (ent * g_entropy[s:e].double()).sum()
        lses.append(lse.detach())
        ents.append(ent.detach())
        params = [xc, w64] + ([b64] if b64 is not None else [])
        grads = torch.autograd.grad(obj, params)
        out["dx"][s:e] = grads[0]
        out["dw"] += grads[1]
        if b64 is not None:
            out["db"] += grads[2]
    out["loss"] = torch.cat(rows) if reduction == "none" else torch.as_tensor(total)
    out["lse"], out["entropy"] = torch.cat(lses), torch.cat(ents)
    return out


def make_inputs(n, h, v, dtype, *, seed, bias=False, ignore_every=6, logit_scale=2.0, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, device=device, generator=gen).to(dtype)
    w = (torch.randn(v, h, device=device, generator=gen) * (logit_scale / h**0.5)).to(dtype)
    b = (torch.randn(v, device=device, generator=gen) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    if ignore_every and n > 1:
        t[::ignore_every] = -100
    return x, w, b, t


def check_against_reference(
    n, h, v, dtype, reduction, *, seed=0, bias=False, max_chunk_tokens=None, **options
):
    x, w, b, t = make_inputs(n, h, v, dtype, seed=seed, bias=bias)
    if options.get("ignore_index", -100) != -100:
        t[t == -100] = options["ignore_index"]
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ba = b.clone().requires_grad_(True) if b is not None else None
    cw = options.pop("class_weight", None)
    loss = fused_linear_cross_entropy(
        xa, wa, t, ba, class_weight=cw, reduction=reduction, max_chunk_tokens=max_chunk_tokens, **options
    )
    # float32 whatever x's dtype (loss_dtype's default; test_loss_dtype checks the other choice)
    assert loss.dtype == torch.float32 and loss.shape == ((n,) if reduction == "none" else ())
    g = torch.randn(loss.shape, device=DEVICE).to(dtype)
    loss.backward(g)
    ref_opts = dict(options, weight=cw.double() if cw is not None else None)
    ref = reference_linear(x, w, t, b, reduction=reduction, g_loss=g, **ref_opts)
    big = n * v > 2**24
    check = assert_close_on_device if big else assert_close
    check(loss, ref["loss"], dtype, name="loss")
    check(xa.grad, ref["dx"], dtype, name="grad x")
    # The weight gradient sums over every token (and, in half precision, over bf16-rounded chunk sums).
    check(wa.grad, ref["dw"], dtype, name="grad weight", scale=2.0)
    if b is not None:
        check(ba.grad, ref["db"], dtype, name="grad bias", scale=2.0)


# ---------------------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "smoothing_z": {"label_smoothing": 0.1, "lse_square_scale": 1e-3},
    "softcap": {"softcap": 3.0},
    "class_weight": {"class_weight": "rand", "label_smoothing": 0.05},
    "bias": {"bias": True},
    "ignore_0": {"ignore_index": 0},
}


def _options(name, v):
    opts = dict(OPTIONS[name])
    if opts.get("class_weight") == "rand":
        opts["class_weight"] = (
            torch.rand(v, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(5)) + 0.25
        )
    return opts


CPU_CASES = [("plain", red, chunk) for red in ("mean", "sum", "none") for chunk in (8, None)] + [
    (opt, red, 8) for opt in list(OPTIONS)[1:] for red in ("mean", "none")
]


@pytest.mark.parametrize(("option", "reduction", "max_chunk_tokens"), CPU_CASES, ids=str)
def test_matches_float64_reference(option, reduction, max_chunk_tokens, poisoned):
    """37 tokens in chunks of 8: four full chunks and a 5-token tail (or one chunk)."""
    check_against_reference(
        37,
        16,
        300,
        torch.float32,
        reduction,
        seed=1,
        max_chunk_tokens=max_chunk_tokens,
        **_options(option, 300),
    )


GPU_CASES = [
    pytest.param(
        (4096, 4096, 128256, torch.bfloat16, "mean", "plain"), marks=gpu, id="gpu-4096x4096x128256-mean"
    ),
    # 5000 tokens under the default 512 MiB budget: two chunks of 1792 and a 1416-token tail
    pytest.param((5000, 4096, 128256, torch.bfloat16, "mean", "smoothing_z"), marks=gpu, id="gpu-5000-tail"),
    pytest.param((4096, 4096, 128256, torch.bfloat16, "none", "plain"), marks=gpu, id="gpu-4096-none"),
    pytest.param((2048, 2048, 32000, torch.float16, "sum", "bias"), marks=gpu, id="gpu-fp16-bias"),
    pytest.param(
        (1024, 1024, 32000, torch.float32, "mean", "class_weight"), marks=gpu, id="gpu-fp32-weights"
    ),
    pytest.param((777, 4096, 128256, torch.bfloat16, "none", "softcap"), marks=gpu, id="gpu-777-softcap"),
]


@pytest.mark.parametrize("case", [(20, 32, 100, torch.bfloat16, "mean", "smoothing_z"), *GPU_CASES], ids=str)
def test_real_sizes_match_float64_reference(case, poisoned):
    n, h, v, dtype, reduction, option = case
    check_against_reference(n, h, v, dtype, reduction, seed=2, **_options(option, v))


@gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_tuning_knobs_overlap_and_split_rows_gpu(reduction, poisoned):
    """The tuning script's variants: row passes on a side stream between the GEMMs of neighbouring chunks
    (``overlap``; gradients in the forward for mean, the recompute backward for none), with the rows split
    over teams of programs writing the gradient into the logits chunk (``split``)."""
    with tuning("fused_linear_cross_entropy", overlap=1), tuning("cross_entropy_fwd_grad", split=4, cuda=0):
        check_against_reference(
            5000, 4096, 128256, torch.bfloat16, reduction, seed=9, **_options("smoothing_z", 128256)
        )


@pytest.mark.parametrize("which", ["x", "weight", "bias", "none"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_only_the_needed_gradients(which, reduction):
    x, w, b, t = make_inputs(19, 8, 50, torch.float32, seed=3, bias=True)
    xa, wa, ba = x.clone(), w.clone(), b.clone()
    if which != "none":
        {"x": xa, "weight": wa, "bias": ba}[which].requires_grad_(True)
    loss = fused_linear_cross_entropy(xa, wa, t, ba, reduction=reduction, max_chunk_tokens=8)
    ref = reference_linear(x, w, t, b, reduction=reduction, g_loss=torch.ones(loss.shape, device=DEVICE))
    assert_close(loss, ref["loss"], torch.float32, name="loss")
    if which == "none":
        assert loss.grad_fn is None
        return
    loss.sum().backward()
    got = {"x": xa.grad, "weight": wa.grad, "bias": ba.grad}
    want = {"x": ref["dx"], "weight": ref["dw"], "bias": ref["db"]}
    for name in got:
        if name == which:
            assert_close(got[name], want[name], torch.float32, name=f"grad {name}")
        else:
            assert got[name] is None


def test_leading_dimensions_and_int32_targets():
    x, w, _, t = make_inputs(12, 8, 40, torch.float32, seed=4)
    x3, t3 = x.view(3, 4, 8).requires_grad_(True), t.view(3, 4).to(torch.int32)
    loss = fused_linear_cross_entropy(x3, w, t3, reduction="none", max_chunk_tokens=5)
    assert loss.shape == (3, 4)
    loss.sum().backward()
    ref = reference_linear(x, w, t, reduction="none", g_loss=torch.ones(12, device=DEVICE))
    assert_close(loss.reshape(-1), ref["loss"], torch.float32, name="loss")
    assert_close(x3.grad.reshape(12, 8), ref["dx"], torch.float32, name="grad x")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignored_chunks(reduction):
    """A chunk whose every target is ignored contributes nothing; all ignored: NaN mean, zero gradients."""
    x, w, _, t = make_inputs(24, 8, 30, torch.float32, seed=5, ignore_every=0)
    t[:8] = -100
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(xa, wa, t, reduction=reduction, max_chunk_tokens=8)
    loss.backward()
    ref = reference_linear(x, w, t, reduction=reduction, g_loss=torch.tensor(1.0, device=DEVICE))
    assert_close(loss, ref["loss"], torch.float32, name="loss")
    assert_close(wa.grad, ref["dw"], torch.float32, name="grad weight")
    assert torch.equal(xa.grad[:8], torch.zeros_like(xa.grad[:8]))
    t.fill_(-100)
    xa.grad = wa.grad = None
    loss = fused_linear_cross_entropy(xa, wa, t, reduction=reduction, max_chunk_tokens=8)
    loss.backward()
    assert torch.isnan(loss).item() == (reduction == "mean")
    assert not xa.grad.any() and not wa.grad.any()


def test_backward_scales_and_refuses_a_second_pass():
    x, w, _, t = make_inputs(10, 8, 30, torch.float32, seed=6)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(xa, wa, t, reduction="sum", max_chunk_tokens=4)
    (loss * -0.375).backward(retain_graph=True)
    ref = reference_linear(x, w, t, reduction="sum", g_loss=torch.tensor(-0.375, device=DEVICE))
    assert_close(xa.grad, ref["dx"], torch.float32, name="grad x")
    assert_close(wa.grad, ref["dw"], torch.float32, name="grad weight")
    with pytest.raises(
        RuntimeError, match="fused_linear_cross_entropy: a buffer saved by the forward was modified"
    ):
        loss.backward()


def test_plan_chunk_tokens():
    assert DEFAULT_CHUNK_BYTES == 512 * 2**20
    assert plan_chunk_tokens(8192, 128256, 2) == 2048  # 501 MiB of bf16 logits
    assert plan_chunk_tokens(5000, 128256, 2) == 1792  # 3 balanced chunks
    assert plan_chunk_tokens(8192, 128256, 2, chunk_bytes=128 * 2**20) == 512  # 125 MiB
    assert plan_chunk_tokens(5000, 128256, 2, chunk_bytes=128 * 2**20) == 512  # 10 chunks of at most 523 rows
    assert plan_chunk_tokens(100, 128256, 2) == 100  # one chunk
    assert plan_chunk_tokens(8192, 128256, 4) == 1024
    assert plan_chunk_tokens(37, 300, 4, max_chunk_tokens=8) == 8
    assert plan_chunk_tokens(0, 300, 4) == 1
    for n in (1, 127, 129, 1000, 4097, 8192, 65536, 100000):
        for budget in (2**20, 2**26, DEFAULT_CHUNK_BYTES, 2**31):
            c = plan_chunk_tokens(n, 128256, 2, chunk_bytes=budget)
            assert 1 <= c <= max(1, n)
            assert c * 128256 * 2 <= budget or c == 1, "the logits chunk stays within the budget"
            chunks = -(-n // c)
            cap = max(1, budget // (128256 * 2))
            assert chunks == -(-n // (cap - cap % CHUNK_ALIGN if cap >= CHUNK_ALIGN else cap)), (
                "no extra chunk"
            )


@gpu
def test_memory_is_bounded_by_the_chunk_budget():
    """Peak memory of forward+backward, beyond the inputs and the gradients themselves, is the logits chunk
    (at most the budget: 501 MiB at the default 512 MiB, 125 MiB at 128 MiB) plus the per-token rows, the same
    at 4096 and 16384 tokens."""
    h, v = 4096, 128256
    extra = {}
    # Warm-up outside the measurement: Triton compiles, cuBLAS workspaces, allocator pools.
    x, w, _, t = make_inputs(256, h, v, torch.bfloat16, seed=7)
    fused_linear_cross_entropy(x.requires_grad_(True), w.requires_grad_(True), t).backward()
    del x, w, t
    for budget, n in ((DEFAULT_CHUNK_BYTES, 4096), (DEFAULT_CHUNK_BYTES, 16384), (128 * 2**20, 16384)):
        x, w, _, t = make_inputs(n, h, v, torch.bfloat16, seed=7)
        x.requires_grad_(True)
        w.requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fused_linear_cross_entropy(x, w, t, chunk_bytes=budget).backward()
        torch.cuda.synchronize()
        grads = x.numel() * 2 + w.numel() * 2
        extra[budget >> 20, n] = torch.cuda.max_memory_allocated() - base - grads
        del x, w, t
        torch.cuda.empty_cache()
    gb = {k: f"{e / 1e9:.3f} GB" for k, e in extra.items()}
    rows = 16384 * 64  # per-token float32 rows (loss, lse, targets, ...) at 16384 tokens, with room to spare
    assert all(e <= (mib << 20) + rows for (mib, _), e in extra.items()), f"extra peak beyond gradients: {gb}"
    assert abs(extra[512, 16384] - extra[512, 4096]) <= 64 * 2**20, f"working memory grows with tokens: {gb}"


# ---------------------------------------------------------------------------------------------------------
# API: errors, module, ops, compile
# ---------------------------------------------------------------------------------------------------------


def _bad_calls(device: str = DEVICE):
    x, w, b, t = make_inputs(4, 8, 10, torch.float32, seed=8, bias=True, device=device)
    f = fused_linear_cross_entropy
    return [
        ("x", TypeError, lambda: f(x.tolist(), w, t)),
        ("x", TypeError, lambda: f(x.to(torch.int64), w, t)),
        ("x", ValueError, lambda: f(x.to("meta"), w, t)),
        ("x", ValueError, lambda: f(torch.randn(8, 4, device=device).t(), w, t)),
        ("weight", TypeError, lambda: f(x, w.double(), t)),
        ("weight", ValueError, lambda: f(x, w[:, :7], t)),
        ("weight", ValueError, lambda: f(x, w[0], t)),
        ("weight", ValueError, lambda: f(x, w.to("meta"), t)),
        ("target", ValueError, lambda: f(x, w, t[:3])),
        ("target", TypeError, lambda: f(x, w, t.float())),
        ("bias", ValueError, lambda: f(x, w, t, b[:5])),
        ("bias", TypeError, lambda: f(x, w, t, b.double())),
        ("bias", TypeError, lambda: f(x, w, t, b.half())),
        ("class_weight", ValueError, lambda: f(x, w, t, class_weight=torch.rand(3, device=device))),
        ("label_smoothing", ValueError, lambda: f(x, w, t, label_smoothing=-0.1)),
        ("softcap", ValueError, lambda: f(x, w, t, softcap=-1.0)),
        ("reduction", ValueError, lambda: f(x, w, t, reduction="batchmean")),
        ("chunk_bytes", ValueError, lambda: f(x, w, t, chunk_bytes=0)),
        ("max_chunk_tokens", TypeError, lambda: f(x, w, t, max_chunk_tokens=2.5)),
        ("return_z_loss", TypeError, lambda: f(x, w, t, return_z_loss=None)),
        ("loss_dtype", ValueError, lambda: f(x, w, t, loss_dtype=torch.bfloat16)),
    ]


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_loss_dtype(reduction: str) -> None:
    """fp16 inputs (bf16 dot is wrong in the interpreter) give a float32 loss and z-loss by default, or
    ones rounded to x's dtype when asked; the gradients are the same either way."""
    x, w, _, t = make_inputs(12, 16, 30, torch.float16, seed=4)
    out = {}
    for loss_dtype in (torch.float32, torch.float16):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss, z = fused_linear_cross_entropy(
            xa, wa, t, reduction=reduction, lse_square_scale=1e-3, return_z_loss=True, loss_dtype=loss_dtype
        )
        assert loss.dtype == z.dtype == loss_dtype
        loss.sum().backward()
        out[loss_dtype] = (loss.detach(), xa.grad, wa.grad)
    assert torch.equal(out[torch.float32][0].to(torch.float16), out[torch.float16][0])
    for a, b in zip(out[torch.float32][1:], out[torch.float16][1:]):
        assert torch.equal(a, b)
    assert LckFusedLinearCrossEntropyLoss(loss_dtype=torch.float16)(x, w, t).dtype == torch.float16


test_bad_input_names_the_argument = bad_input_test("fused_linear_cross_entropy", _bad_calls, count_on="cpu")


def test_module_and_z_loss():
    x, w, b, t = make_inputs(9, 8, 20, torch.float32, seed=9, bias=True)
    cw = torch.rand(20, device=DEVICE) + 0.5
    loss_fn = LckFusedLinearCrossEntropyLoss(class_weight=cw, lse_square_scale=1e-2, return_z_loss=True)
    assert "lse_square_scale=0.01" in repr(loss_fn) and loss_fn.class_weight is cw
    loss, z = loss_fn(x, w, t, b)
    ref = reference_linear(
        x, w, t, b, reduction="mean", g_loss=torch.tensor(1.0), weight=cw.double(), lse_square_scale=1e-2
    )
    assert_close(loss, ref["loss"], torch.float32, name="loss")
    valid = t != -100
    z_ref = 1e-2 * (torch.logsumexp((x.double() @ w.double().T + b.double())[valid], -1) ** 2).mean()
    assert_close(z, z_ref, torch.float32, name="z_loss")
    with pytest.raises(ValueError, match="LckFusedLinearCrossEntropyLoss: chunk_bytes"):
        LckFusedLinearCrossEntropyLoss(chunk_bytes=-5)


@pytest.mark.parametrize(
    "shape", [(11, 8, 30), pytest.param((2048, 1024, 32000), marks=gpu, id="gpu")], ids=str
)
def test_opcheck(shape):
    n, h, v = shape
    x, w, b, t = make_inputs(n, h, v, torch.float32, seed=10, bias=True)
    ops, chunk = torch.ops.lck, max(1, n // 3)
    torch.library.opcheck(
        ops.fused_linear_cross_entropy_fwd.default,
        (x, w, t, b, None, -100, 0.1, 1e-4, 0.0, "mean", True, True, True, chunk),
    )
    torch.library.opcheck(
        ops.fused_linear_cross_entropy_rescale_.default,
        (torch.randn(n, h, device=DEVICE), torch.randn(v, h, device=DEVICE), torch.randn(0, device=DEVICE),
         torch.ones(1, device=DEVICE), torch.tensor(0.5, device=DEVICE)),
    )  # fmt: skip
    torch.library.opcheck(
        ops.linear_cross_entropy_stats.default,
        (x, w, t, b, None, -100, 0.0, 0.0, 5.0, 1.25, "none", True, chunk),
    )
    lse, ent = (torch.rand(n, device=DEVICE) + 3 for _ in range(2))
    g = torch.randn(n, device=DEVICE)
    torch.library.opcheck(
        ops.linear_cross_entropy_bwd.default,
        (x, w, t, None, None, lse, ent, g, g, g, -100, 0.0, 0.0, 0.0, 1.25, "none", True, True, False, chunk),
    )


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(backend, reduction):
    torch._dynamo.reset()
    n, h, v = (16, 8, 40) if interpreting() else (2048, 4096, 128256)
    dtype = torch.float32 if interpreting() else torch.bfloat16
    x, w, b, t = make_inputs(n, h, v, dtype, seed=11, bias=True)
    x.requires_grad_(True)
    w.requires_grad_(True)

    def step(hidden, weight):
        loss = fused_linear_cross_entropy(
            hidden * 0.5, weight, t, b, label_smoothing=0.1, reduction=reduction
        )
        return loss.float().sum() * 2.0

    eager = step(x, w)
    eager_grads = torch.autograd.grad(eager, (x, w))
    compiled = torch.compile(step, fullgraph=True, backend=backend)  # any graph break is an error
    got = compiled(x, w)
    got_grads = torch.autograd.grad(got, (x, w))
    check = assert_close if interpreting() else assert_close_on_device
    check(got, eager, dtype, name="loss")
    check(got_grads[0], eager_grads[0], dtype, name="grad x")
    check(got_grads[1], eager_grads[1], dtype, name="grad weight")
