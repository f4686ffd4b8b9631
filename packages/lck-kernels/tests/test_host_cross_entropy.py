"""Cross entropy's C++ host path (``cross_entropy/csrc/host.h``): the same numbers as the Python Functions.

On a GPU: ``cross_entropy`` (which takes the C++ autograd Functions in plain eager calls) against
``CrossEntropyFunction`` (sum/mean), ``CrossEntropyRowsFunction`` (none) and the no-grad forward on the same
inputs, bit for bit: loss, z-loss and the logits gradient, over bf16/fp16/fp32, shapes up to 4096 x 32000 and
vocabularies that are not a multiple of 16, ignored rows, label smoothing, z-loss, soft cap, class weights and
in-place gradients; the launches counted as made from C++, and a repeated call launching nothing through
Python. What the host path leaves to Python (tuning overrides, bad arguments, empty logits, overlapping rows
written in place) still gets the Python errors and results. On CPU: the routing, ``host_plans`` answering
the launches and grids that the Python launchers use (with the argument counts ``host.h`` passes), and (under
``TRITON_INTERPRET=1``) ``host.h``'s entry and Functions, compiled with every launch handed to the Triton
interpreter, against the Python Functions bit for bit, with its refusals and autograd errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _device import gpu
from _host_harness import assert_bits_equal, ce_sms_faked, harness_slots, interpreted_harness, on_device_0

import lck_kernels as L
from lck_kernels import _common, _host
from lck_kernels.cross_entropy import launch as ce_launch
from lck_kernels.cross_entropy.ops import cross_entropy_apply, cross_entropy_fwd, cross_entropy_rows_apply

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

SHAPES = [
    pytest.param((4096, 32000), torch.bfloat16, id="4096x32000-bf16"),
    pytest.param((1024, 50257), torch.bfloat16, id="1024x50257-bf16"),  # vocab not a multiple of 16
    pytest.param((333, 32003), torch.float16, id="333x32003-fp16"),
    pytest.param((257, 1000), torch.float32, id="257x1000-fp32"),
    pytest.param((64, 128256), torch.bfloat16, id="64x128256-bf16"),  # many tiles per row
    pytest.param((7, 13), torch.float32, id="7x13-fp32"),
    pytest.param((1, 100), torch.bfloat16, id="1x100-bf16"),  # one row: n_rows specialised to 1
]
# cross_entropy keywords; "weight" stands for class weights drawn per case, "ignored" for every third target
# set to ignore_index.
OPTIONS = {
    "plain": {},
    "ignored": {"ignore_index": 5, "ignored": True},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 1e-4},
    "softcap": {"softcap": 30.0},
    "weight": {"weight": True, "ignored": True},
    "all": {
        "label_smoothing": 0.05, "lse_square_scale": 1e-4, "softcap": 20.0, "weight": True, "ignored": True,
    },
}  # fmt: skip


def _inputs(shape: tuple[int, int], dtype: torch.dtype, opts: dict[str, Any], seed: int):
    """(logits, target, cross_entropy keywords) for one case."""
    n, v = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (3 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    kw = {k: val for k, val in opts.items() if k not in ("weight", "ignored")}
    if opts.get("ignored"):
        target[::3] = kw.get("ignore_index", -100)
    if opts.get("weight"):
        kw["weight"] = 0.5 + torch.rand(v, device="cuda", generator=g)
    return logits, target, kw


def _python(x: torch.Tensor, target: torch.Tensor, kw: dict[str, Any], reduction: str, in_place: bool):
    """The Python functional path's Functions, called directly: (loss, z_loss) in float32."""
    softcap = kw.get("softcap")
    args = (
        x, target, kw.get("weight"), kw.get("ignore_index", -100), float(kw.get("label_smoothing", 0.0)),
        float(kw.get("lse_square_scale", 0.0)), float(softcap) if softcap is not None else 0.0,
    )  # fmt: skip
    if not (torch.is_grad_enabled() and x.requires_grad):
        loss, z, _, _, _ = cross_entropy_fwd(*args, reduction, False)
        return loss, z
    if reduction == "none":
        return cross_entropy_rows_apply(*args, in_place)
    return cross_entropy_apply(*args, reduction, in_place)


