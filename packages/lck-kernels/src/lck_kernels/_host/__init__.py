"""C++ autograd code that launches lck's Triton kernels with no Python on the per-call path (issue 28).

A Python ``torch.autograd.Function`` costs the host its Python forward, and its backward runs Python again
on autograd's device thread, where the interpreter's working set is cold: measured on an H200 (2026-12-02,
``benchmarks/host_floor.py``), the RMSNorm backward body took about three times as long there as the same
code on the calling thread. The ops here record hand-written C++ backward nodes (``node.h``: less bookkeeping
per call than a ``torch::autograd::Function``'s), in ``module.cpp`` and each op family's ``csrc/host.h``: they
allocate their outputs, look up the launch plan cached per shape and the compiled Triton variant cached per
argument specialisation (``launcher.h``), and call ``cuLaunchKernel`` with addresses and strides (no views).
Python is only consulted the first time a shape or a variant is seen: the plan comes from the family's
``launch.py`` and the kernel is compiled and launched by Triton itself, which then says how to launch it
again (or that it must keep going through Triton: scratch memory, clusters, tensor descriptors).

Used only for plain eager calls on CUDA tensors (:func:`ready`); ``torch.compile``, fake tensors, modes,
tuning overrides and Triton launch hooks keep the Python ops. ``LCK_KERNELS_HOST=0`` (set before the first
call) turns it off. The
module is compiled on first use (tens of seconds, once per machine: ``build.py``); if that fails, one
warning says why and the Python path runs.
"""

from __future__ import annotations

import os
import threading
import warnings
from types import ModuleType
from typing import Any

import torch

from lck_kernels import _common
from lck_kernels._eager import _FAST, _PLAIN, Launch, launch_hooked, plain_eager

_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None
_slots: dict[int, int] = {}  # id(Launch) -> slot (Launches live for the process: launch_for caches them)


def enabled() -> bool:
    """Whether the C++ path may be used at all (``LCK_KERNELS_HOST``, Triton's fast-launch support)."""
    return _FAST and _failed is None and os.environ.get("LCK_KERNELS_HOST", "1") != "0"


def module() -> ModuleType | None:
    """The built module, building it on first use; None (after one warning) when it cannot be built."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from lck_kernels._host.build import build

                mod = build()
                mod.set_compile_callback(_compile)
                _register_plans(mod)
                _module = mod
            except Exception as exc:  # no compiler, no headers: the Python ops run instead
                _failed = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"lck-kernels: the C++ host path is unavailable ({_failed[:500]}); "
                    "ops launch from Python (set LCK_KERNELS_HOST=0 to silence)",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _module


def ready(*tensors: Any) -> ModuleType | None:
    """The module when this call may take the C++ path: the leading arguments CUDA tensors in a plain eager
    call, no tuning override, no launch hook; else None. The module's entry points check everything else
    and answer None for what they do not take."""
    x = tensors[0]
    if type(x) not in _PLAIN or not x.is_cuda or _common._OVERRIDES:
        return None
    # LCK_KERNELS_HOST is read until the module is built (reading the environment costs ~1.5 µs a call).
    mod = _module if _module is not None else (module() if enabled() else None)
    if mod is None or not plain_eager(tensors) or launch_hooked():
        return None
    return mod


def launch_counts() -> tuple[int, int]:
    """(launches from C++, launches handed to Triton) since the process started; (0, 0) if not built."""
    return tuple(_module.launch_counts()) if _module is not None else (0, 0)  # type: ignore[return-value]


def slot(launch: Launch) -> int:
    """The C++ registry slot of ``launch`` (registered on first request)."""
    s = _slots.get(id(launch))
    if s is None:
        assert _module is not None
        s = _slots[id(launch)] = _module.add_slot(launch)
    return s


# Triton signature types the C++ launcher passes, by the Python type of the argument given for them.
_PARAM = {"i32": 2, "u32": 2, "i64": 3, "u64": 3, "fp32": 4, "fp64": 5}


def _describe(
    compiled: Any, launch: Launch, args: tuple[Any, ...]
) -> tuple[int, int, int, int, bytes] | None:
    """How C++ launches this compiled variant: (CUfunction, threads per block, shared bytes, hidden scratch
    pointers, one parameter code per argument), or None when only Triton's launcher may run it."""
    md = getattr(compiled, "metadata", None)
    src = getattr(compiled, "src", None)
    function = getattr(compiled, "function", None)
    names = getattr(launch.fn, "arg_names", None)
    if md is None or src is None or not function or names is None:
        return None
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False):
        return None
    if getattr(md, "launch_pdl", False) or getattr(md, "tensordesc_meta", None):
        return None
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return None
    if md.shared > 227 * 1024:
        return None
    scratch = int(hasattr(md, "global_scratch_size")) + int(hasattr(md, "profile_scratch_size"))
    signature = src.signature
    codes = []
    for name, arg in zip(names, args):
        ty = signature.get(name) if isinstance(signature, dict) else None
        if ty is None:
            return None
        if ty == "constexpr":
            codes.append(0)
        elif isinstance(ty, str) and ty.startswith("*") and isinstance(arg, torch.Tensor):
            codes.append(1)
        elif ty in ("i32", "u32", "i64", "u64") and type(arg) is int:
            codes.append(_PARAM[ty])
        elif ty in ("fp32", "fp64") and type(arg) is float:
            codes.append(_PARAM[ty])
        else:
            return None
    return int(function), 32 * int(md.num_warps), int(md.shared), scratch, bytes(codes)


def _compile(launch: Launch, grid: tuple[int, int, int], args: tuple[Any, ...]):
    """C++'s first call of a variant: Triton launches it (compiling if needed); answer how to relaunch it."""
    compiled = launch.fn[grid](*args, **launch.meta)
    try:
        return _describe(compiled, launch, args)
    except Exception:  # an unexpected Triton: keep this variant on Triton's launcher
        return None


# The op families whose launch.py may define host_plans.
FAMILIES = ("rms_norm", "swiglu", "cross_entropy", "linear_cross_entropy")


def _register_plans(mod: ModuleType) -> None:
    import importlib

    for family in FAMILIES:
        plans = getattr(importlib.import_module(f"lck_kernels.{family}.launch"), "host_plans", None)
        if plans is not None:
            getattr(mod, f"{family}_set_plans")(*plans(slot))
