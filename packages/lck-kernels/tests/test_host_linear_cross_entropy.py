"""Fused linear cross entropy's C++ host path (``linear_cross_entropy/csrc/host.h``): the same numbers as the
Python Functions.

On a GPU: ``fused_linear_cross_entropy`` and ``fused_linear_scaled_cross_entropy`` (which take the C++ autograd
Functions in plain eager calls of the fused schedule, reduction sum/mean with an input needing a gradient)
against the same calls with the host path turned off (``FusedLinearCrossEntropyFunction`` and
``FusedLinearScaledCrossEntropyFunction``), bit for bit: loss, z-loss, lse, entropy and every gradient, over
bf16/fp16/fp32, one chunk and several (a last chunk shorter than the others), a 3-D input, bias or none, ignored
tokens, label smoothing, z-loss, soft cap, class weights, only some inputs needing a gradient and the scaled op's
lse/entropy gradients (the recompute backward, called from C++); the launches counted as made from C++, and a
repeated call launching nothing through Python. What the host path leaves to Python (the recompute schedule,
no gradient, tuning overrides, bad arguments) still gets the Python errors and results. On CPU: the routing,
``host_plans`` answering the launches and grids the Python engine runs (with the argument counts ``host.h``
passes), and (under ``TRITON_INTERPRET=1``) ``host.h``'s entries and Functions, compiled with every launch
handed to the Triton interpreter, against the Python Functions bit for bit, with their refusals and autograd
errors.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any
from unittest import mock

import pytest
import torch
from _device import gpu
from _host_harness import assert_bits_equal, ce_sms_faked, harness_slots, interpreted_harness, on_device_0

import lck_kernels as L
from lck_kernels import _common, _host
from lck_kernels.cross_entropy import kernels as ce_kernels
from lck_kernels.cross_entropy import launch as ce_launch
from lck_kernels.linear_cross_entropy import launch as lce_launch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# (tokens (an int, or a tuple for a leading shape), hidden, vocab, dtype, chunking keywords)
SHAPES = [
    pytest.param(2048, 512, 32000, torch.bfloat16, {}, id="2048x512-32000-bf16"),  # one chunk
    pytest.param(
        1000, 256, 5003, torch.bfloat16, {"chunk_bytes": 256 * 5003 * 2}, id="1000x256-5003-bf16-4ch"
    ),
    pytest.param(333, 128, 1000, torch.float32, {"max_chunk_tokens": 100}, id="333x128-1000-fp32-4ch"),
    pytest.param((2, 17), 64, 300, torch.float16, {"max_chunk_tokens": 8}, id="2x17x64-300-fp16-5ch"),
    pytest.param(1, 64, 100, torch.bfloat16, {}, id="1x64-100-bf16"),  # one token
]
# fused_linear_cross_entropy keywords; "weight" stands for class weights drawn per case, "ignored" for every
# third target set to ignore_index, "bias" for a bias.
OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "ignored": {"ignore_index": 5, "ignored": True},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 1e-4},
    "softcap": {"softcap": 30.0, "bias": True},
    "weight": {"weight": True, "ignored": True},
    "all": {
        "label_smoothing": 0.05, "lse_square_scale": 1e-4, "softcap": 20.0, "weight": True, "ignored": True,
        "bias": True,
    },
}  # fmt: skip


def _inputs(tokens, h: int, v: int, dtype: torch.dtype, opts: dict[str, Any], seed: int, device: str):
    """(x, weight, bias or None, target, keywords) for one case."""
    lead = tokens if isinstance(tokens, tuple) else (tokens,)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((*lead, h), device=device, generator=g).to(dtype)
    w = (torch.randn((v, h), device=device, generator=g) / h**0.5).to(dtype)
    b = (0.1 * torch.randn(v, device=device, generator=g)).to(dtype) if opts.get("bias") else None
    target = torch.randint(0, v, lead, device=device, generator=g)
    kw = {k: val for k, val in opts.items() if k not in ("weight", "ignored", "bias")}
    if opts.get("ignored"):
        target.view(-1)[::3] = kw.get("ignore_index", -100)
    if opts.get("weight"):
        kw["class_weight"] = 0.5 + torch.rand(v, device=device, generator=g)
    return x, w, b, target, kw


@contextlib.contextmanager
def _python_path(on: bool):
    """The public functions with the host path refused (the Python Functions run), when ``on``."""
    if not on:
        yield
        return
    with mock.patch.object(_host, "ready", lambda *a: None):
        yield


def _via_host(t: torch.Tensor) -> bool:
    # The C++ paths' nodes are named lck_host::...; the Python Functions' nodes carry no namespace.
    return t.grad_fn is not None and "lck_host::" in t.grad_fn.name()


def _leaves(x, w, b, needs: str):
    """Fresh leaves for one call: x, w, b requiring grad where ``needs`` has "x", "w", "b"."""
    xa = x.clone().requires_grad_("x" in needs)
    wa = w.clone().requires_grad_("w" in needs)
    ba = b.clone().requires_grad_("b" in needs) if b is not None else None
    return xa, wa, ba, [a for a in (xa, wa, ba) if a is not None and a.requires_grad]


def _flce_pair(x, w, b, target, kw, reduction, grad_output, needs="xwb", host=None):
    """[(loss, z_loss, *grads) through the host path, the same through the Python Functions]; ``host`` stands
    for the host path's entry (the harness on CPU), else the public function takes it."""
    outs = []
    for use_host in (True, False):
        xa, wa, ba, inputs = _leaves(x, w, b, needs)
        if use_host and host is not None:
            loss, z = host(xa, wa, target, ba, reduction=reduction, return_z_loss=True, **kw)
        else:
            with _python_path(not use_host):
                loss, z = L.fused_linear_cross_entropy(
                    xa, wa, target, ba, reduction=reduction, return_z_loss=True, **kw
                )
        assert _via_host(loss) == use_host, loss.grad_fn.name()
        assert z.grad_fn is None, "the z-loss output must not be differentiable"
        grads = torch.autograd.grad(loss, inputs, grad_output)
        outs.append((loss.detach(), z, *grads))
    return outs