def _via_host(t: torch.Tensor) -> bool:
    # The C++ nodes are named lck_host::...Backward; the Python Functions' nodes carry no namespace.
    return t.grad_fn is not None and "lck_host::" in t.grad_fn.name()


def _pair(logits, target, kw, reduction: str, in_place: bool, grad_output: torch.Tensor):
    """[(loss, z_loss, dlogits) through the host path, the same through the Python Functions]."""
    outs = []
    for host in (True, False):
        x = logits.clone().requires_grad_(True)
        if host:
            loss, z = L.cross_entropy(
                x, target, reduction=reduction, return_z_loss=True, in_place=in_place, **kw
            )
            assert _via_host(loss), loss.grad_fn.name()
        else:
            loss, z = _python(x, target, kw, reduction, in_place)
            assert not _via_host(loss)
        assert z.grad_fn is None, "the z-loss output must not be differentiable"
        (dx,) = torch.autograd.grad(loss, x, grad_output)
        outs.append((loss.detach(), z, dx))
    return outs


@gpu
@needs_cuda
@pytest.mark.parametrize(("shape", "dtype"), SHAPES)
@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_host_cross_entropy_equals_python_functions_bit_for_bit(shape, dtype, options, reduction) -> None:
    logits, target, kw = _inputs(shape, dtype, OPTIONS[options], seed=sum(shape) + len(options))
    n = shape[0]
    before = _host.launch_counts()
    for in_place in (False, True):
        for scale in (1.0, 0.75):  # 1: the rescale exits at once; 0.75 rescales the saved gradient
            if reduction == "none":
                g = scale * torch.rand(n, device="cuda") if scale != 1.0 else torch.ones(n, device="cuda")
            else:
                g = torch.tensor(scale, device="cuda")
            host, python = _pair(logits, target, kw, reduction, in_place, g)
            for name, a, b in zip(("loss", "z_loss", "grad"), host, python):
                assert_bits_equal(a, b, f"{name} (in_place={in_place}, grad_output {scale})")
    assert _host.module() is not None, "the host module did not build"
    after = _host.launch_counts()
    assert after[0] > before[0], "no launch went through C++"
    # Every variant is known now: the same call again never goes back to Python.
    x = logits.clone().requires_grad_(True)
    loss = L.cross_entropy(x, target, reduction=reduction, **kw)
    torch.autograd.grad(loss, x, torch.ones_like(loss))
    assert _host.launch_counts()[1] == after[1], "a known variant was launched through Python"


@gpu
@needs_cuda
@pytest.mark.parametrize(("shape", "dtype"), [SHAPES[0], SHAPES[2], SHAPES[3]])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_host_forward_without_grad_and_loss_dtype(shape, dtype, reduction) -> None:
    logits, target, kw = _inputs(shape, dtype, OPTIONS["all"], seed=3)
    before = _host.launch_counts()[0]
    for grad_mode, requires_grad in ((False, True), (True, False)):
        x = logits.clone().requires_grad_(requires_grad)
        with torch.set_grad_enabled(grad_mode):
            host = L.cross_entropy(x, target, reduction=reduction, return_z_loss=True, in_place=True, **kw)
            python = _python(x, target, kw, reduction, False)
        assert host[0].grad_fn is None
        assert torch.equal(x, logits), "nothing is written into the logits without grad"
        for name, a, b in zip(("loss", "z_loss"), host, python):
            assert_bits_equal(a, b, f"no-grad {name}")
    assert _host.launch_counts()[0] > before, "no launch went through C++"
    # loss_dtype = the logits' dtype: the float32 loss rounded, as the Python path rounds it.
    x = logits.clone().requires_grad_(True)
    loss, z = L.cross_entropy(x, target, reduction=reduction, return_z_loss=True, loss_dtype=dtype, **kw)
    ref, ref_z = _python(logits.clone().requires_grad_(True), target, kw, reduction, False)
    assert_bits_equal(loss, ref.to(dtype), "loss in loss_dtype")
    assert_bits_equal(z, ref_z.to(dtype), "z_loss in loss_dtype")


