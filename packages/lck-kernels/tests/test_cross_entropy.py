"""cross_entropy against torch's F.cross_entropy in float64: options, reductions, layouts, errors, ops, compile.

On CPU these run under ``TRITON_INTERPRET=1`` at small sizes; the ``gpu`` parameters run the same checks at
real sizes (8192 × 128256 bf16, vocab 151936, rows past 2^31 elements) on a CUDA device, where the float64
reference is built in row chunks and compared chunk by chunk on the device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _device import COMPILE_BACKENDS, DEVICE, gpu, needs_triton_device
from _errors import bad_input_test
from _tolerances import TOL, assert_close

from lck_kernels._common import interpreting, num_sms, tuning
from lck_kernels.cross_entropy import LckCrossEntropyLoss, cross_entropy
from lck_kernels.cross_entropy.launch import ce_launch_config

pytestmark = needs_triton_device


# ---------------------------------------------------------------------------------------------------------
# float64 reference (plain torch), in row chunks so that GPU-sized cases fit
# ---------------------------------------------------------------------------------------------------------


def reference_rows(
    z64, target, *, weight=None, ignore_index=-100, label_smoothing=0.0, lse_square_scale=0.0, softcap=None
):
    """(ce, zl) per row of float64 logits ``z64``: torch's per-row cross entropy and the z-loss term."""
    if softcap is not None:
        z64 = softcap * torch.tanh(z64 / softcap)
    ce = F.cross_entropy(
        z64,
        target.long(),
        weight=weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction="none",
    )
    zl = lse_square_scale * torch.logsumexp(z64, -1) ** 2 * (target != ignore_index)
    return ce, zl


def reduction_scales(target, weight, ignore_index, reduction):
    """(cw, cz): what the mean divides Σce and Σzl by, as torch does (1 for sum/none)."""
    if reduction != "mean":
        return 1.0, 1.0
    valid = target != ignore_index
    n_valid = valid.sum().double()
    dw = weight.double()[target[valid].long()].sum() if weight is not None else n_valid
    return 1.0 / dw, 1.0 / n_valid


def reference_chunks(logits, target, grad_output, *, reduction, rows_per_chunk, **options):
    """Yields (start, end, loss rows or partial sum, d(Σ loss·grad_output)/dlogits rows) in float64."""
    cw, cz = reduction_scales(target, options.get("weight"), options.get("ignore_index", -100), reduction)
    n = logits.shape[0]
    for s in range(0, n, rows_per_chunk):
        e = min(n, s + rows_per_chunk)
        x = logits[s:e].detach().double().requires_grad_(True)
        ce, zl = reference_rows(x, target[s:e], **options)
        if reduction == "none":
            rows = ce + zl
            obj = (rows * grad_output[s:e].double()).sum()
        else:
            rows = ce.sum() * cw + zl.sum() * cz
            obj = rows * grad_output.double()
        (grad,) = torch.autograd.grad(obj, x)
        yield s, e, rows.detach(), grad


def assert_close_on_device(out, ref, dtype, *, name, scale=1.0, block_elems=2**26):
    """``_tolerances.assert_close`` semantics computed on the device in blocks of rows, for tensors of a
    billion elements (float64 temporaries stay ~0.5 GiB: GPU tests share the device with other workers)."""
    rel, atol, rtol = (t * scale for t in TOL[dtype])
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out2 = out.detach().reshape(out.shape[0], -1) if out.dim() > 0 else out.detach().reshape(1, 1)
    ref2 = ref.detach().reshape(out2.shape)
    rows = max(1, block_elems // max(1, out2.shape[1]))
    blocks = [(s, min(s + rows, out2.shape[0])) for s in range(0, out2.shape[0], rows)]
    err2 = ref2_sq = 0.0
    ref_max = 1.0
    for s, e in blocks:
        o, r = out2[s:e].double(), ref2[s:e].double()
        assert not torch.isnan(o).any().item(), f"{name}: NaN in output rows {s}:{e}"
        err2 += (o - r).pow(2).sum().item()
        ref2_sq += r.pow(2).sum().item()
        ref_max = max(ref_max, r.abs().max().item())
    err = math.sqrt(err2) / max(math.sqrt(ref2_sq), 1e-30)
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel:.1e} ({dtype})"
    for s, e in blocks:
        o, r = out2[s:e].double(), ref2[s:e].double()
        bad = (o - r).abs() > atol * ref_max + rtol * r.abs()
        if bad.any().item():
            i, j = bad.nonzero()[0].tolist()
            raise AssertionError(
                f"{name} ({dtype}): {bad.sum().item()} elements out of tolerance in rows {s}:{e}, first at "
                f"({s + i}, {j}): {o[i, j].item()} vs {r[i, j].item()}"
            )


def make_case(n, v, dtype, *, seed, ignore_every=7, scale=3.0, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(n, v, device=device, generator=gen) * scale).to(dtype)
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    if ignore_every and n > 1:
        target[::ignore_every] = -100
    return logits, target