def _flsce_pair(x, w, b, target, kw, differentiated, needs="xwb", host=None):
    """[(nll, lse[, entropy], *grads) through the host path, the same through the Python Functions], with a
    random upstream gradient for each output in ``differentiated`` ("nll", "lse", "entropy"); ``host`` as in
    :func:`_flce_pair`."""
    outs = []
    for use_host in (True, False):
        xa, wa, ba, inputs = _leaves(x, w, b, needs)
        if use_host and host is not None:
            out = host(xa, wa, target, bias=ba, **kw)
        else:
            with _python_path(not use_host):
                out = L.fused_linear_scaled_cross_entropy(xa, wa, target, bias=ba, **kw)
        assert _via_host(out[0]) == use_host, out[0].grad_fn.name()
        g = torch.Generator(device=x.device).manual_seed(7)
        upstream = [torch.randn(o.shape, device=x.device, generator=g) for o in out]
        names = ("nll", "lse", "entropy")
        pairs = [(o, u) for name, o, u in zip(names, out, upstream) if name in differentiated]
        grads = torch.autograd.grad([o for o, _ in pairs], inputs, [u for _, u in pairs])
        outs.append((*(o.detach() for o in out), *grads))
    return outs


def _assert_pair(host, python, what: str) -> None:
    assert len(host) == len(python)
    for k, (a, b) in enumerate(zip(host, python)):
        assert_bits_equal(a, b, f"{what}: output {k}")


@gpu
@needs_cuda
@pytest.mark.parametrize(("tokens", "h", "v", "dtype", "chunking"), SHAPES)
@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_host_flce_equals_python_functions_bit_for_bit(
    tokens, h, v, dtype, chunking, options, reduction
) -> None:
    x, w, b, target, kw = _inputs(
        tokens, h, v, dtype, OPTIONS[options], seed=h + v + len(options), device="cuda"
    )
    kw.update(chunking)
    before = _host.launch_counts()
    for scale in (1.0, 0.75):  # 1: the rescale exits at once; 0.75 rescales the saved gradients
        host, python = _flce_pair(x, w, b, target, kw, reduction, torch.tensor(scale, device="cuda"))
        _assert_pair(host, python, f"grad_output {scale}")
    assert _host.module() is not None, "the host module did not build"
    after = _host.launch_counts()
    assert after[0] > before[0], "no launch went through C++"
    # Every variant is known now: the same call again never goes back to Python.
    xa, wa, ba, inputs = _leaves(x, w, b, "xwb")
    loss = L.fused_linear_cross_entropy(xa, wa, target, ba, reduction=reduction, **kw)
    torch.autograd.grad(loss, inputs)
    assert _host.launch_counts()[1] == after[1], "a known variant was launched through Python"


