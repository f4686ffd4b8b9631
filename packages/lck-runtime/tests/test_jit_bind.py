"""Pre-bound launches (``Kernel.bind`` -> ``BoundLaunch``): every check once at bind time, then a call that
passes a grid and flat values straight to the host module.

The CPU tests run a real :class:`Kernel` over a fake host module (its ``launch`` records its arguments) with
the device lookup stubbed; the GPU tests launch real kernels through both paths.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _kernels import TYPED

import lck_runtime.jit.kernel as kernel_module
from lck_runtime.jit import F32, I32, I64, U64, Kernel, Ptr
from lck_runtime.jit.args import KIND_F32, KIND_I32, KIND_I64, KIND_PTR, KIND_U64
from lck_runtime.jit.cache import Entry
from lck_runtime.jit.host import HostModule
from lck_runtime.jit.kernel import BoundLaunch, BuildPlan

_STREAM = 0x5EED  # the "current stream" handle the fakes report


class _FakeHost:
    """The host module's surface that :class:`Kernel` uses, recording launches and attribute sets."""

    class CudaDriverError(RuntimeError):
        pass

    def __init__(self, sizes: list[int] | None) -> None:
        self.sizes = sizes
        self.launches: list[tuple[Any, ...]] = []
        self.attributes: list[tuple[Any, ...]] = []

    def load_module(self, dev: int, image: bytes) -> int:
        return 0x1000

    def get_function(self, dev: int, module: int, name: str) -> int:
        return 0x2000

    def param_sizes(self, dev: int, func: int) -> list[int] | None:
        return self.sizes

    def set_attribute(self, dev: int, func: int, attribute: int, value: int) -> None:
        self.attributes.append((dev, func, attribute, value))

    def launch(self, *args: Any) -> None:
        self.launches.append(args)


def _kernel(monkeypatch: pytest.MonkeyPatch, sizes: list[int] | None) -> tuple[Kernel, _FakeHost]:
    fake = _FakeHost(sizes)
    host = HostModule(fake, "key", Path("/nonexistent"), [], True)  # type: ignore[arg-type]
    plan = BuildPlan("fake", "fake_kernel", "sm_90a", "", [], [], "nvcc", "13.0", "0" * 64)
    entry = Entry(
        Path("/nonexistent"), {"argv": [], "sha256": "fake-bind-test", "file": "k.cubin"}, b"", True
    )
    monkeypatch.setattr(kernel_module, "_modules", {})  # no module handles shared with other tests

    def device(self: Kernel, device: int | None) -> int:
        assert device in (None, 0)
        return 0

    monkeypatch.setattr(Kernel, "_device", device)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: _STREAM, raising=False)
    return Kernel(SimpleNamespace(host=lambda: host), plan, entry), fake


_KINDS = [Ptr, I32, I64, U64, F32]
_SIZES = [8, 4, 8, 8, 4]
_VALUES = [0xDEAD_BEE0, -7, -(2**40), 2**63 + 5, 0.5]


def test_a_bound_call_passes_the_kinds_and_values_through(monkeypatch: pytest.MonkeyPatch) -> None:
    k, host = _kernel(monkeypatch, _SIZES)
    bound = k.bind(_KINDS, block=128)
    assert isinstance(bound, BoundLaunch) and bound.device == 0 and bound.block == (128, 1, 1)
    bound(6, _VALUES)
    bound((2, 3), tuple(_VALUES))
    kinds = (KIND_PTR, KIND_I32, KIND_I64, KIND_U64, KIND_F32)
    assert host.launches[0] == (
        0,
        0x2000,
        (6, 1, 1),
        (128, 1, 1),
        0,
        _STREAM,
        kinds,
        _VALUES,
        False,
        (0, 0, 0),
    )
    assert host.launches[1][2] == (2, 3, 1) and host.launches[1][7] == tuple(_VALUES)
    assert "Ptr, I32, I64, U64, F32" in repr(bound)


