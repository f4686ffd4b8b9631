"""The cluster kernel for cross entropy with its gradient (``csrc/ce_fwd_grad.cu``): when it applies, its
build through the runtime JIT, and its launch.

The Triton loss+gradient kernel reads each row twice; on an H200 at 8192 × 128256 bf16 the second read
misses L2 (see ``kernels.py``), so the kernel moves three passes of HBM traffic. The cluster
kernel keeps each row in shared memory, split over the blocks of a thread-block cluster, and moves two.
Measured on an H200 it is nevertheless slower (1.64 ms against 1.43 ms; ``benchmarks/results/README.md``),
so it is opt-in: ``tuning("cross_entropy_fwd_grad", cuda=1)`` (the default is in
``kernels._DEFAULTS``). ``launch_fwd`` then tries it first for the loss+gradient forward; it
applies to eager calls (not while ``torch.compile`` or another tracer is looking: those see the Triton
kernels) on sm_90/sm_100 GPUs, for bf16/fp16/fp32 rows of at least ``MIN_ROW_BYTES`` with 16-byte aligned
rows, without class weights or the entropy output. ``LCK_KERNELS_CUDA=0`` turns it off whatever the tuning.

Kernels are built once per (dtype, soft cap) and device, into the ``LCK`` JIT cache
(``LCK_JIT_CACHE_DIR``). Without nvcc the Triton kernel runs instead, with one warning.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from lck_kernels._common import tuned

SOURCE = Path(__file__).resolve().parent / "csrc" / "ce_fwd_grad.cu"
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
MIN_ROW_BYTES = 64 * 1024  # shorter rows: the per-row cluster barrier outweighs the saved pass
NBUF = (
    3  # slices of a block in shared memory: gradient pending, statistics now, loading next (the .cu's NBUF)
)
MAX_SLICE_BYTES = 72 * 1024  # one block's slice of a row: three of them and the statics fit 227 KiB
CLUSTERS = (2, 4, 8)  # 8: the portable maximum cluster size
_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], Any] = {}
_RESIDENT: dict[tuple[Any, ...], int] = {}


def enabled() -> bool:
    return os.environ.get("LCK_KERNELS_CUDA", "1") != "0"


def _direct(*tensors: torch.Tensor) -> bool:
    # Launching outside Triton is invisible to tracers: only plain eager calls on real CUDA tensors.
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active():
        return False
    return all(type(t) is torch.Tensor and t.is_cuda for t in tensors)


def plan(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device) -> dict[str, int] | None:
    """Cluster size, threads per block and 16-byte vectors per thread for these rows, or None when the
    kernel does not apply (tuning keys of ``cross_entropy_fwd_grad``: ``cuda``, ``cluster``, ``threads``)."""
    from lck_kernels.cross_entropy.kernels import _DEFAULTS

    cfg = tuned("cross_entropy_fwd_grad", dict(_DEFAULTS["cross_entropy_fwd_grad"]))
    if not cfg["cuda"] or dtype not in _DTYPE_CODE or n_rows == 0:
        return None
    esize = dtype.itemsize
    if n_cols * esize < MIN_ROW_BYTES:
        return None
    vec = 16 // esize
    threads = max(32, min(1024, int(cfg["threads"])))
    threads -= threads % 32
    choices = [int(cfg["cluster"])] if cfg["cluster"] else list(CLUSTERS)
    for cluster in choices:
        chunk = -(-n_cols // cluster)
        chunk = -(-chunk // vec) * vec
        if cluster not in CLUSTERS or chunk * esize > MAX_SLICE_BYTES:
            continue
        vpt = -(-(chunk // vec) // threads)
        shared = NBUF * (chunk // vec) * 16
        return {
            "cluster": cluster,
            "threads": threads,
            "vpt": vpt,
            "chunk": chunk,
            "vec": vec,
            "shared": shared,
        }
    return None


def _kernel(dtype: torch.dtype, softcap: bool, device_index: int) -> Any:
    key = (dtype, softcap, device_index, os.environ.get("LCK_JIT_CACHE_DIR", ""))
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    with _LOCK:
        kernel = _KERNELS.get(key)
        if kernel is None:
            from lck_runtime.jit import Jit

            with torch.cuda.device(device_index):
                kernel = Jit(prefix="LCK").build(
                    "lck_ce_fwd_grad",
                    SOURCE.read_text(),
                    "lck_ce_fwd_grad",
                    defines={"LCK_CE_DTYPE": _DTYPE_CODE[dtype], "LCK_CE_SOFTCAP": int(softcap)},
                )
            _KERNELS[key] = kernel
    return kernel


def build(dtype: torch.dtype, softcap: bool = False, device: int | None = None) -> Any:
    """Build (or fetch from the JIT cache) the kernel for ``dtype`` rows on CUDA device ``device`` (default:
    current); launches stay with :func:`try_launch`."""
    if dtype not in _DTYPE_CODE:
        raise ValueError(f"build: dtype must be one of {sorted(map(str, _DTYPE_CODE))}, got {dtype}")
    return _kernel(dtype, bool(softcap), torch.cuda.current_device() if device is None else int(device))


_ARCH_OK: dict[int, bool] = {}
_NVCC: list[bool] = []  # [found], once per process


def _usable(index: int) -> bool:
    """sm_90 or newer (thread-block clusters, as far as the JIT targets them) and an nvcc to build with."""
    ok = _ARCH_OK.get(index)
    if ok is None:
        from lck_runtime.jit import CAPABILITY_ARCH

        ok = _ARCH_OK[index] = CAPABILITY_ARCH.get(torch.cuda.get_device_capability(index)) is not None
    if not ok:
        return False
    if not _NVCC:
        from lck_runtime.jit import JitError
        from lck_runtime.jit.compiler import resolve_nvcc

        try:
            resolve_nvcc(None)
            _NVCC.append(True)
        except JitError as exc:
            _NVCC.append(False)
            warnings.warn(
                f"lck_kernels: the CUDA cross-entropy kernel needs nvcc ({exc}); using the Triton kernel, which "
                "reads the logits twice. Set LCK_KERNELS_CUDA=0 to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
    return _NVCC[0]


def try_launch(
    logits: torch.Tensor,
    target: torch.Tensor,
    red: torch.Tensor,
    opts: Any,
    *,
    loss: torch.Tensor,
    lse: torch.Tensor,
    zloss: torch.Tensor | None,
    grad: torch.Tensor,
    applied: torch.Tensor,
    has_class_weight: bool,
    entropy: bool,
) -> bool:
    """Run the loss+gradient forward with the cluster kernel when it applies; False (nothing done) if not.

    Same outputs as the Triton ``_ce_fwd_kernel`` with ``GRAD``: per-row loss, lse and z-loss terms, the
    gradient scaled by ``red``'s reduction factors in ``grad`` (which may be ``logits``) and ``applied`` = 1.
    """
    has_z = opts.lse_square_scale > 0.0
    if has_class_weight or entropy or (has_z and zloss is None) or not enabled():
        return False
    tensors = [logits, target, red, loss, lse, grad, applied] + ([zloss] if zloss is not None else [])
    if not _direct(*tensors):
        return False
    n_rows, n_cols = logits.shape
    p = plan(n_rows, n_cols, logits.dtype, logits.device)
    if p is None or grad.dtype != logits.dtype or target.dtype != torch.int64 or not target.is_contiguous():
        return False
    vec = p["vec"]
    if logits.stride(1) != 1 or grad.stride(1) != 1 or logits.stride(0) % vec or grad.stride(0) % vec:
        return False
    if logits.data_ptr() % 16 or grad.data_ptr() % 16:
        return False
    if any(not t.is_contiguous() for t in (loss, lse, applied, *([zloss] if zloss is not None else []))):
        return False
    index = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    if not _usable(index):
        return False
    from lck_runtime.jit import F32, I32, I64

    kernel = _kernel(logits.dtype, opts.softcap > 0.0, index)
    shared = p["shared"]
    rkey = (id(kernel), index, p["threads"], p["cluster"], shared)
    resident = _RESIDENT.get(rkey)
    if resident is None:
        with torch.cuda.device(index):
            resident = kernel.max_active_clusters(p["threads"], p["cluster"], shared_mem=shared) or 0
        _RESIDENT[rkey] = resident
    if resident <= 0:
        return False
    ignore_index, eps, z_scale, scale, softcap = opts.scalars()
    clusters = min(n_rows, resident)
    with torch.cuda.device(index):
        kernel.launch(
            clusters * p["cluster"],
            p["threads"],
            [
                logits, I64(logits.stride(0)), grad, I64(grad.stride(0)), target, red, loss,
                zloss if zloss is not None else lse, lse, applied, I32(n_rows), I64(n_cols), I64(p["chunk"]),
                I32(p["vpt"]), I64(ignore_index), F32(eps), F32(z_scale), F32(scale), F32(softcap),
                I32(int(opts.label_smoothing > 0.0)), I32(int(has_z)),
            ],
            shared_mem=shared,
            cluster=p["cluster"],
        )  # fmt: skip
    return True