@gpu
@needs_cuda
@pytest.mark.parametrize(("tokens", "h", "v", "dtype", "chunking"), [SHAPES[1], SHAPES[2]])
@pytest.mark.parametrize("needs", ["x", "w", "b", "wb"])
def test_host_flce_only_the_needed_gradients(tokens, h, v, dtype, chunking, needs) -> None:
    x, w, b, target, kw = _inputs(tokens, h, v, dtype, OPTIONS["all"], seed=11, device="cuda")
    kw.update(chunking)
    host, python = _flce_pair(x, w, b, target, kw, "mean", torch.tensor(0.5, device="cuda"), needs=needs)
    _assert_pair(host, python, f"needs {needs}")
    # loss_dtype = x's dtype: the float32 loss rounded, as the Python path rounds it.
    outs = []
    for use_host in (True, False):
        xa, wa, ba, _ = _leaves(x, w, b, needs)
        with _python_path(not use_host):
            loss, z = L.fused_linear_cross_entropy(
                xa, wa, target, ba, return_z_loss=True, loss_dtype=dtype, **kw
            )
        assert loss.dtype == dtype and z.dtype == dtype
        outs.append((loss.detach(), z))
    _assert_pair(*outs, "loss_dtype")


@gpu
@needs_cuda
@pytest.mark.parametrize(("tokens", "h", "v", "dtype", "chunking"), [SHAPES[0], SHAPES[1], SHAPES[3]])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("differentiated", ["nll", "nll+lse+entropy", "lse"])
def test_host_flsce_equals_python_functions_bit_for_bit(
    tokens, h, v, dtype, chunking, reduction, entropy, differentiated
) -> None:
    x, w, b, target, _ = _inputs(tokens, h, v, dtype, {"bias": True, "ignored": True}, seed=v, device="cuda")
    kw = {"inverse_temperature": 1 / 0.7, "return_entropy": entropy, "reduction": reduction, **chunking}
    before = _host.launch_counts()
    host, python = _flsce_pair(x, w, b, target, kw, differentiated.split("+"))
    _assert_pair(host, python, f"differentiated {differentiated}")
    assert _host.launch_counts()[0] > before[0], "no launch went through C++"
    # x frozen: only the weight's gradient.
    _assert_pair(*_flsce_pair(x, w, b, target, kw, ["nll"], needs="w"), "needs w")
    if differentiated == "nll":  # no recompute: the same call again never goes back to Python
        python_before = _host.launch_counts()[1]
        _flsce_pair(x, w, b, target, kw, ["nll"], needs="w")
        assert _host.launch_counts()[1] == python_before, "a known variant was launched through Python"


@gpu
@needs_cuda
def test_host_path_leaves_the_rest_to_python() -> None:
    x, w, b, target, _ = _inputs(64, 32, 1000, torch.bfloat16, {"bias": True}, seed=5, device="cuda")
    xa, wa, ba, _ = _leaves(x, w, b, "xwb")
    flce, flsce = L.fused_linear_cross_entropy, L.fused_linear_scaled_cross_entropy
    before = _host.launch_counts()
    # The recompute schedule, no gradient and tuning overrides keep the Python Functions.
    assert not _via_host(flce(xa, wa, target, ba, reduction="none"))
    assert not _via_host(flsce(xa, wa, target, bias=ba)[0])  # reduction "none" by default
    with torch.no_grad():
        assert flce(xa, wa, target, ba).grad_fn is None
    with _common.tuning("fused_linear_cross_entropy", overlap=1):
        assert not _via_host(flce(xa, wa, target, ba))
    with _common.tuning("cross_entropy_fwd_grad", split=2):
        assert not _via_host(flce(xa, wa, target, ba))
    assert _host.launch_counts() == before
    # Refused arguments get the Python errors.
    for kw, error, name in (
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing"), ({"ignore_index": 1.0}, TypeError, "ignore_index"),
        ({"softcap": 0.0}, ValueError, "softcap"), ({"reduction": "avg"}, ValueError, "reduction"),
        ({"return_z_loss": 1}, TypeError, "return_z_loss"), ({"chunk_bytes": 0}, ValueError, "chunk_bytes"),
        ({"max_chunk_tokens": True}, TypeError, "max_chunk_tokens"),
        ({"loss_dtype": torch.float16}, ValueError, "loss_dtype"),
        ({"class_weight": torch.ones(999, device="cuda")}, ValueError, "class_weight"),
    ):  # fmt: skip
        with pytest.raises(error, match=name):
            flce(xa, wa, target, ba, **kw)
    with pytest.raises(ValueError, match="target"):
        flce(xa, wa, target[:10], ba)
    with pytest.raises(ValueError, match="inverse_temperature"):
        flsce(xa, wa, target, reduction="mean", inverse_temperature=0.0)
    with pytest.raises(TypeError, match="return_entropy"):
        flsce(xa, wa, target, reduction="mean", return_entropy=1)
    # A second backward over a retained graph: the Python Functions' messages.
    loss = flce(xa, wa, target, ba, reduction="sum")
    assert _via_host(loss)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="fused_linear_cross_entropy: a buffer saved by the forward"):
        loss.backward()
    nll, _ = flsce(xa, wa, target, reduction="sum")
    assert _via_host(nll)
    nll.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError, match="fused_linear_scaled_cross_entropy: a buffer saved by the forward"
    ):
        nll.backward()


