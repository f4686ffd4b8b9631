"""Small pieces every lck-kernels op shares: input checks, dtype tables, block heuristics, op registration.

Names here are stable (other op modules import them):

- ``FLOAT_DTYPES``, ``dtype_name``: the floating dtypes our Triton kernels take, and how errors print them.
- ``interpreting()``, ``kernel_device_type()``: whether Triton runs in its CPU interpreter
  (``TRITON_INTERPRET=1``), and so which device type kernel inputs must live on.
- ``check_tensor``, ``check_same_device``, ``check_choice``, ``check_float``, ``row_stride``, ``rows_view``: input
  validation raising ``TypeError`` / ``ValueError`` that name the op and the argument, say what was expected and
  what was given.
- ``cdiv``, ``next_power_of_2``, ``row_block``, ``warps_for``, ``num_sms``: launch-size arithmetic.
- ``tuned``, ``tuning``, ``config_cache``: per-kernel launch-parameter overrides (for the tuning script
  only), and the cache of launch configurations that steps aside while an override is set.

The op registration and the launches themselves (the eager fast path) are in ``_eager``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# Bytes one thread moves in one vectorised global access (LDG.128 / STG.128).
VECTOR_BYTES = 16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# Read once: Triton decides at import (``@triton.jit``) whether kernels are interpreted, so ours are
# whatever the environment said when this package was imported; and an environment read per check is
# three Python calls on a hot path.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRET


def kernel_device_type() -> str:
    """Device type that Triton kernel inputs must have: ``cuda``, or ``cpu`` under the interpreter."""
    return "cpu" if _INTERPRET else "cuda"


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def check_tensor(
    op: str,
    name: str,
    t: Any,
    *,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
    ndim: int | Iterable[int] | None = None,
    last_dim_contiguous: bool = False,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; return it unchanged.

    ``ndim`` is an int or a set of allowed ranks. The device must be the kernel device type
    (CUDA, or CPU under ``TRITON_INTERPRET=1``). Raises ``TypeError`` for a non-tensor or a wrong dtype,
    ``ValueError`` for a wrong device, rank or layout; the message names ``op`` and ``name``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{op}: {name} has dtype {dtype_name(t.dtype)}; expected one of {allowed}")
    want = kernel_device_type()
    if t.device.type != want:
        hint = " (TRITON_INTERPRET=1 runs kernels on CPU tensors)" if interpreting() else ""
        raise ValueError(f"{op}: {name} is on device {t.device}; expected a {want} tensor{hint}")
    if ndim is not None:
        allowed_ndim = {ndim} if isinstance(ndim, int) else set(ndim)
        if t.dim() not in allowed_ndim:
            want_ndim = " or ".join(str(d) for d in sorted(allowed_ndim))
            raise ValueError(f"{op}: {name} must be {want_ndim}-D, got shape {_shape(t)} ({t.dim()}-D)")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous, got shape {_shape(t)} with strides {tuple(t.stride())}; "
            f"call .contiguous() first"
        )
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} must have unit stride in its last dimension, got strides {tuple(t.stride())} "
            f"for shape {_shape(t)}; call .contiguous() first"
        )
    return t


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    """All tensors on one device (same type and index)."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")


