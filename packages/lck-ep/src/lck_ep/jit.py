"""Building and launching the EP kernels through the runtime JIT (``lck_runtime.jit``, prefix ``EP``).

The JIT reads ``EP_JIT_CACHE_DIR``, ``EP_JIT_PRINT_COMPILER_COMMAND`` and ``EP_JIT_EXTRA_FLAGS``; this
module reads the ``EP_*`` kernel knobs (:mod:`lck_ep.knobs`) each time a kernel is looked up, validates
them before anything is compiled, and turns the set ones into defines. Loaded kernels are memoised
per (knobs, extra flags, device) in the process, and the JIT's cache key (source, header contents,
every flag, nvcc version) keeps artifacts of different knob values apart on disk.

The dispatch-layout kernel (:func:`layout_kernel`) computes the same :class:`~lck_ep.layout.DispatchLayout`
as :func:`~lck_ep.layout.layout_reference`, bit for bit, with one launch and no host synchronisation.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from lck_ep.codegen import LAYOUT_BLOCK_THREADS, KernelSpec, layout_spec
from lck_ep.knobs import EpKnobs, read_knobs

__all__ = [
    "MAX_LAYOUT_SHARED_BYTES",
    "build_layout_kernel",
    "check_layout_problem",
    "compile_layout_kernel",
    "current_layout_spec",
    "layout_kernel",
]

# The layout kernel keeps one int per expert and per rank in shared memory; stay within the 48 KiB a
# block gets without opting in to more.
MAX_LAYOUT_SHARED_BYTES = 48 * 1024
_TOPK_DTYPES = {64: "int64", 32: "int32", 16: "int16", 8: "int8"}
_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], Any] = {}
_SMS: dict[int, int] = {}


def check_layout_problem(
    *, num_experts: int, num_ranks: int, num_topk: int, knobs: EpKnobs | None = None
) -> EpKnobs:
    """Validate the knobs (from the environment unless given) and the problem size for the layout kernel.

    Raises :class:`~lck_ep.knobs.KnobError` for a bad knob, ``ValueError`` for a problem the kernel
    cannot hold (more experts and ranks than its shared-memory counters fit).
    """
    knobs = read_knobs() if knobs is None else knobs
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


def _kernel_for(device_index: int, knobs: EpKnobs) -> Any:
    key = (
        knobs,
        os.environ.get("EP_JIT_EXTRA_FLAGS", ""),
        os.environ.get("EP_JIT_CACHE_DIR", ""),
        device_index,
    )
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                kernel = build_layout_kernel(knobs=knobs)
                _KERNELS[key] = kernel
    return kernel


def _num_sms(device_index: int) -> int:
    n = _SMS.get(device_index)
    if n is None:
        import torch

        n = _SMS[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return n


def layout_kernel(topk_idx: Any, num_experts: int, num_ranks: int) -> Any:
    """The dispatch layout of ``topk_idx`` (CUDA, int64 ``[T, K]``) computed by the JIT layout kernel.

    Same contract and result as :func:`lck_ep.layout.layout_reference`; runs on the current stream
    without a host synchronisation (CUDA-graph safe once the kernel is loaded).
    """
    import torch

    from lck_ep.layout import DispatchLayout, check_layout_args

    check_layout_args(topk_idx, num_experts, num_ranks, where="layout_kernel")
    if topk_idx.device.type != "cuda":
        raise ValueError(f"layout_kernel: topk_idx must be a CUDA tensor, got device {topk_idx.device}")
    num_tokens, num_topk = topk_idx.shape
    knobs = check_layout_problem(num_experts=num_experts, num_ranks=num_ranks, num_topk=num_topk)
    dev = topk_idx.device
    per_rank = torch.zeros(num_ranks, dtype=torch.int32, device=dev)
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    mask = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=dev)
    if num_tokens == 0:
        return DispatchLayout(per_rank, per_expert, mask)
    bits = knobs.topk_idx_bits
    idx = topk_idx
    if bits != 64:
        # A narrower index type: map ignored entries to -1 first so the cast cannot wrap one of them
        # into a valid expert index.
        keep = (topk_idx >= -1) & (topk_idx < num_experts)
        idx = torch.where(keep, topk_idx, -1).to(getattr(torch, _TOPK_DTYPES[bits]))
    from lck_runtime.jit import I32

    device_index = dev.index if dev.index is not None else torch.cuda.current_device()
    kernel = _kernel_for(device_index, knobs)
    blocks = max(
        1, min((num_tokens + LAYOUT_BLOCK_THREADS - 1) // LAYOUT_BLOCK_THREADS, 4 * _num_sms(device_index))
    )
    with torch.cuda.device(device_index):
        kernel.launch(
            (blocks, 1, 1),
            (LAYOUT_BLOCK_THREADS, 1, 1),
            [
                idx,
                I32(num_tokens),
                I32(num_topk),
                I32(num_experts),
                I32(num_ranks),
                per_rank,
                per_expert,
                mask,
            ],
            shared_mem=4 * (num_experts + num_ranks),
            stream=torch.cuda.current_stream(dev),
        )
    return DispatchLayout(per_rank, per_expert, mask)
