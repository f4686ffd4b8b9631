"""Recorded kernel launches for the CPU tests of the native and hybrid host side: kernels that bind like
``lck_runtime.jit.Kernel.bind`` and record each bound call instead of launching, and the packing the old
per-call ``Kernel.launch`` applied to typed arguments, so a test states the expected arguments as the CUDA
signature reads them (``I32(n)``, a tensor) and checks the bound launch got exactly those kinds and values."""

from __future__ import annotations

from typing import Any

import torch

from lck_ep.native import bind_kernels
from lck_runtime.jit.args import KIND_PTR, _Arg


class RecordingLaunch:
    """A bound launch that records ``(grid, values)`` per call."""

    def __init__(self, kinds: tuple[int, ...], block: Any) -> None:
        self.kinds = kinds
        self.block = block
        self.calls: list[tuple[Any, list[Any]]] = []

    def __call__(self, grid: Any, values: Any, stream: Any = None) -> None:
        assert stream is None
        assert len(values) == len(self.kinds), (len(values), len(self.kinds))
        self.calls.append((grid, list(values)))


class FakeKernel:
    def bind(self, kinds: Any, *, block: Any, shared_mem: int = 0, device: Any = None) -> RecordingLaunch:
        assert shared_mem == 0 and device == 0
        return RecordingLaunch(tuple(k.kind for k in kinds), block)


def recording_launchers(kinds: dict[str, tuple[type, ...]]) -> dict[str, RecordingLaunch]:
    """``bind_kernels`` over fake kernels: one recording launch per name of ``kinds``."""
    return bind_kernels({name: FakeKernel() for name in kinds}, kinds, 0)


def packed(args: list[Any]) -> tuple[tuple[int, ...], list[Any]]:
    """What ``Kernel.launch`` passed the host for ``args``: typed arguments' kinds and values, tensors as
    pointers to their data."""
    kinds, values = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            kinds.append(KIND_PTR)
            values.append(a.data_ptr())
        else:
            assert isinstance(a, _Arg), a
            kinds.append(a.kind)
            values.append(a.value)
    return tuple(kinds), values


def assert_launch(launch: RecordingLaunch, call: int, grid: Any, expected: list[Any]) -> None:
    """The ``call``-th recorded call of ``launch`` had ``grid`` and exactly the kinds and values ``expected``
    (typed arguments and tensors) packs to."""
    got_grid, values = launch.calls[call]
    assert got_grid == grid
    kinds, want = packed(expected)
    assert launch.kinds == kinds
    assert values == want
    assert all(type(v) is int for v in values), [type(v).__name__ for v in values]
