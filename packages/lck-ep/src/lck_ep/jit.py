"""Building and launching the EP kernels through the runtime JIT (``lck_runtime.jit``, prefix ``EP``).

The JIT reads ``EP_JIT_CACHE_DIR``, ``EP_JIT_PRINT_COMPILER_COMMAND`` and ``EP_JIT_EXTRA_FLAGS``; this
module reads the ``EP_*`` kernel knobs (:mod:`lck_ep.knobs`) each time a kernel is looked up, validates
them before anything is compiled, and turns the set ones into defines. Loaded kernels are memoised
per (knobs, extra flags, device) in the process, and the JIT's cache key (source, header contents,
every flag, nvcc version) keeps artifacts of different knob values apart on disk.

The dispatch-layout kernel is launched by :func:`lck_ep.layout.layout_kernel` through a pre-bound launch
(:func:`layout_launcher`), which imports this module (never the other way round).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from lck_ep.codegen import LAYOUT_BLOCK_THREADS, LAYOUT_KINDS, KernelSpec, layout_spec
from lck_ep.knobs import EpKnobs, current_knobs, read_knobs

__all__ = [
    "MAX_LAYOUT_SHARED_BYTES",
    "build_layout_kernel",
    "check_layout_problem",
    "compile_layout_kernel",
    "current_layout_spec",
    "kernel_for",
    "layout_launcher",
    "num_sms",
]

# The layout kernel keeps one int per expert and per rank in shared memory; stay within the 48 KiB a
# block gets without opting in to more.
MAX_LAYOUT_SHARED_BYTES = 48 * 1024
_TOPK_DTYPES = {64: "int64", 32: "int32", 16: "int16", 8: "int8"}
_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], Any] = {}
_LAUNCHERS: dict[tuple[Any, ...], Any] = {}
_SMS: dict[int, int] = {}
TOPK_DTYPES = _TOPK_DTYPES


def check_layout_problem(
    *, num_experts: int, num_ranks: int, num_topk: int, knobs: EpKnobs | None = None
) -> EpKnobs:
    """Validate the knobs (from the environment unless given) and the problem size for the layout kernel.

    Raises :class:`~lck_ep.knobs.KnobError` for a bad knob, ``ValueError`` for a problem the kernel
    cannot hold (more experts and ranks than its shared-memory counters fit).
    """
    knobs = current_knobs() if knobs is None else knobs
    knobs.check_problem(num_experts=num_experts, num_topk=num_topk)
    need = 4 * (num_experts + num_ranks)
    if need > MAX_LAYOUT_SHARED_BYTES:
        raise ValueError(
            f"layout kernel: num_experts + num_ranks = {num_experts + num_ranks} needs {need} bytes of shared "
            f"memory, more than {MAX_LAYOUT_SHARED_BYTES}; use layout='torch'"
        )
    return knobs


def current_layout_spec(knobs: EpKnobs | None = None) -> KernelSpec:
    """The layout kernel's spec under ``knobs`` (default: read and validated from the environment)."""
    return layout_spec(read_knobs() if knobs is None else knobs)


def _jit() -> Any:
    from lck_runtime.jit import Jit

    return Jit(prefix="EP")


def compile_layout_kernel(arch: str, *, knobs: EpKnobs | None = None) -> Path:
    """Compile the layout kernel for ``arch`` (``"sm_90a"`` or ``"sm_100a"``) without loading it.

    Knobs are validated first: a bad value raises before nvcc runs. Returns the cached cubin's path.
    """
    spec = current_layout_spec(knobs)
    return Path(_jit().compile_only(**spec.build_kwargs(), arch=arch))


def build_layout_kernel(*, knobs: EpKnobs | None = None, arch: str | None = None) -> Any:
    """Build (or fetch from the JIT cache) and load the layout kernel for the current CUDA device."""
    spec = current_layout_spec(knobs)
    return _jit().build(**spec.build_kwargs(), arch=arch)


def _key(device_index: int, knobs: EpKnobs) -> tuple[Any, ...]:
    return (
        knobs,
        os.environ.get("EP_JIT_EXTRA_FLAGS", ""),
        os.environ.get("EP_JIT_CACHE_DIR", ""),
        device_index,
    )


def kernel_for(device_index: int, knobs: EpKnobs) -> Any:
    key = _key(device_index, knobs)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                kernel = build_layout_kernel(knobs=knobs)
                _KERNELS[key] = kernel
    return kernel


def layout_launcher(device_index: int, knobs: EpKnobs, shared_mem: int) -> Any:
    """:func:`kernel_for`'s layout kernel bound (``lck_runtime.jit.Kernel.bind``) to ``device_index``, its
    block size, ``shared_mem`` bytes and the kinds of its C signature; memoised like the kernel (one per
    shared-memory size: a few per process), so a layout call costs one small host call."""
    key = (*_key(device_index, knobs), shared_mem)
    launch = _LAUNCHERS.get(key)
    if launch is None:
        kernel = kernel_for(device_index, knobs)
        with _LOCK:
            launch = _LAUNCHERS.get(key)
            if launch is None:
                launch = kernel.bind(
                    LAYOUT_KINDS, block=LAYOUT_BLOCK_THREADS, shared_mem=shared_mem, device=device_index
                )
                _LAUNCHERS[key] = launch
    return launch


def num_sms(device_index: int) -> int:
    n = _SMS.get(device_index)
    if n is None:
        import torch

        n = _SMS[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return n