# ---------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------


def test_cpu_calls_never_reach_the_host_module(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []
    monkeypatch.setattr(_host, "ready", lambda *a: asked.append(a))
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    target = torch.randint(0, 16, (4,))
    for call in (
        lambda: L.fused_linear_cross_entropy(x, w, target),
        lambda: L.fused_linear_scaled_cross_entropy(x, w, target, reduction="mean"),
    ):
        try:
            call()  # runs under TRITON_INTERPRET=1; else the Python device check raises
        except ValueError as exc:
            assert "cuda" in str(exc)
    assert asked == []


@pytest.fixture
def fake_sms(monkeypatch: pytest.MonkeyPatch):
    """Launch configurations computed with 4 SMs on any device (no GPU needed); caches cleared after."""
    yield from ce_sms_faked(monkeypatch)


def test_host_plans_are_the_python_launches(fake_sms: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``chunks`` answers the chunk length and the row kernel and grid forward_chunked runs per chunk (with the 19
    arguments host.h passes); ``rescale`` the launches of launch_rescale_flat (3 and 4 arguments)."""
    ran: list[tuple[Any, tuple[int, ...], tuple[Any, ...]]] = []
    monkeypatch.setattr(ce_launch, "_run", lambda launch, wrap, grid, *args: ran.append((launch, grid, args)))
    launches: list[Any] = []

    def slot(launch: Any) -> int:
        if launch not in launches:
            launches.append(launch)
        return launches.index(launch)

    chunks, rescale, _ = lce_launch.host_plans(slot)
    device = 7  # a device index no GPU test uses: the fake SM count never meets a real configuration
    meta = torch.device("meta")
    for n, h, v, dtype, chunking in (
        (5000, 64, 128256, torch.bfloat16, (0, 0)), (4096, 32, 32000, torch.bfloat16, (0, 0)),
        (333, 16, 1000, torch.float32, (0, 100)), (37, 8, 90, torch.float16, (90 * 2 * 16, 0)),
        (1, 8, 13, torch.float32, (0, 0)),
    ):  # fmt: skip
        x = torch.empty(n, h, dtype=dtype, device=meta)
        w = torch.empty(v, h, dtype=dtype, device=meta)
        target = torch.empty(n, dtype=torch.int64, device=meta)
        for has_weight, opts, entropy in (
            (False, ce_launch.CEOptions(), False),
            (True, ce_launch.CEOptions(-100, 0.1, 1e-4, 30.0), False),
            (False, ce_launch.CEOptions(scale=1.5), True),
        ):
            cw = torch.empty(v, dtype=torch.float32, device=meta) if has_weight else None
            plan = chunks(n, v, dtype.itemsize, device, *chunking, has_weight, *opts.switches(), entropy)
            chunk = lce_launch.plan_chunk_tokens(
                n, v, dtype.itemsize, chunk_bytes=chunking[0] or None, max_chunk_tokens=chunking[1] or None
            )
            assert plan[0] == chunk
            problem = lce_launch.ChunkedProblem(x, w, target, None, cw, opts, "mean", chunk)
            ran.clear()
            gx, gw, gb = lce_launch.forward_chunked(problem, entropy=entropy, needs=(True, True, False))[4:]
            rows = [r for r in ran if r[0].fn is ce_kernels._ce_fwd_kernel]
            expect = []
            for s in range(0, n, chunk):
                full = min(n, s + chunk) - s == chunk
                launch, grid = plan[1:3] if full else plan[3:5]
                expect.append((launches[launch], (grid,), 19))
            assert [(r[0], r[1], len(r[2])) for r in rows] == expect
        applied = torch.empty(1, dtype=torch.float32, device=meta)
        ran.clear()
        ce_launch.launch_rescale_flat([gx, gw, gb], applied, torch.empty((), device=meta), wrap=False)
        plans = [rescale(t.numel(), device) for t in (gx, gw, gb)]
        expect = [(launches[plans[0][0]], (1,), 3)]
        for t, p in zip((gx, gw, gb), plans):
            if t.numel():
                expect.append((launches[p[1]], (p[2],), 4))
                assert ran[len(expect) - 1][2][2] == p[3], "the block count"
        assert [(r[0], r[1], len(r[2])) for r in ran] == expect


def test_host_plans_refuse_the_split_forward(fake_sms: None) -> None:
    """A forward the C++ path does not launch (the split-row kernel) is answered None: the Python path runs."""
    chunks, _, _ = lce_launch.host_plans(lambda launch: 0)
    args = (4096, 32000, 2, 7, 0, 0, False, False, False, False, False)
    assert chunks(*args) is not None
    with _common.tuning("cross_entropy_fwd_grad", split=2):
        assert chunks(*args) is None


# ---------------------------------------------------------------------------------------------------------
# CPU: host.h's entries and Functions, every launch handed to the Triton interpreter (no GPU needed)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    """host.h (with cross entropy's) with its launches interpreted and the plans wired in, built once per machine
    into the LCK JIT cache (tens of seconds). Argument counts: the rescale factor 3, the rescale 4, the
    reduction and finalize 6, the row kernel 19, and cross entropy's own."""
    module = interpreted_harness(
        "linear_cross_entropy", (3, 4, 5, 6, 7, 8, 19, 22), ("cross_entropy", "linear_cross_entropy"),
        "linear cross entropy host harness",
    )  # fmt: skip
    slot = harness_slots(module)
    module.cross_entropy_set_plans(*(on_device_0(p) for p in ce_launch.host_plans(slot)))
    chunks, rescale, recompute = lce_launch.host_plans(slot)
    module.linear_cross_entropy_set_plans(on_device_0(chunks), on_device_0(rescale), recompute)
    return module


def _harness_flce(m, x, w, target, b=None, *, class_weight=None, ignore_index=-100, label_smoothing=0.0,
                  lse_square_scale=0.0, softcap=None, reduction="mean", return_z_loss=False, chunk_bytes=None,
                  max_chunk_tokens=None, loss_dtype=torch.float32):  # fmt: skip
    return m.fused_linear_cross_entropy(
        x, w, target, b, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
        return_z_loss, chunk_bytes, max_chunk_tokens, loss_dtype,
    )  # fmt: skip


def _harness_flsce(m, x, w, target, *, bias=None, inverse_temperature=1.0, return_entropy=False, ignore_index=-100,
                   reduction="none", chunk_bytes=None, max_chunk_tokens=None):  # fmt: skip
    return m.fused_linear_scaled_cross_entropy(
        x, w, target, bias, inverse_temperature, return_entropy, ignore_index, reduction, chunk_bytes,
        max_chunk_tokens,
    )  # fmt: skip


# (tokens, hidden, vocab, dtype, options, reduction, chunking): 4 chunks (the last shorter) in the first two
CPU_CASES = [
    pytest.param(
        13, 16, 40, torch.float32, "all", "sum", {"max_chunk_tokens": 4}, id="13x16-40-fp32-all-sum"
    ),
    pytest.param(
        13, 16, 40, torch.bfloat16, "bias", "mean", {"max_chunk_tokens": 4}, id="13x16-40-bf16-mean"
    ),
    pytest.param((2, 3), 8, 30, torch.float16, "weight", "mean", {}, id="2x3x8-30-fp16-weight-mean"),
]


@pytest.mark.parametrize(("tokens", "h", "v", "dtype", "options", "reduction", "chunking"), CPU_CASES)
def test_harness_flce_equals_python_functions_bit_for_bit(
    harness, fake_sms, tokens, h, v, dtype, options, reduction, chunking
) -> None:
    x, w, b, target, kw = _inputs(tokens, h, v, dtype, OPTIONS[options], seed=h + v, device="cpu")
    kw.update(chunking)
    host = functools.partial(_harness_flce, harness)
    for needs in ("xwb", "w"):
        pair = _flce_pair(x, w, b, target, kw, reduction, torch.tensor(0.75), needs=needs, host=host)
        _assert_pair(*pair, f"needs {needs}")
    xa, wa, ba, _ = _leaves(x, w, b, "xwb")
    loss = host(xa, wa, target, ba, reduction=reduction, loss_dtype=dtype, **kw)
    ref = L.fused_linear_cross_entropy(xa, wa, target, ba, reduction=reduction, loss_dtype=dtype, **kw)
    assert_bits_equal(loss.detach(), ref.detach(), "loss in loss_dtype")


@pytest.mark.parametrize(
    ("reduction", "entropy", "differentiated"),
    [("mean", True, "nll+lse+entropy"), ("sum", False, "nll"), ("mean", True, "entropy")],
)
def test_harness_flsce_equals_python_functions_bit_for_bit(
    harness, fake_sms, reduction, entropy, differentiated
) -> None:
    x, w, b, target, _ = _inputs(
        13, 16, 40, torch.float32, {"bias": True, "ignored": True}, seed=3, device="cpu"
    )
    kw = {
        "inverse_temperature": 1.7,
        "return_entropy": entropy,
        "reduction": reduction,
        "max_chunk_tokens": 4,
    }
    host = functools.partial(_harness_flsce, harness)
    _assert_pair(*_flsce_pair(x, w, b, target, kw, differentiated.split("+"), host=host), differentiated)


def test_harness_refusals_and_autograd_errors(harness, fake_sms) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g)
    t = torch.randint(0, 30, (5,), generator=g)

    def flce(**kw):
        args = {"x": x, "w": w, "target": t, **kw}
        return _harness_flce(harness, args.pop("x"), args.pop("w"), args.pop("target"), **args)

    for kw in (
        {"reduction": "none"}, {"reduction": "avg"}, {"label_smoothing": 1.5}, {"label_smoothing": True},
        {"lse_square_scale": -1.0}, {"softcap": 0.0}, {"softcap": float("inf")}, {"ignore_index": 1.0},
        {"ignore_index": 1 << 70}, {"return_z_loss": 1}, {"chunk_bytes": 0}, {"chunk_bytes": True},
        {"max_chunk_tokens": 2.0}, {"loss_dtype": torch.float16}, {"loss_dtype": "float32"}, {"target": t[:4]},
        {"target": t.float()}, {"target": t.view(5, 1)}, {"x": x[:0], "target": t[:0]}, {"x": x.double()},
        {"x": x.detach()}, {"w": w[:, :7]}, {"w": w.half()}, {"b": torch.ones(29)}, {"b": torch.ones(30).half()},
        {"class_weight": torch.ones(29)}, {"class_weight": torch.ones(30, requires_grad=True)},
        {"class_weight": torch.ones(60)[::2]}, {"x": torch.randn(8, 5).t().requires_grad_()},
    ):  # fmt: skip
        assert flce(**kw) is None, kw
    with torch.no_grad():
        assert flce() is None  # no gradient: the Python path's forward alone
    for kw in (
        {"reduction": "none"}, {"inverse_temperature": 0.0}, {"inverse_temperature": True},
        {"inverse_temperature": float("nan")}, {"return_entropy": 1}, {"ignore_index": None},
        {"max_chunk_tokens": 0},
    ):  # fmt: skip
        assert _harness_flsce(harness, x, w, t, **({"reduction": "mean"} | kw)) is None, kw
    loss = flce(reduction="sum")
    assert "lck_host::FusedLinearCrossEntropyBackward" in loss.grad_fn.name()
    loss.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError, match="fused_linear_cross_entropy: a buffer saved by the forward was modified"
    ):
        loss.backward()
    nll, lse = _harness_flsce(harness, x, w, t, reduction="sum")
    nll.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError, match="fused_linear_scaled_cross_entropy: a buffer saved by the forward"
    ):
        nll.backward()
    # Gradients reaching lse alone rescale nothing: a second backward over the graph works, as in Python.
    nll, lse = _harness_flsce(harness, x, w, t, reduction="mean")
    x.grad = None
    lse.sum().backward(retain_graph=True)
    first = x.grad.clone()
    lse.sum().backward()
    assert torch.equal(x.grad, 2 * first)