@gpu
@needs_cuda
def test_host_path_leaves_the_rest_to_python() -> None:
    logits, target, _ = _inputs((64, 1000), torch.bfloat16, {}, seed=5)
    x = logits.clone().requires_grad_(True)
    # Tuning overrides (the split-row or cluster forward among them) keep the Python ops.
    before = _host.launch_counts()
    with _common.tuning("cross_entropy_fwd_grad", split=2):
        loss = L.cross_entropy(x, target)
    torch.autograd.grad(loss, x)
    assert not _via_host(loss) and _host.launch_counts() == before
    # Refused arguments get the Python errors.
    with pytest.raises(ValueError, match="label_smoothing"):
        L.cross_entropy(x, target, label_smoothing=1.5)
    with pytest.raises(TypeError, match="ignore_index"):
        L.cross_entropy(x, target, ignore_index=1.0)
    with pytest.raises(ValueError, match="softcap"):
        L.cross_entropy(x, target, softcap=0.0)
    with pytest.raises(ValueError, match="reduction"):
        L.cross_entropy(x, target, reduction="avg")
    with pytest.raises(TypeError, match="in_place"):
        L.cross_entropy(x, target, in_place=1)
    with pytest.raises(ValueError, match="loss_dtype"):
        L.cross_entropy(x, target, loss_dtype=torch.float16)
    with pytest.raises(ValueError, match="target"):
        L.cross_entropy(x, target[:10])
    with pytest.raises(ValueError, match="weight"):
        L.cross_entropy(x, target, weight=torch.ones(999, device="cuda"))
    # Overlapping rows cannot take the gradient in place: the Python op says so.
    leaf = torch.randn(1, 1000, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match="overlap"):
        L.cross_entropy(leaf.expand(64, 1000), target, in_place=True)
    # No rows: the Python path's answer (NaN for a mean, as torch).
    empty = torch.empty(0, 1000, device="cuda", requires_grad=True)
    assert L.cross_entropy(empty, target[:0]).isnan().item()
    # A second backward over a retained graph: the Python Function's message.
    loss = L.cross_entropy(x, target, reduction="sum")
    assert _via_host(loss)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cross_entropy: a buffer saved by the forward was modified"):
        loss.backward()


# ---------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------


