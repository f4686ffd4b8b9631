"""Small pieces every lck-kernels op shares: input checks, dtype tables, block heuristics, op registration.

Names here are stable (other op modules import them):

- ``FLOAT_DTYPES``, ``dtype_name``: the floating dtypes our Triton kernels take, and how errors print them.
- ``interpreting()``, ``kernel_device_type()``: whether Triton runs in its CPU interpreter
  (``TRITON_INTERPRET=1``), and so which device type kernel inputs must live on.
- ``check_tensor``, ``check_same_device``, ``check_choice``, ``check_float``, ``row_stride``, ``rows_view``: input
  validation raising ``TypeError`` / ``ValueError`` that name the op and the argument, say what was expected and
  what was given.
- ``cdiv``, ``next_power_of_2``, ``row_block``, ``warps_for``, ``num_sms``: launch-size arithmetic.
- ``tuned``, ``tuning``: per-kernel launch-parameter overrides, for the tuning script only.
- ``define_op``: registers a ``torch.library`` op backed by Triton kernels (``triton_op`` on GPUs,
  ``custom_op`` + fake under the interpreter; see its docstring for why) and returns an ``EagerOp`` that
  skips the dispatcher's host cost in plain eager calls.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# Bytes one thread moves in one vectorised global access (LDG.128 / STG.128).
VECTOR_BYTES = 16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device_type() -> str:
    """Device type that Triton kernel inputs must have: ``cuda``, or ``cpu`` under the interpreter."""
    return "cpu" if interpreting() else "cuda"


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


# ---------------------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------------------


def launcher(kernel: Any) -> Any:
    """``kernel`` wrapped so that ``torch.compile`` traces its launch inside a ``triton_op``.

    Under the interpreter the kernel is returned as is (the op is an opaque ``custom_op`` there).
    """
    return kernel if interpreting() else torch.library.wrap_triton(kernel)


def define_op(
    name: str,
    impl: Callable[..., Any],
    *,
    mutates_args: Iterable[str] = (),
    fake: Callable[..., Any],
) -> Callable[..., Any]:
    """Register ``impl`` (which launches Triton kernels through :func:`launcher`) as the op ``name``.

    On GPUs this is ``torch.library.triton_op``: ``torch.compile`` traces into ``impl`` and sees the Triton
    kernels themselves, and ``impl`` doubles as the fake (meta) implementation, so ``fake`` is unused.
    Under ``TRITON_INTERPRET=1`` the kernels are plain Python functions that ``wrap_triton`` passes through
    unwrapped, so tracing ``impl`` with fake tensors would run the interpreter on them (and fail); there the
    op is an opaque ``torch.library.custom_op`` whose shapes come from ``fake``. Both forms pass
    ``torch.library.opcheck`` and compile with ``fullgraph=True``.

    Returns a callable (:class:`EagerOp`) that skips the dispatcher in plain eager calls; the op itself is
    ``torch.ops.lck.<name>`` as usual.
    """
    mutates = tuple(mutates_args)
    if interpreting():
        op = torch.library.custom_op(name, impl, mutates_args=mutates)
        op.register_fake(fake)
    else:
        op = torch.library.triton_op(name, impl, mutates_args=mutates)
    params = list(inspect.signature(impl).parameters)
    return EagerOp(op, impl, tuple(params.index(m) for m in mutates))


try:  # torch's switch between launching a wrapped Triton kernel directly and through its tracing HOP
    from torch._library.triton import set_wrap_triton_enabled as _set_wrap_triton_enabled
except ImportError:  # pragma: no cover - a torch without it: every call goes through the op
    _set_wrap_triton_enabled = None


def plain_eager(args: Sequence[Any]) -> bool:
    """True when nothing but our own code needs to see this call: eager (not compiling), no dispatch or
    function mode, no functorch transform, and every tensor argument a plain ``torch.Tensor`` (no fake,
    functional or subclass tensors)."""
    if _set_wrap_triton_enabled is None or torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))


class EagerOp:
    """A registered op that, in plain eager calls (:func:`plain_eager`), runs its Python body directly.

    Going through the dispatcher costs about 0.3 ms of host time per call on torch 2.11 (custom-op
    autograd and alias checks, a dynamo-disabled frame, the redispatch), measured with
    ``benchmarks/host_overhead.py``: several times the GPU time of a small RMSNorm or SwiGLU. The body is
    the same code the op runs, with Triton kernels launched directly as the op does in eager mode; what the
    dispatcher would add for a mutating op, a version-counter bump of each mutated argument (so autograd
    still refuses a saved tensor that was overwritten), is done here. Anything else (``torch.compile``,
    fake tensors, modes, subclasses, keyword arguments) takes the op.
    """

    # Class-wide switch, for measuring the dispatcher's cost (benchmarks/host_overhead.py): False sends
    # every call through the op.
    direct: bool = True

    def __init__(self, op: Any, impl: Callable[..., Any], mutated: tuple[int, ...]):
        self.op, self._impl, self._mutated = op, impl, mutated

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not EagerOp.direct or not plain_eager(args):
            return self.op(*args, **kwargs)
        with _set_wrap_triton_enabled(False):
            out = self._impl(*args)
        for i in self._mutated:
            torch.autograd.graph.increment_version(args[i])
        return out