def check_choice(op: str, name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {list(choices)}, got {value!r}")


def check_float(op: str, name: str, value: Any, *, minimum: float | None = None) -> None:
    """A finite Python number (not a bool), optionally ``>= minimum``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < float("inf")
    if not ok or (minimum is not None and not value >= minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{op}: {name} must be a finite number{bound}, got {value!r}")


def row_stride(t: torch.Tensor) -> int | None:
    """Stride between rows of ``t`` seen as ``[-1, t.shape[-1]]``, or ``None`` when that needs a copy.

    Pure stride arithmetic (no ``view`` attempt), so ``torch.compile`` traces it without graph breaks.
    """
    n = t.shape[-1]
    dims = [(t.shape[i], t.stride(i)) for i in range(t.dim() - 1) if t.shape[i] != 1]
    if not dims:
        return n  # a single row: any stride will do
    expect = dims[-1][1]
    for size, stride in reversed(dims):
        if stride != expect:
            return None
        expect = stride * size
    return dims[-1][1]


def rows_view(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, t.shape[-1]]`` view with unit column stride, without copying.

    Works for any tensor whose leading dimensions collapse into one row stride (contiguous tensors,
    a column slice of a wider buffer, ...). Raises ``ValueError`` naming ``name`` otherwise.
    """
    if t.dim() == 0:
        raise ValueError(f"{op}: {name} must have at least 1 dimension, got a scalar")
    n = t.shape[-1]
    if n > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} must have unit stride in its last dimension, got strides {tuple(t.stride())} "
            f"for shape {_shape(t)}; call .contiguous() first"
        )
    if t.numel() > 0 and row_stride(t) is None:
        raise ValueError(
            f"{op}: {name} with shape {_shape(t)} and strides {tuple(t.stride())} cannot be viewed as "
            f"[rows, {n}] without a copy; call .contiguous() first"
        )
    return t.view(-1, n) if t.numel() > 0 else t.reshape(-1, n)


# ---------------------------------------------------------------------------------------------------------
# Launch-size arithmetic
# ---------------------------------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def row_block(n_cols: int, max_block: int) -> int:
    """Block width for a row kernel: the whole row rounded up to a power of two, capped at ``max_block``."""
    return min(next_power_of_2(n_cols), max_block)


def warps_for(elements_per_program: int, element_size: int, *, lo: int = 1, hi: int = 16) -> int:
    """Warps for a memory-bound program touching ``elements_per_program`` elements per tensor.

    Aims at about four 16-byte vectors per thread per tensor: enough bytes in flight to cover HBM latency
    without spilling registers. Clamped to ``[lo, hi]`` and a power of two.
    """
    per_thread = 4 * max(1, VECTOR_BYTES // element_size)
    warps = next_power_of_2(max(1, elements_per_program // (32 * per_thread)))
    return max(lo, min(hi, warps))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small stand-in (4) for CPU tensors under the interpreter."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------------------
# Tuning overrides (used by benchmarks/tune_*.py; never needed in normal use)
# ---------------------------------------------------------------------------------------------------------

_OVERRIDES: dict[str, dict[str, int]] = {}


def config_cache(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Cache a launch-configuration function on its (hashable) arguments: shape, dtype, device, options.

    While any :func:`tuning` override is set the cache steps aside, so an override always takes effect
    and never leaks into the cache."""
    cached = functools.lru_cache(maxsize=1024)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        if _OVERRIDES:
            return fn(*args)
        try:
            return cached(*args)
        except TypeError:  # a symbolic size (torch.compile with dynamic shapes) is not hashable
            return fn(*args)

    wrapper.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return wrapper


def tuned(kernel: str, defaults: dict[str, int]) -> dict[str, int]:
    """``defaults`` updated with any override set for ``kernel`` by :func:`tuning`."""
    extra = _OVERRIDES.get(kernel)
    if not extra:
        return defaults
    unknown = set(extra) - set(defaults)
    if unknown:
        raise ValueError(
            f"tuning({kernel!r}): unknown parameter(s) {sorted(unknown)}; known: {sorted(defaults)}"
        )
    return {**defaults, **extra}


@contextlib.contextmanager
def tuning(kernel: str, **params: int) -> Iterator[None]:
    """Override launch parameters of ``kernel`` (e.g. ``"rms_norm_fwd"``) inside the block (eager only)."""
    prev = _OVERRIDES.get(kernel)
    _OVERRIDES[kernel] = {k: int(v) for k, v in params.items()}
    try:
        yield
    finally:
        if prev is None:
            _OVERRIDES.pop(kernel, None)
        else:
            _OVERRIDES[kernel] = prev