def check_against_reference(
    n, v, dtype, reduction, *, seed=0, rows_per_chunk=None, in_place=False, **options
):
    logits, target = make_case(n, v, dtype, seed=seed)
    if options.get("ignore_index", -100) != -100:
        target[target == -100] = options["ignore_index"]
    x = logits.clone().requires_grad_(True)
    leaf = x
    if in_place:
        x = x * 1  # a non-leaf buffer the gradient may overwrite
    loss = cross_entropy(x, target, reduction=reduction, in_place=in_place, **options)
    # float32 whatever the logits' dtype (loss_dtype's default; test_loss_dtype checks the other choice)
    assert loss.dtype == torch.float32 and loss.shape == ((n,) if reduction == "none" else ())
    # Seeded with the case (not the global generator, whose state depends on test order), and kept away
    # from 0: a tiny |grad_output| pushes a half-precision gradient into fp16's subnormals, where any
    # kernel's (and torch's) rounding is coarse; the tolerances are for the normal range.
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1000)
    magnitude = 0.5 + torch.rand(loss.shape, device=DEVICE, generator=gen)
    sign = torch.where(torch.rand(loss.shape, device=DEVICE, generator=gen) < 0.5, -1.0, 1.0)
    grad_output = (magnitude * sign).to(dtype)
    loss.backward(grad_output)
    ref_options = dict(options)
    if ref_options.get("weight") is not None:
        ref_options["weight"] = ref_options["weight"].double()
    rows = rows_per_chunk or n
    on_device = n * v > 2**24
    check = assert_close_on_device if on_device else assert_close
    total = 0.0
    for s, e, ref_rows, ref_grad in reference_chunks(
        logits, target, grad_output, reduction=reduction, rows_per_chunk=rows, **ref_options
    ):
        check(leaf.grad[s:e], ref_grad, dtype, name=f"grad rows {s}:{e}")
        if reduction == "none":
            check(loss[s:e], ref_rows, dtype, name=f"loss rows {s}:{e}")
        else:
            total = total + ref_rows
    if reduction != "none":
        assert_close(loss, torch.as_tensor(total), dtype, name="loss")


# ---------------------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 1e-3},
    "softcap": {"softcap": 4.0},
    "weight": {"weight": "rand"},
    "weight_smoothing": {"weight": "rand", "label_smoothing": 0.2},
    "ignore_0": {"ignore_index": 0},
    "everything": {"weight": "rand", "label_smoothing": 0.05, "lse_square_scale": 2e-4, "softcap": 6.0},
}


def _options(name, v):
    opts = dict(OPTIONS[name])
    if opts.get("weight") == "rand":
        opts["weight"] = torch.rand(v, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(9)) + 0.25
    return opts


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_float64_reference(option, reduction, poisoned):
    check_against_reference(13, 300, torch.float32, reduction, seed=1, **_options(option, 300))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("option", ["plain", "everything"])
def test_half_dtypes_match_float64_reference(dtype, option, reduction, poisoned):
    check_against_reference(9, 1000, dtype, reduction, seed=2, **_options(option, 1000))


GPU_CASES = [
    pytest.param((8192, 128256, torch.bfloat16, "mean", "plain"), marks=gpu, id="gpu-8192x128256-bf16-mean"),
    pytest.param(
        (8192, 128256, torch.bfloat16, "none", "everything"), marks=gpu, id="gpu-8192x128256-bf16-all"
    ),
    pytest.param((4096, 151936, torch.bfloat16, "sum", "smoothing"), marks=gpu, id="gpu-4096x151936-bf16"),
    pytest.param((2048, 128256, torch.float32, "mean", "z_loss"), marks=gpu, id="gpu-2048x128256-fp32"),
    pytest.param((333, 50000, torch.float16, "mean", "weight_smoothing"), marks=gpu, id="gpu-333x50000-fp16"),
    pytest.param((1, 128256, torch.bfloat16, "mean", "softcap"), marks=gpu, id="gpu-1x128256"),
]


@pytest.mark.parametrize(
    "case",
    [
        (1, 7, torch.float32, "mean", "plain"),
        (1, 129, torch.bfloat16, "sum", "everything"),
        (2, 151936, torch.float32, "none", "smoothing"),
        (3, 40000, torch.float16, "mean", "z_loss"),
        *GPU_CASES,
    ],
    ids=str,
)
def test_odd_sizes_match_float64_reference(case, poisoned):
    n, v, dtype, reduction, option = case
    chunk = 512 if n * v > 2**24 else None
    check_against_reference(n, v, dtype, reduction, seed=3, rows_per_chunk=chunk, **_options(option, v))