def test_cpu_calls_never_reach_the_host_module(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []
    monkeypatch.setattr(_host, "ready", lambda *a: asked.append(a))
    logits = torch.randn(4, 16, requires_grad=True)
    target = torch.randint(0, 16, (4,))
    try:
        L.cross_entropy(logits, target)  # runs under TRITON_INTERPRET=1; else the Python device check raises
    except ValueError as exc:
        assert "cuda" in str(exc)
    assert asked == []


@pytest.fixture
def fake_sms(monkeypatch: pytest.MonkeyPatch):
    """Launch configurations computed with 4 SMs on any device (no GPU needed); caches cleared after."""
    yield from ce_sms_faked(monkeypatch)


def test_host_plans_are_the_python_launches(fake_sms: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """host_plans answers the launch and grid launch_* run, and those take the argument counts host.h passes
    (the reduction 6, the forward 19, the backward 22, the rescale 7, the finalize 6)."""
    ran: list[tuple[Any, tuple[int, ...], int]] = []
    monkeypatch.setattr(
        ce_launch, "_run", lambda launch, wrap, grid, *args: ran.append((launch, grid, len(args)))
    )
    launches: list[Any] = []

    def slot(launch: Any) -> int:
        if launch not in launches:
            launches.append(launch)
        return launches.index(launch)

    reduction, fwd, bwd, rescale, finalize = ce_launch.host_plans(slot)
    device = 7  # a device index no GPU test uses: the fake SM count never meets a real configuration
    meta = torch.device("meta")
    f32 = torch.float32
    for (n, v), dtype in (((4096, 32000), torch.bfloat16), ((33, 50257), torch.float16), ((5, 13), f32)):
        logits = torch.empty(n, v, dtype=dtype, device=meta)
        target = torch.empty(n, dtype=torch.int64, device=meta)
        rows = torch.empty(n, dtype=f32, device=meta)
        for has_weight in (False, True):
            weight = torch.empty(v, dtype=f32, device=meta) if has_weight else None
            for opts in (ce_launch.CEOptions(), ce_launch.CEOptions(-100, 0.1, 1e-4, 30.0)):
                smooth, has_z, softcap = opts.switches()
                for mean in (False, True):
                    ran.clear()
                    red = ce_launch.launch_reduction(target, weight, v, -100, mean=mean, wrap=False)
                    assert ran == [(launches[reduction(mean, has_weight)], (1,), 6)]
                for grad in (False, True):
                    ran.clear()
                    ce_launch.launch_fwd(
                        logits, target, weight, red, opts, loss=rows, lse=rows, zloss=rows if has_z else None,
                        grad=torch.empty_like(logits) if grad else None, applied=rows if grad else None,
                        wrap=False,
                    )  # fmt: skip
                    plan = fwd(n, v, dtype.itemsize, device, has_weight, smooth, has_z, softcap, grad)
                    assert ran == [(launches[plan[0]], (plan[1],), 19)]
                ran.clear()
                ce_launch.launch_bwd(
                    logits, torch.empty_like(logits), target, weight, red, opts, lse=rows, entropy=None,
                    g_loss=rows, g_lse=None, g_entropy=None, wrap=False,
                )  # fmt: skip
                plan = bwd(n, v, dtype.itemsize, device, has_weight, smooth, has_z, softcap)
                assert ran == [(launches[plan[0]], (plan[1],), 22)]
        ran.clear()
        ce_launch.launch_rescale_rows(logits, rows, torch.empty((), device=meta), wrap=False)
        plan = rescale(n, v, device)
        assert ran == [(launches[plan[0]], (plan[1],), 7)]
        for reduction_name, mean in (("sum", False), ("mean", True)):
            for has_z in (False, True):
                ran.clear()
                ce_launch.finalize_loss(rows, rows if has_z else None, red, reduction_name, wrap=False)
                assert ran == [(launches[finalize(mean, has_z)], (1,), 6)]
        ran.clear()
        ce_launch.finalize_loss(rows, None, red, "none", wrap=False)
        assert ran == []  # reduction "none": ATen ops only, as ce_finalize


def test_host_plans_refuse_the_split_forward(fake_sms: None) -> None:
    """A forward the C++ path does not launch (the split-row kernel) is answered None: the Python path runs."""
    _, fwd, _, _, _ = ce_launch.host_plans(lambda launch: 0)
    assert fwd(64, 32000, 2, 7, False, False, False, False, True) is not None
    with _common.tuning("cross_entropy_fwd_grad", split=2):
        assert fwd(64, 32000, 2, 7, False, False, False, False, True) is None
        assert fwd(64, 32000, 2, 7, False, False, False, False, False) is not None  # the loss-only kernel


# ---------------------------------------------------------------------------------------------------------
# CPU: host.h's entry and Functions, every launch handed to the Triton interpreter (no GPU needed)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    """host.h with its launches interpreted (argument counts 6 for the reduction and finalize, 7 the rescale, 19
    the forward, 22 the backward) and the plans wired in, built once per machine into the LCK JIT cache (tens of
    seconds)."""
    module = interpreted_harness(
        "cross_entropy", (6, 7, 19, 22), ("cross_entropy",), "cross entropy host harness"
    )
    module.cross_entropy_set_plans(*(on_device_0(p) for p in ce_launch.host_plans(harness_slots(module))))
    return module


def _harness_call(m, x, target, kw: dict[str, Any], reduction: str, in_place: bool, loss_dtype=torch.float32):
    return m.cross_entropy(
        x, target, kw.get("weight"), kw.get("ignore_index", -100), kw.get("label_smoothing", 0.0),
        kw.get("lse_square_scale", 0.0), kw.get("softcap"), reduction, True, in_place, loss_dtype,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "dtype"), [((7, 13), torch.float32), ((16, 100), torch.bfloat16), ((5, 300), torch.float16)]
)
@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_harness_equals_python_functions_bit_for_bit(
    harness, fake_sms, shape, dtype, options, reduction
) -> None:
    n, v = shape
    g = torch.Generator().manual_seed(sum(shape) + len(options))
    logits = (3 * torch.randn(shape, generator=g)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    opts = OPTIONS[options]
    kw = {k: val for k, val in opts.items() if k not in ("weight", "ignored")}
    if opts.get("ignored"):
        target[::3] = kw.get("ignore_index", -100)
    if opts.get("weight"):
        kw["weight"] = 0.5 + torch.rand(v, generator=g)
    for in_place, grad, loss_dtype in (
        (False, True, torch.float32),
        (True, True, dtype),
        (True, False, dtype),
    ):
        g_out = torch.tensor(0.75) if reduction != "none" else torch.rand(n, generator=g)
        g_out = g_out.to(loss_dtype)
        outs = []
        for host in (True, False):
            x = logits.clone().requires_grad_(grad)
            if host:
                loss, z = _harness_call(harness, x, target, kw, reduction, in_place, loss_dtype)
            else:
                loss, z = (t.to(loss_dtype) for t in _python(x, target, kw, reduction, in_place))
            assert z.grad_fn is None and (loss.grad_fn is not None) == grad
            dx = torch.autograd.grad(loss, x, g_out)[0].clone() if grad else x
            outs.append((loss.detach(), z, dx))
        for name, a, b in zip(("loss", "z_loss", "grad"), *outs):
            assert_bits_equal(a, b, f"{name} (in_place={in_place}, grad={grad})")


def test_harness_refusals_and_autograd_errors(harness, fake_sms) -> None:
    x = torch.randn(5, 30, requires_grad=True)
    t = torch.randint(0, 30, (5,))

    def call(x=x, t=t, reduction="mean", in_place=False, loss_dtype=torch.float32, **kw):
        return _harness_call(harness, x, t, kw, reduction, in_place, loss_dtype)

    for kw in (
        {"reduction": "avg"}, {"label_smoothing": 1.5}, {"label_smoothing": True}, {"lse_square_scale": -1.0},
        {"softcap": 0.0}, {"softcap": float("inf")}, {"ignore_index": 1.0}, {"ignore_index": 1 << 70},
        {"in_place": 1}, {"loss_dtype": torch.float16}, {"t": t[:4]}, {"t": t.float()}, {"t": t.view(5, 1)},
        {"x": x[:0], "t": t[:0]}, {"x": x.double()}, {"weight": torch.ones(29)},
        {"weight": torch.ones(30, requires_grad=True)},
    ):  # fmt: skip
        assert call(**kw) is None, kw
    leaf = torch.randn(1, 30, requires_grad=True)
    assert call(x=leaf.expand(5, 30), in_place=True) is None  # overlapping rows to be overwritten
    assert call(x=leaf.expand(5, 30)) is not None  # read, not written
    loss, _ = call(reduction="sum")
    assert "lck_host::CrossEntropyBackward" in loss.grad_fn.name()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cross_entropy: a buffer saved by the forward was modified"):
        loss.backward()
    loss, _ = call(reduction="none", label_smoothing=0.1)  # reads what it saved: a second backward works
    assert "lck_host::CrossEntropyRowsBackward" in loss.grad_fn.name()
    x.grad = None
    loss.backward(torch.ones(5), retain_graph=True)
    first = x.grad.clone()
    loss.backward(torch.ones(5))
    assert torch.equal(x.grad, 2 * first)
    y = torch.randn(4, 16, requires_grad=True) * 1
    other = (y * y).sum()  # saves y, which the in-place gradient overwrites
    loss, _ = call(x=y, t=torch.randint(0, 16, (4,)), in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()