def test_a_bound_call_passes_what_launch_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same kernel, grid and arguments through ``launch`` (typed args, packed per call) and through a
    bound launch (flat values) reach the host module identically."""
    k, host = _kernel(monkeypatch, _SIZES)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: SimpleNamespace(cuda_stream=_STREAM))
    k.launch((5, 2), 64, [Ptr(_VALUES[0]), I32(-7), I64(-(2**40)), U64(2**63 + 5), F32(0.5)], shared_mem=256)
    k.bind(_KINDS, block=64, shared_mem=256)((5, 2), _VALUES)
    old, new = host.launches
    assert old[:6] == new[:6] and old[8:] == new[8:]
    assert list(old[6]) == list(new[6]) and list(old[7]) == list(new[7])


@pytest.mark.parametrize(
    ("grid", "error", "match"),
    [
        (0, ValueError, "grid entries must be positive"),
        (-3, ValueError, "grid entries must be positive"),
        (True, TypeError, "grid must be an int or a tuple"),
        (1.5, TypeError, "grid must be an int or a tuple"),
        ((1, 2, 3, 4), TypeError, "grid must be an int or a tuple"),
        ((1, 0), ValueError, "grid entries must be positive"),
        (2**31, ValueError, r"grid \(2147483648, 1, 1\) exceeds"),
        ((1, 65536), ValueError, r"grid \(1, 65536, 1\) exceeds"),
    ],
)
def test_a_bad_grid_is_refused(monkeypatch: pytest.MonkeyPatch, grid: Any, error: type, match: str) -> None:
    k, host = _kernel(monkeypatch, _SIZES)
    bound = k.bind(_KINDS, block=128)
    with pytest.raises(error, match=f"fake: {match}"):
        bound(grid, _VALUES)
    assert not host.launches


def test_the_wrong_number_of_values_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    k, host = _kernel(monkeypatch, _SIZES)
    bound = k.bind(_KINDS, block=128)
    with pytest.raises(ValueError, match="fake: fake_kernel was bound with 5 argument kinds but 4 values"):
        bound(1, _VALUES[:4])
    with pytest.raises(TypeError, match="fake: values must be a list or tuple"):
        bound(1, iter(_VALUES))
    with pytest.raises(TypeError, match=r"fake: stream must be a torch\.cuda\.Stream or None, got int"):
        bound(1, _VALUES, stream=3)
    assert not host.launches


def test_bind_checks_the_kinds_against_the_parameter_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    k, _ = _kernel(monkeypatch, _SIZES)
    with pytest.raises(
        ValueError, match=r"fake\.bind: fake_kernel takes 5 parameters .* but 4 kinds were given"
    ):
        k.bind(_KINDS[:4], block=128)
    with pytest.raises(
        TypeError, match=r"kinds\[1\] is I64 \(8 bytes\) but parameter 1 of fake_kernel is 4 bytes"
    ):
        k.bind([Ptr, I64, I64, U64, F32], block=128)
    # A driver that cannot tell the sizes (before CUDA 12.4): nothing to check against.
    k, _ = _kernel(monkeypatch, None)
    assert k.bind([I32], block=32).kinds == (KIND_I32,)


@pytest.mark.parametrize("bad", [0, "I32", I32(1), object, float])
def test_bind_refuses_what_is_not_an_argument_class(monkeypatch: pytest.MonkeyPatch, bad: Any) -> None:
    k, _ = _kernel(monkeypatch, _SIZES)
    with pytest.raises(TypeError, match=r"fake\.bind: kinds\[4\] is .*expected one of the argument classes"):
        k.bind([*_KINDS[:4], bad], block=128)
    with pytest.raises(TypeError, match=r"fake\.bind: kinds must be a list or tuple"):
        k.bind("PI", block=128)


def test_bind_checks_block_and_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    k, host = _kernel(monkeypatch, _SIZES)
    with pytest.raises(ValueError, match=r"fake\.bind: block \(1025, 1, 1\) exceeds 1024 threads"):
        k.bind(_KINDS, block=1025)
    with pytest.raises(ValueError, match=r"fake\.bind: block entries must be positive"):
        k.bind(_KINDS, block=0)
    with pytest.raises(ValueError, match=r"fake\.bind: shared_mem must be a non-negative int"):
        k.bind(_KINDS, block=32, shared_mem=-1)
    # Above 48 KiB the kernel is opted in once, at bind time, not on every call.
    bound = k.bind(_KINDS, block=32, shared_mem=100 * 1024)
    assert len(host.attributes) == 1 and host.attributes[0][3] == 100 * 1024
    bound(1, _VALUES)
    bound(2, _VALUES)
    assert len(host.attributes) == 1 and [c[4] for c in host.launches] == [100 * 1024] * 2


# ------------------------------------------------------------------------------------------------ GPU

_TYPED_KINDS = [Ptr, Ptr, I32, I64, U64, F32, Ptr, I32]


@pytest.fixture(scope="module")
def jit(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lck_runtime.jit import Jit

    return Jit(cache_dir=tmp_path_factory.mktemp("jit-bind-gpu"))


@pytest.mark.gpu
@pytest.mark.nvcc
def test_bound_launch_runs_the_kernel(jit: Any) -> None:
    k = jit.build("typed_args", TYPED, "typed_args")
    bound = k.bind(_TYPED_KINDS, block=256)
    n = 3000
    x = torch.rand(n, device="cuda") + 0.5
    out = torch.full((n,), float("nan"), device="cuda")
    scalars = torch.full((5,), -7, dtype=torch.int64, device="cuda")
    a, b, c, d = -1_234_567, -(2**40) + 7, 2**63 + 12_345, 1.7
    bound((n + 255) // 256, [out.data_ptr(), scalars.data_ptr(), a, b, c, d, x.data_ptr(), n])
    torch.cuda.synchronize()
    assert scalars.tolist() == [a, b, c - 2**64, c >> 32, n]
    ref = x.double() * torch.tensor(d, dtype=torch.float32).double()
    torch.testing.assert_close(out.double(), ref, rtol=1.2e-7, atol=0)
    with pytest.raises(TypeError, match=r"kinds\[2\] is I64 \(8 bytes\) but parameter 2 of typed_args is 4"):
        k.bind([Ptr, Ptr, I64, I64, U64, F32, Ptr, I32], block=256)
    with pytest.raises((TypeError, RuntimeError)):  # pybind11 refuses a float for an int parameter
        bound(1, [out.data_ptr(), scalars.data_ptr(), 1.5, b, c, d, x.data_ptr(), n])


@pytest.mark.gpu
@pytest.mark.nvcc
def test_bound_launch_streams_and_graphs(jit: Any) -> None:
    k = jit.build("typed_args", TYPED, "typed_args")
    bound = k.bind(_TYPED_KINDS, block=128)
    n = 1 << 16
    x = torch.full((n,), float("nan"), device="cuda")
    out = torch.full((n,), -1.0, device="cuda")
    s = torch.zeros(5, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms: the launch must wait for the fill behind it
        x.fill_(2.0)
        bound(n // 128, [out.data_ptr(), s.data_ptr(), 0, 0, 0, 1.5, x.data_ptr(), n])  # the current stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 3.0)), "the bound launch did not run on the current stream"
    out.fill_(-1.0)
    bound(n // 128, [out.data_ptr(), s.data_ptr(), 0, 0, 0, 0.5, x.data_ptr(), n], stream=side)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 1.0))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound(n // 128, [out.data_ptr(), s.data_ptr(), 0, 0, 0, 4.0, x.data_ptr(), n])
    out.fill_(-1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 8.0))


@pytest.mark.multigpu(2)
@pytest.mark.nvcc
def test_bound_launch_targets_its_device(jit: Any) -> None:
    k = jit.build("typed_args", TYPED, "typed_args")
    bound = k.bind(_TYPED_KINDS, block=256, device=1)
    x = torch.rand(1000, device="cuda:1")
    out = torch.full_like(x, float("nan"))
    s = torch.zeros(5, dtype=torch.int64, device="cuda:1")
    with torch.cuda.device(0):  # another device current: the bound launch still runs on cuda:1
        bound(4, [out.data_ptr(), s.data_ptr(), 0, 0, 0, 1.0, x.data_ptr(), 1000])
    torch.cuda.synchronize(1)
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match=r"stream is on cuda:0 but the launch is bound to cuda:1"):
        bound(
            4, [out.data_ptr(), s.data_ptr(), 0, 0, 0, 1.0, x.data_ptr(), 1000], stream=torch.cuda.Stream(0)
        )
