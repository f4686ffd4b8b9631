"""The CPU harnesses of the C++ host path: an op family's ``csrc/host.h`` compiled into a test module (its
launches handed to the Triton interpreter or a stand-in), built once per machine into the LCK JIT cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest
import torch

from lck_kernels._common import interpreting


def load_harness(name: str, template: str, label: str) -> ModuleType:
    """Build and import ``template`` (C++ with ``@HOST@`` / ``@PKG@`` standing for the ``_host`` and package
    folders); skip unless under ``TRITON_INTERPRET=1`` with a C++ compiler and CUDA's headers at hand."""
    if not interpreting():
        pytest.skip("compares with the Python Functions on CPU tensors under TRITON_INTERPRET=1")
    from lck_kernels._host import build

    source = template.replace("@HOST@", str(build.HERE)).replace("@PKG@", str(build.PKG))
    try:
        return build.load(name, source, label=label)
    except build.ToolchainMissing as exc:  # the real module cannot build here either
        pytest.skip(str(exc))


# An op family's host.h with every launch handed to the Triton interpreter: launch_args<N> is specialised, for
# each argument count the family's launches take, before host.h is included, to call the Python compile
# callback with (Launch, grid, args), which runs the kernel under TRITON_INTERPRET=1 on the CPU tensors. The
# CUDA guard becomes a no-op and is_cuda() is_cpu(), so the entries take CPU tensors; everything else is host.h
# as built for the GPU.
_INTERPRETED = r"""
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include "@HOST@/checks.h"
#include "@HOST@/launcher.h"
#include "@HOST@/node.h"
namespace c10::cuda { struct FakeGuard { explicit FakeGuard(c10::Device) {} }; }
#define CUDAGuard FakeGuard
#define is_cuda() is_cpu()
namespace lck_host {
template <size_t N> void interpret(int slot, std::array<unsigned, 3> grid, const std::array<Arg, N>& args) {
  Registry& reg = registry();
  py::gil_scoped_acquire gil;
  py::object launch_obj = reg.slots.at(slot).launch;
  reg.compile_cb(launch_obj, py::make_tuple(grid[0], grid[1], grid[2]), py_args(args));
  ++reg.python_launches;
}
#define INTERPRET(N) \
  template <> void launch_args<N>(int s, std::array<unsigned, 3> g, int, const std::array<Arg, N>& a) { interpret(s, g, a); }
@SPECIALISE@
}  // namespace lck_host
#include "@PKG@/@FAMILY@/csrc/host.h"
PYBIND11_MODULE(@MODULE@, m) {
  m.def("add_slot", &lck_host::add_slot);
  m.def("set_compile_callback", [](py::object cb) { lck_host::registry().compile_cb = std::move(cb); });
@BINDS@
}
"""


def interpreted_harness(family: str, counts: Sequence[int], binds: Sequence[str], label: str) -> ModuleType:
    """``family``'s ``csrc/host.h`` built with its launches (of the argument ``counts`` given) handed to the
    Triton interpreter, as module ``_<family>_host_harness`` binding ``bind_<b>`` for each of ``binds``, with
    the interpreter set as its compile callback (skips as :func:`load_harness` does)."""
    name = f"_{family}_host_harness"
    source = (
        _INTERPRETED.replace("@SPECIALISE@", " ".join(f"INTERPRET({n})" for n in sorted(set(counts))))
        .replace("@FAMILY@", family)
        .replace("@MODULE@", name)
        .replace("@BINDS@", "\n".join(f"  lck_host::bind_{b}(m);" for b in binds))
    )
    module = load_harness(name, source, label)
    module.set_compile_callback(lambda launch, grid, args: launch.fn[grid](*args, **launch.meta))
    return module


def harness_slots(module: ModuleType) -> Callable[[Any], int]:
    """``slot(launch)`` for a harness: the Launch registered in ``module`` once, its slot id after."""
    slots: dict[int, int] = {}

    def slot(launch: Any) -> int:
        if id(launch) not in slots:
            slots[id(launch)] = module.add_slot(launch)
        return slots[id(launch)]

    return slot


def on_device_0(plan: Callable[..., Any]) -> Callable[..., Any]:
    """A plan callback asked for device 0 where the harness passes a CPU tensor's device index (-1); tests fake
    device 0's SM count as ``num_sms`` answers for CPU tensors (4), so both paths get the same grids."""
    return lambda *a: plan(*(0 if x == -1 else x for x in a))


def ce_sms_faked(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Cross entropy's launch configurations computed with 4 SMs on any device (no GPU needed), their caches
    cleared after: the body of the ``fake_sms`` fixtures of the cross-entropy host tests."""
    from lck_kernels.cross_entropy import launch as ce_launch

    monkeypatch.setattr(ce_launch, "num_sms", lambda device: 4)
    cached = (ce_launch.ce_launch_config, ce_launch._fwd_launch, ce_launch._bwd_launch)
    cached += (ce_launch._rescale_rows_launch,)
    yield
    for fn in cached:
        fn.cache_clear()


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """The C++ path's and the Python Functions' results bit for bit, NaN where the other has NaN (a mean over
    ignored rows only is 0/0 on both paths)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), f"{what}: NaN in different places"
    same = torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
    assert same, f"{what}: differs (max |diff| {(a.float() - b.float()).abs().nan_to_num().max().item()})"