def test_reference_matches_torch_reduced_loss():
    """The per-row decomposition used by the chunked reference is torch's own reduced loss."""
    logits, target = make_case(11, 50, torch.float32, seed=4)
    w = torch.rand(50, device=DEVICE, dtype=torch.float64) + 0.1
    z = logits.double()
    for reduction in ("mean", "sum"):
        direct = F.cross_entropy(z, target, weight=w, label_smoothing=0.3, reduction=reduction)
        ((_, _, rows, _),) = list(
            reference_chunks(
                logits,
                target,
                torch.tensor(1.0),
                reduction=reduction,
                rows_per_chunk=11,
                weight=w,
                label_smoothing=0.3,
            )
        )
        torch.testing.assert_close(rows, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "params",
    [
        # maxima per tile (warp_max 0) and per warp-wide strip (the default; [R, W] tiles, W = 128 fp32)
        {"block_bytes": 256, "programs_per_sm": 1, "prefetch": 1, "warp_max": 0},
        {"block_bytes": 512, "programs_per_sm": 0, "evict": 1, "prefetch": 0, "warp_max": 0},
        {"block_bytes": 256, "programs_per_sm": 2, "stages": 2, "warps": 2, "prefetch": 0, "warp_max": 0},
        # the second pass last tile first; a persistent grid on half the SMs
        {"block_bytes": 256, "programs_per_sm": 1, "prefetch": 1, "reverse": 1, "warp_max": 0},
        {"block_bytes": 256, "programs_per_sm": 1, "prefetch": 1, "sm_pct": 50},
        # two tiles of look-ahead in the statistics pass, one in the gradient pass (forward and reversed)
        {"block_bytes": 256, "programs_per_sm": 1, "prefetch": 2, "grad_ahead": 1, "warp_max": 0},
        {
            "block_bytes": 256,
            "programs_per_sm": 0,
            "prefetch": 2,
            "grad_ahead": 1,
            "reverse": 1,
            "warp_max": 0,
        },
        # two strips of 128 fp32 columns per tile
        {"block_bytes": 1024, "programs_per_sm": 1, "prefetch": 1, "warp_max": 1},
        {"block_bytes": 1024, "programs_per_sm": 0, "evict": 1, "prefetch": 0, "warp_max": 1},
        {"block_bytes": 1024, "programs_per_sm": 1, "prefetch": 1, "warp_max": 1, "grad_ahead": 1},
        # rows split over teams of programs (4 stand-in SMs on CPU: at most 4 per team)
        {"block_bytes": 256, "programs_per_sm": 1, "prefetch": 1, "split": 4, "warp_max": 0},
        {"block_bytes": 512, "programs_per_sm": 0, "evict": 1, "prefetch": 0, "split": 2, "warp_max": 0},
        {"block_bytes": 1024, "programs_per_sm": 1, "prefetch": 1, "split": 2, "warp_max": 1},
        {"block_bytes": 256, "programs_per_sm": 2, "stages": 2, "warps": 2, "prefetch": 0, "split": 2},
    ],
    ids=str,
)
def test_tiled_rows_and_persistent_grids(params, poisoned):
    """Rows of many tiles and grid-stride loops over rows (forced small on CPU), for every row kernel."""
    grad_only = ("split", "reverse", "sm_pct", "grad_ahead")
    loss_only = {k: v for k, v in params.items() if k not in grad_only}
    with tuning("cross_entropy_fwd_grad", **params), tuning("cross_entropy_fwd", **loss_only):
        cfg = ce_launch_config("cross_entropy_fwd_grad", 11, 500, 4, torch.device(DEVICE))
        assert cfg["BLOCK"] < 500 and cfg["grid"][0] <= 11 * cfg["SPLIT"]
        assert cfg["PREFETCH"] == params["prefetch"] and cfg["SPLIT"] == params.get("split", 1)
        assert cfg["WARP_MAX"] == bool(params.get("warp_max", 1))  # on by default
        if "sm_pct" in params:  # one program per SM on a fraction of the SMs (4 stand-in SMs on CPU)
            assert cfg["grid"][0] == min(11, max(1, num_sms(torch.device(DEVICE)) * params["sm_pct"] // 100))
        check_against_reference(11, 500, torch.float32, "mean", seed=5, **_options("everything", 500))
        check_against_reference(11, 500, torch.float32, "none", seed=6, **_options("plain", 500))
        if cfg["SPLIT"] > 1:  # each program overwrites only its own slice of the row
            check_against_reference(
                11, 500, torch.float32, "sum", seed=22, in_place=True, label_smoothing=0.1
            )
        logits, target = make_case(11, 500, torch.float32, seed=7)
        loss = cross_entropy(logits, target, reduction="none", label_smoothing=0.1)  # the loss-only kernel
        ref = F.cross_entropy(logits.double(), target, reduction="none", label_smoothing=0.1)
        assert_close(loss, ref, torch.float32, name="loss without gradient")


@pytest.mark.parametrize(
    ("rows", "vocab"), [(9, 700), pytest.param(512, 128256, marks=pytest.mark.gpu, id="gpu")], ids=str
)
def test_gradient_pass_order_does_not_change_a_bit(rows, vocab):
    """The loss+gradient kernel's second pass may walk a row's tiles last to first (for L2 reuse): every
    element is computed by the same arithmetic either way, so loss and gradient are bit-identical."""
    logits, target = make_case(rows, vocab, torch.bfloat16, seed=31)
    out = {}
    for reverse in (0, 1):
        block = 512 if DEVICE == "cpu" else 32768
        with tuning("cross_entropy_fwd_grad", reverse=reverse, block_bytes=block, cuda=0):
            assert ce_launch_config("cross_entropy_fwd_grad", rows, vocab, 2, torch.device(DEVICE))[
                "REVERSE"
            ] == bool(reverse)
            x = logits.clone().requires_grad_(True)
            loss = cross_entropy(x, target, label_smoothing=0.1)
            (grad,) = torch.autograd.grad(loss, x)
            out[reverse] = (loss, grad)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_split_launch_config():
    dev = torch.device(DEVICE)
    for split, want in ((1, 1), (2, 2), (3, 2), (4, 4), (8, 8), (16, 8)):
        with tuning("cross_entropy_fwd_grad", split=split, programs_per_sm=1, block_bytes=4096):
            cfg = ce_launch_config("cross_entropy_fwd_grad", 5000, 128256, 2, dev)
        want = min(want, 4) if DEVICE == "cpu" else want  # the interpreter's stand-in GPU has 4 SMs
        assert cfg["SPLIT"] == want, (split, cfg)
        assert cfg["grid"][0] % want == 0 and cfg["CHUNK"] % cfg["BLOCK"] == 0
        assert cfg["CHUNK"] * want >= 128256 > cfg["CHUNK"] * (want - 1), "every member owns columns"
    with tuning("cross_entropy_fwd_grad", split=8, programs_per_sm=0, block_bytes=4096):
        short = ce_launch_config("cross_entropy_fwd_grad", 3, 5000, 2, dev)  # 3 tiles: teams of 2
        assert short["SPLIT"] == 2 and short["grid"] == (6,), short
        one_tile = ce_launch_config("cross_entropy_fwd_grad", 3, 700, 2, dev)
        assert one_tile["SPLIT"] == 1 and one_tile["grid"] == (3,), one_tile


@pytest.mark.skipif(not interpreting(), reason="the interpreter runs a team's programs one after another")
def test_split_kernel_gives_up_instead_of_hanging():
    """Phase 0 (the GPU form) in the interpreter: program 0 waits for partners that run only after it. It must
    give up after MAX_SPIN polls, raise the abort flag, and leave NaN, not hang; later waits end at once."""
    from lck_kernels.cross_entropy.launch import CEOptions, launch_reduction
    from lck_kernels.cross_entropy.split import _ce_fwd_split_kernel

    n, v, split = 3, 256, 4
    logits, target = make_case(n, v, torch.float32, seed=24, ignore_every=0)
    red = launch_reduction(target, None, v, -100, mean=True, wrap=False)
    loss, lse, applied = (torch.zeros(n) for _ in range(3))
    grad = torch.zeros_like(logits)
    part = torch.zeros(n * split * 8 + 1, dtype=torch.int64)
    ignore_index, eps, z_scale, scale, softcap = CEOptions().scalars()
    _ce_fwd_split_kernel[(split,)](
        logits, v, grad, v, target, lse, red, loss, lse, lse, lse, applied, part, n, v, v // split, ignore_index,
        eps, z_scale, scale, softcap, BLOCK=64, SPLIT=split, HAS_WEIGHT=False, SMOOTH=False, HAS_Z=False,
        HAS_SOFTCAP=False, ENTROPY=False, EVICT=False, NUM_STAGES=1, PREFETCH=False, PHASE=0, MAX_SPIN=3,
        WARP_MAX=False,
    )  # fmt: skip
    assert part[-1].item() == 1, "the abort flag is raised"
    assert torch.isnan(loss).all() and torch.isnan(grad[:, : v // split]).all(), "no partner: NaN rows"
    # The last member ran after every partner had published: its slice is the true gradient.
    ref = torch.softmax(logits.double(), -1)
    ref[torch.arange(n), target] -= 1
    last = slice(v - v // split, v)
    assert_close(grad[:, last], ref[:, last] / n, torch.float32, name="last member's slice")


def _check_real_vocabularies(seeds: tuple[int, int]) -> None:
    """Real sizes against float64 under a tuning: Llama-3's vocabulary (mean, every option) and Qwen's
    (sum, in place)."""
    check_against_reference(
        8192,
        128256,
        torch.bfloat16,
        "mean",
        seed=seeds[0],
        rows_per_chunk=512,
        **_options("everything", 128256),
    )
    check_against_reference(
        4096, 151936, torch.bfloat16, "sum", seed=seeds[1], rows_per_chunk=512, in_place=True
    )


@gpu
@pytest.mark.parametrize(
    "params",
    [{"split": 2}, {"split": 4, "programs_per_sm": 1}, {"split": 8, "programs_per_sm": 2, "warps": 16}],
    ids=str,
)
def test_split_rows_match_float64_reference_gpu(params, poisoned):
    """Teams of programs that wait for each other inside one launch (the GPU form of the split kernel)."""
    with tuning("cross_entropy_fwd_grad", cuda=0, **params):  # the Triton kernel, not the CUDA cluster one
        cfg = ce_launch_config("cross_entropy_fwd_grad", 8192, 128256, 2, torch.device(DEVICE))
        assert cfg["SPLIT"] == params["split"], cfg
        _check_real_vocabularies(seeds=(21, 23))


@gpu
@pytest.mark.parametrize(
    "params",
    [{"warp_max": 0}, {"warp_max": 1, "block_bytes": 16384, "warps": 16}, {"warp_max": 1, "grad_ahead": 0}],
    ids=str,
)
def test_maxima_per_strip_or_tile_match_float64_reference_gpu(params, poisoned):
    """Running maxima per warp-wide strip (the default; bf16: 64 strips of 256 columns per 32 KiB tile) or per
    tile (warp_max 0), at real sizes."""
    with (
        tuning("cross_entropy_fwd_grad", cuda=0, **params),
        tuning("cross_entropy_fwd", **{k: v for k, v in params.items() if k != "grad_ahead"}),
    ):
        cfg = ce_launch_config("cross_entropy_fwd_grad", 8192, 128256, 2, torch.device(DEVICE))
        assert cfg["WARP_MAX"] == bool(params.get("warp_max", 1))  # on by default
        _check_real_vocabularies(seeds=(31, 32))
        logits, target = make_case(512, 128256, torch.bfloat16, seed=33)
        loss = cross_entropy(logits, target, reduction="none")  # the loss-only kernel
        ref = F.cross_entropy(logits.double(), target, reduction="none")
        assert_close(loss, ref, torch.bfloat16, name="loss without gradient")


def test_minus_inf_logits_are_masked_classes():
    logits, target = make_case(6, 64, torch.float32, seed=7, ignore_every=0)
    logits[:, 40:] = float("-inf")  # e.g. padded vocabulary
    target = target % 40
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, target)
    loss.backward()
    x64 = logits.double().requires_grad_(True)
    ref = F.cross_entropy(x64, target)
    ref.backward()
    assert_close(loss, ref, torch.float32, name="loss")
    assert_close(x.grad, x64.grad, torch.float32, name="grad")
    assert torch.equal(x.grad[:, 40:], torch.zeros_like(x.grad[:, 40:]))


def test_all_targets_ignored():
    logits, target = make_case(5, 30, torch.float32, seed=8)
    target.fill_(-100)
    for reduction in ("mean", "sum"):
        x = logits.clone().requires_grad_(True)
        loss = cross_entropy(x, target, reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-3)
        ref = F.cross_entropy(logits.double(), target, reduction=reduction, label_smoothing=0.1)
        if reduction == "mean":  # 0 / 0, as in torch
            assert math.isnan(ref.item()) and math.isnan(loss.item()), (loss, ref)
        else:
            assert loss.item() == 0.0 and ref.item() == 0.0, (loss, ref)
        loss.backward()
        assert torch.equal(x.grad, torch.zeros_like(x.grad)), "ignored rows get a zero gradient, as in torch"


def test_out_of_range_target_poisons_only_its_row():
    logits, target = make_case(4, 20, torch.float32, seed=9, ignore_every=0)
    target[2] = 20
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, target, reduction="none")
    loss.sum().backward()
    assert torch.isnan(loss[2]) and not torch.isnan(loss[[0, 1, 3]]).any()
    assert torch.isnan(x.grad[2]).all() and not torch.isnan(x.grad[[0, 1, 3]]).any()


# ---------------------------------------------------------------------------------------------------------
# Gradient in the forward: in place, rescaling backward, no-grad forward, layouts
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("shape", [(9, 77), pytest.param((8192, 128256), marks=gpu, id="gpu")], ids=str)
def test_in_place_writes_the_gradient_into_logits(shape, reduction):
    n, v = shape
    dtype = torch.float32 if interpreting() else torch.bfloat16
    logits, target = make_case(n, v, dtype, seed=10)
    grads = {}
    for in_place in (False, True):
        leaf = logits.clone().requires_grad_(True)
        y = leaf * 1
        loss = cross_entropy(y, target, in_place=in_place, label_smoothing=0.1, reduction=reduction)
        loss.backward(torch.ones_like(loss))
        if in_place:
            assert torch.equal(y.detach(), leaf.grad), "the logits buffer holds the gradient"
        grads[in_place] = leaf.grad
    assert torch.equal(grads[True], grads[False])


@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_row"])
@pytest.mark.parametrize("shape", [(37, 1000), pytest.param((8192, 128256), marks=gpu, id="gpu")], ids=str)
def test_rescale_of_the_forward_gradient_is_exact_every_call(shape, per_row):
    """The backward scales the forward's gradient rows by ``grad_output / applied`` (then ``applied`` holds
    ``grad_output``): every element must be the product rounded once. On an H200 at 8192 × 128256 the first
    form of the kernel left one warp's share of a late row unscaled in 17 of 300 calls (its warps read
    ``applied`` after one of them had updated it), so the GPU case repeats the call 100 times."""
    from lck_kernels.cross_entropy.ops import cross_entropy_rescale_

    n, v = shape
    reps = 100 if DEVICE == "cuda" else 2
    dtype = torch.float32 if interpreting() else torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(12)
    grad0 = torch.randn(n, v, device=DEVICE, generator=gen).to(dtype)
    g = -(0.5 + torch.rand((n,) if per_row else (), device=DEVICE, generator=gen)).to(dtype)
    expect = (grad0.float() * (g.float()[:, None] if per_row else g.float())).to(dtype)
    want_applied = g.float().expand(n)
    for call in range(reps):
        grad = grad0.clone()
        applied = torch.ones(n, dtype=torch.float32, device=DEVICE)
        cross_entropy_rescale_(grad, applied, g)
        bad = (grad != expect).any(1).nonzero().flatten()
        assert bad.numel() == 0, f"call {call}: rows {bad[:8].tolist()} are not grad × grad_output"
        assert torch.equal(applied, want_applied), f"call {call}: applied not updated"
    cross_entropy_rescale_(grad, applied, g)  # the same grad_output again (a retained graph): a no-op
    assert torch.equal(grad, expect)


def test_in_place_guards_logits_saved_by_another_op():
    logits, target = make_case(4, 16, torch.float32, seed=11)
    leaf = logits.clone().requires_grad_(True)
    y = leaf * 1
    other = (y * y).sum()  # saves y for its backward
    loss = cross_entropy(y, target, in_place=True)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation|in_place=True"):
        (loss + other).backward()


@pytest.mark.parametrize("upstream", ["scalar", "rows", "expanded_scalar"])
def test_backward_scales_by_grad_output(upstream):
    logits, target = make_case(8, 40, torch.float32, seed=12)
    reduction = "mean" if upstream == "scalar" else "none"
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, target, reduction=reduction)
    if upstream == "scalar":
        g = torch.tensor(0.25, device=DEVICE)
    elif upstream == "rows":
        g = torch.rand(8, device=DEVICE) + 0.5
    else:
        g = torch.tensor(-1.5, device=DEVICE).expand(8)  # row stride 0
    loss.backward(g)
    x64 = logits.double().requires_grad_(True)
    F.cross_entropy(x64, target, reduction=reduction).backward(g.double())
    assert_close(x.grad, x64.grad, torch.float32, name="grad")


def test_second_backward_over_retained_graph_is_refused():
    logits, target = make_case(4, 16, torch.float32, seed=13)
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, target, reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cross_entropy: a buffer saved by the forward was modified"):
        loss.backward()


def test_reduction_none_supports_a_retained_graph():
    """Without in_place the per-row backward reads, never writes, what it saved: backward may run twice."""
    logits, target = make_case(5, 30, torch.float32, seed=20)
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, target, reduction="none", label_smoothing=0.1)
    g = torch.rand(5, device=DEVICE)
    loss.backward(g, retain_graph=True)
    first = x.grad.clone()
    loss.backward(g)
    assert_close(x.grad, 2 * first, torch.float32, name="accumulated grad")


def test_no_grad_forward_skips_the_gradient():
    logits, target = make_case(6, 50, torch.float32, seed=14)
    _, _, lse, grad, applied = torch.ops.lck.cross_entropy_fwd(
        logits, target, None, -100, 0.0, 0.0, 0.0, "mean", False
    )
    assert_close(lse, torch.logsumexp(logits.double(), -1), torch.float32, name="lse")
    assert grad.numel() == 0 and applied.numel() == 0
    with torch.no_grad():
        a = cross_entropy(logits.clone().requires_grad_(True), target, reduction="none")
    b = cross_entropy(logits, target, reduction="none")
    assert a.grad_fn is None and b.grad_fn is None
    assert_close(a, F.cross_entropy(logits.double(), target, reduction="none"), torch.float32)
    assert torch.equal(a, b)


def test_row_stride_and_int32_targets():
    wide = torch.randn(7, 90, device=DEVICE) * 2
    logits = wide[:, :64]  # row stride 90, read without a copy
    target = torch.randint(0, 64, (7,), device=DEVICE, dtype=torch.int32)
    x = logits.clone().requires_grad_(True)
    view = wide.clone()[:, :64].requires_grad_(True)
    for inp in (x, view):
        loss = cross_entropy(inp, target, label_smoothing=0.1)
        loss.backward()
    ref = F.cross_entropy(logits.double(), target.long(), label_smoothing=0.1)
    assert_close(loss, ref, torch.float32)
    assert_close(view.grad, x.grad, torch.float32, name="strided grad")


@gpu
def test_memory_one_gradient_buffer_or_none_in_place():
    """Forward+backward allocates one [tokens, vocab] buffer (the gradient; no fp32 copy of the logits), and
    with ``in_place=True`` none: logits from a matmul, whose backward needs only its inputs."""
    n, v, h = 8192, 128256, 256
    gen = torch.Generator(DEVICE).manual_seed(15)
    hidden = torch.randn(n, h, device=DEVICE, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
    w_t = torch.randn(h, v, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.1
    target = torch.randint(0, v, (n,), device=DEVICE, generator=gen)
    nbytes = n * v * 2
    peaks = {}
    for in_place in (False, True):
        logits = hidden @ w_t
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cross_entropy(logits, target, in_place=in_place).backward()
        torch.cuda.synchronize()
        peaks[in_place] = torch.cuda.max_memory_allocated() - base
        del logits
        hidden.grad = None
    mib = {k: f"{p / 2**20:.0f} MiB" for k, p in peaks.items()}
    assert 0.95 * nbytes <= peaks[False] <= 1.02 * nbytes + 64 * 2**20, (
        f"{mib} for {nbytes / 2**20:.0f} MiB logits"
    )
    assert peaks[True] <= 64 * 2**20, f"in place still allocated {mib[True]}"


@gpu
def test_rows_beyond_int32_offsets():
    """8200 × 262144 bf16 passes 2^31 elements: the last rows must be as right as the first."""
    n, v = 8200, 262144
    logits, target = make_case(n, v, torch.bfloat16, seed=16, scale=2.0)
    assert n * v > 2**31
    x = logits.requires_grad_(True)
    loss = cross_entropy(x, target, reduction="none")
    g = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
    loss.backward(g)
    for rows in (slice(0, 16), slice(n - 16, n)):
        z = logits[rows].detach()
        (ref_rows, ref_grad) = next(
            (r, gr)
            for _, _, r, gr in reference_chunks(z, target[rows], g[rows], reduction="none", rows_per_chunk=16)
        )
        assert_close(loss[rows], ref_rows, torch.bfloat16, name=f"loss {rows}")
        assert_close(x.grad[rows], ref_grad, torch.bfloat16, name=f"grad {rows}")


# ---------------------------------------------------------------------------------------------------------
# API: errors, module, launch configuration, ops, compile
# ---------------------------------------------------------------------------------------------------------


def _bad_calls(device: str = DEVICE):
    x = torch.randn(4, 10, device=device)
    t = torch.randint(0, 10, (4,), device=device)
    return [
        ("logits", TypeError, lambda: cross_entropy(x.tolist(), t)),
        ("logits", TypeError, lambda: cross_entropy(x.to(torch.int32), t)),
        ("logits", ValueError, lambda: cross_entropy(x.to("meta"), t)),
        ("logits", ValueError, lambda: cross_entropy(x.view(2, 2, 10), t)),
        ("logits", ValueError, lambda: cross_entropy(x.t(), torch.randint(0, 4, (10,), device=device))),
        ("logits", ValueError, lambda: cross_entropy(x[:, :0], t)),
        ("target", TypeError, lambda: cross_entropy(x, t.float())),
        ("target", ValueError, lambda: cross_entropy(x, t[:3])),
        ("target", ValueError, lambda: cross_entropy(x, t.view(2, 2))),
        ("target", ValueError, lambda: cross_entropy(x, torch.randint(0, 10, (8,), device=device)[::2])),
        ("target", ValueError, lambda: cross_entropy(x, t.to("meta"))),
        ("weight", ValueError, lambda: cross_entropy(x, t, weight=torch.rand(9, device=device))),
        (
            "weight",
            TypeError,
            lambda: cross_entropy(x, t, weight=torch.ones(10, device=device, dtype=torch.int64)),
        ),
        ("weight", ValueError, lambda: cross_entropy(x, t, weight=torch.rand(20, device=device)[::2])),
        (
            "weight",
            ValueError,
            lambda: cross_entropy(x, t, weight=torch.rand(10, device=device, requires_grad=True)),
        ),
        ("ignore_index", TypeError, lambda: cross_entropy(x, t, ignore_index=1.5)),
        ("label_smoothing", ValueError, lambda: cross_entropy(x, t, label_smoothing=1.5)),
        ("label_smoothing", TypeError, lambda: cross_entropy(x, t, label_smoothing="0.1")),
        ("lse_square_scale", ValueError, lambda: cross_entropy(x, t, lse_square_scale=-1e-4)),
        ("lse_square_scale", ValueError, lambda: cross_entropy(x, t, lse_square_scale=float("nan"))),
        ("softcap", ValueError, lambda: cross_entropy(x, t, softcap=0.0)),
        ("softcap", ValueError, lambda: cross_entropy(x, t, softcap=float("inf"))),
        ("reduction", ValueError, lambda: cross_entropy(x, t, reduction="avg")),
        ("return_z_loss", TypeError, lambda: cross_entropy(x, t, return_z_loss=1)),
        ("in_place", TypeError, lambda: cross_entropy(x, t, in_place="yes")),
        ("loss_dtype", TypeError, lambda: cross_entropy(x, t, loss_dtype="float32")),
        ("loss_dtype", ValueError, lambda: cross_entropy(x, t, loss_dtype=torch.float64)),
    ]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_dtype(reduction: str) -> None:
    """Half-precision logits give a float32 loss by default, or one rounded to their dtype when asked; the
    gradient is the same either way."""
    logits, target = make_case(16, 40, torch.bfloat16, seed=3)
    out = {}
    for loss_dtype in (torch.float32, torch.bfloat16):
        x = logits.clone().requires_grad_(True)
        loss = cross_entropy(x, target, reduction=reduction, loss_dtype=loss_dtype)
        assert loss.dtype == loss_dtype
        loss.sum().backward()
        out[loss_dtype] = (loss.detach(), x.grad)
    assert torch.equal(out[torch.float32][0].to(torch.bfloat16), out[torch.bfloat16][0])
    assert torch.equal(out[torch.float32][1], out[torch.bfloat16][1])
    module = LckCrossEntropyLoss(reduction=reduction, loss_dtype=torch.bfloat16)
    assert module(logits, target).dtype == torch.bfloat16


# Counted on CPU tensors: collection (and every spawned test worker that imports this module) must not
# create a CUDA context, which would land on GPU 0 before the worker picks its own device.
test_bad_input_names_the_argument = bad_input_test("cross_entropy", _bad_calls, count_on="cpu")


def test_return_z_loss_and_module():
    logits, target = make_case(10, 60, torch.float32, seed=17)
    w = torch.rand(60, device=DEVICE) + 0.5
    loss_fn = LckCrossEntropyLoss(weight=w, lse_square_scale=1e-2, return_z_loss=True, reduction="sum")
    assert "lse_square_scale=0.01" in repr(loss_fn) and loss_fn.weight is w
    loss, z = loss_fn(logits, target)
    ce, zl = reference_rows(logits.double(), target, weight=w.double(), lse_square_scale=1e-2)
    assert_close(z, zl.sum(), torch.float32, name="z_loss")
    assert_close(loss, ce.sum() + zl.sum(), torch.float32, name="loss")
    with pytest.raises(ValueError, match="LckCrossEntropyLoss: reduction"):
        LckCrossEntropyLoss(reduction="bad")


@pytest.mark.parametrize("n_cols", [1, 7, 1000, 32000, 128256, 262144])
@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("kernel", ["cross_entropy_fwd", "cross_entropy_fwd_grad", "cross_entropy_bwd"])
def test_launch_configs(kernel, n_cols, element_size):
    cfg = ce_launch_config(kernel, 5000, n_cols, element_size, torch.device(DEVICE))
    block, warps = cfg["BLOCK"], cfg["num_warps"]
    assert block & (block - 1) == 0 and warps & (warps - 1) == 0 and 1 <= warps <= 32
    assert 16 <= block <= max(16, 2 ** math.ceil(math.log2(n_cols)))
    assert block * element_size <= 65536, "a tile is a few tens of KiB, never a whole 256k row"
    assert 1 <= cfg["grid"][0] <= 5000
    with tuning(kernel, warps=2, programs_per_sm=3):
        tuned = ce_launch_config(kernel, 5000, n_cols, element_size, torch.device(DEVICE))
        assert tuned["num_warps"] <= 2 and tuned["grid"][0] < 5000
    with pytest.raises(ValueError, match="unknown parameter"), tuning(kernel, BLOCK=4):
        ce_launch_config(kernel, 5000, n_cols, element_size, torch.device(DEVICE))


@pytest.mark.parametrize("shape", [(5, 30), pytest.param((4096, 32000), marks=gpu, id="gpu")], ids=str)
def test_opcheck(shape):
    n, v = shape
    logits, target = make_case(n, v, torch.float32, seed=18)
    w = torch.rand(v, device=DEVICE)
    ops = torch.ops.lck
    torch.library.opcheck(
        ops.cross_entropy_fwd.default, (logits, target, w, -100, 0.1, 1e-3, 5.0, "mean", True)
    )
    torch.library.opcheck(
        ops.cross_entropy_fwd.default, (logits, target, None, -100, 0.0, 0.0, 0.0, "none", False)
    )
    torch.library.opcheck(
        ops.cross_entropy_fwd_.default, (logits.clone(), target, None, -100, 0.0, 0.0, 0.0, "sum")
    )
    grad = torch.randn(n, v, device=DEVICE)
    applied = torch.ones(n, device=DEVICE)
    torch.library.opcheck(
        ops.cross_entropy_rescale_.default, (grad, applied, torch.tensor(2.0, device=DEVICE))
    )
    torch.library.opcheck(ops.cross_entropy_rescale_.default, (grad, applied, torch.rand(n, device=DEVICE)))
    lse = torch.logsumexp(logits, -1)
    g = torch.rand(n, device=DEVICE)
    torch.library.opcheck(ops.cross_entropy_bwd.default, (logits, target, w, lse, g, -100, 0.1, 1e-3, 5.0))
    torch.library.opcheck(
        ops.cross_entropy_bwd_.default, (logits.clone(), target, None, lse, g, -100, 0.0, 0.0, 0.0)
    )


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(backend, reduction):
    torch._dynamo.reset()
    n, v = (12, 100) if interpreting() else (4096, 128256)
    dtype = torch.float32 if interpreting() else torch.bfloat16
    logits, target = make_case(n, v, dtype, seed=19)
    w = torch.rand(v, device=DEVICE) + 0.5

    def step(h):
        loss = cross_entropy(
            h * 2.0, target, weight=w, label_smoothing=0.1, softcap=20.0, reduction=reduction
        )
        return (loss * 3.0).sum() if reduction == "none" else loss * 3.0

    x = logits.clone().requires_grad_(True)
    eager = step(x)
    (eager_grad,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(step, fullgraph=True, backend=backend)  # any graph break is an error
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got, x)
    assert_close(got, eager, dtype, name="loss")
    (assert_close if interpreting() else assert_close_on_device)(got_grad, eager_grad, dtype, name="grad")


# ---------------------------------------------------------------------------------------------------------
# Inductor launches user Triton kernels with Python float arguments typed fp64
# ---------------------------------------------------------------------------------------------------------

# Compiles kernels for sm_90 in a child process (``@triton.jit`` gives interpreter objects when
# TRITON_INTERPRET=1, and compiling needs real JIT functions; no GPU is needed: Triton bundles ptxas) with the
# float scalars typed fp64, as Inductor types them, and checks that no fp64 value survives past the casts
# at the top of each kernel. A kernel that forgets a cast either fails to compile (a loop-carried fp32
# value re-assigned fp64, as ``_ce_row_stats``'s running maximum did) or computes in fp64.
_FP64_COMPILE_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failures = []
for module, name, floats, constexprs, pointers in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    signature = {}
    for arg, param in zip(kernel.arg_names, kernel.params):
        if param.is_constexpr:
            signature[arg] = "constexpr"
        elif arg in floats:
            signature[arg] = "fp64"
        elif arg.endswith("_ptr"):
            signature[arg] = pointers.get(arg, "*fp32")
        else:
            signature[arg] = "i32"
    missing = [f for f in floats if signature.get(f) != "fp64"]
    if missing:
        failures.append(f"{name}: no float argument named {missing}")
        continue
    try:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        )
    except Exception as exc:  # the failure Inductor hit, reported per kernel
        failures.append(f"{name}: {type(exc).__name__}: {str(exc)[-400:]}")
        continue
    f64 = [
        line.strip() for line in compiled.asm["ttir"].splitlines()
        if "f64" in line and "arith.truncf" not in line and "tt.func" not in line and "loc(" != line.strip()[:4]
    ]
    if f64:
        failures.append(f"{name}: fp64 values past the casts: {f64[:3]}")
print(json.dumps(failures))
"""


def compile_with_fp64_scalars(specs):
    """[(module, kernel, float args, constexprs, pointer types)] → failure messages (empty when all good)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _FP64_COMPILE_SCRIPT, json.dumps(specs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"compile script failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


_ALL_FLAGS = {"HAS_WEIGHT": True, "SMOOTH": True, "HAS_Z": True, "HAS_SOFTCAP": True, "EVICT": True}
_CE_FP64_SPECS = [
    (
        "lck_kernels.cross_entropy.kernels", "_ce_fwd_kernel", ["eps", "z_scale", "scale", "softcap"],
        {"BLOCK": 256, **_ALL_FLAGS, "ENTROPY": True, "GRAD": True, "NUM_STAGES": 1, "PREFETCH": True},
        {"x_ptr": "*bf16", "grad_ptr": "*bf16", "target_ptr": "*i64"},
    ),
    (  # phase 0: both passes and the team's wait in one launch, as on a GPU
        "lck_kernels.cross_entropy.split", "_ce_fwd_split_kernel", ["eps", "z_scale", "scale", "softcap"],
        {"BLOCK": 256, "SPLIT": 4, **_ALL_FLAGS, "ENTROPY": True, "NUM_STAGES": 1, "PREFETCH": True, "PHASE": 0,
         "MAX_SPIN": 1 << 24},
        {"x_ptr": "*bf16", "grad_ptr": "*bf16", "target_ptr": "*i64", "part_ptr": "*i64"},
    ),
    (
        "lck_kernels.cross_entropy.kernels", "_ce_bwd_kernel", ["eps", "z_scale", "scale", "softcap"],
        {"BLOCK": 256, **_ALL_FLAGS, "HAS_G_LOSS": True, "HAS_G_LSE": True, "HAS_G_ENT": True, "NUM_STAGES": 1},
        {"x_ptr": "*bf16", "grad_ptr": "*bf16", "target_ptr": "*i64"},
    ),
]  # fmt: skip


def test_kernels_compile_for_inductor_with_fp64_scalars():
    assert compile_with_fp64_scalars(_CE_FP64_SPECS) == []
