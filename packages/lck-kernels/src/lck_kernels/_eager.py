"""The eager fast path every op family shares: op registration, and kernels launched cheaply on the host.

- ``define_op``: registers a ``torch.library`` op backed by Triton kernels (``triton_op`` on GPUs,
  ``custom_op`` + fake under the interpreter; see its docstring for why) and returns an ``EagerOp`` whose
  plain eager calls run the Python body directly, without the dispatcher.
- ``direct()`` / ``plain_eager``: whether a call may skip the dispatcher (no compile, mode, fake or
  subclass tensor is looking).
- ``Launch``: one kernel at one launch configuration (constexprs and options fixed, cached by the caller per
  shape, dtype, device and options). In a direct call it launches through the compiled kernel's own ``run``,
  fetched once per argument specialisation, instead of Triton's generic ``JITFunction.run`` (argument
  binding, specialisation, cache-key string and launch-metadata per call); elsewhere it goes through
  ``torch.library.wrap_triton`` (so ``torch.compile`` sees the kernel) or the interpreter.

Why: the GPU work of an RMSNorm or SwiGLU at training shapes is 0.05-0.1 ms; the generic launch path and the
dispatcher cost the host several times that per call (issue 28), so a training loop waited on Python.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lck_kernels._common import interpreting

try:  # torch's switch between launching a wrapped Triton kernel directly and through its tracing HOP
    from torch._library.triton import set_wrap_triton_enabled as _set_wrap_triton_enabled
except ImportError:  # pragma: no cover - a torch without it: every call goes through the op
    _set_wrap_triton_enabled = None


class _State(threading.local):
    direct = False  # True while an op body runs straight from eager code (no dispatcher, no tracer)


_state = _State()
# A parameter is a plain tensor to the kernels (its __torch_function__ is torch's default): modules'
# weights take the direct path too.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct() -> bool:
    """True inside an op body called directly from eager code (see :class:`EagerOp`)."""
    return _state.direct


def plain_eager(args: Sequence[Any]) -> bool:
    """True when nothing but our own code needs to see this call: eager (not compiling), no dispatch or
    function mode, no functorch transform, and every tensor argument a plain ``torch.Tensor`` or
    ``nn.Parameter`` (no fake, functional or other subclass tensors)."""
    if _set_wrap_triton_enabled is None or torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return False
    return True


def run_direct(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with kernels launched directly (the caller has checked :func:`plain_eager`)."""
    if _state.direct:
        return fn(*args)
    _state.direct = True
    try:
        return fn(*args)
    finally:
        _state.direct = False


def _c_apply(fn_cls: type) -> Callable[..., Any]:
    # torch.autograd.Function.apply is a Python wrapper (default-argument binding for setup_context-style
    # Functions, functorch's dead-wrapper unwrap) around this C classmethod; neither applies to a plain eager
    # call of a forward(ctx, ...) Function. A torch without it keeps the wrapper.
    base = getattr(torch._C, "_FunctionBase", None)
    raw = base.__dict__.get("apply") if base is not None else None
    return raw.__get__(None, fn_cls) if raw is not None else fn_cls.apply


def fast_apply(fn_cls: type) -> Callable[..., Any]:
    """``fn_cls.apply`` for an op's functional API: in a plain eager call (:func:`plain_eager`) the Function
    runs through the C ``apply`` with its kernels launched directly (one thread-local switch for the whole
    forward instead of one check per inner op); anything else goes through ``fn_cls.apply`` as usual."""
    c_apply = _c_apply(fn_cls)

    def apply(*args: Any) -> Any:
        if _state.direct or plain_eager(args):
            return run_direct(c_apply, *args)
        return fn_cls.apply(*args)

    return apply


def define_op(
    name: str,
    impl: Callable[..., Any],
    *,
    mutates_args: Iterable[str] = (),
    fake: Callable[..., Any],
) -> EagerOp:
    """Register ``impl`` (which launches Triton kernels through :class:`Launch`) as the op ``name``.

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


def define_op_pair(
    name: str,
    body: Callable[[str, bool], Callable[..., Any]],
    fake: Callable[[str, bool], Callable[..., Any]],
    *,
    mutates: str,
    returns: tuple[str, str],
) -> tuple[EagerOp, EagerOp]:
    """An out-of-place op ``name`` and its in-place twin ``name + "_"`` (which overwrites argument
    ``mutates``) from one body: ``body(op_name, in_place)`` and ``fake(op_name, in_place)`` return the two
    implementations, with the same annotated parameters; ``returns`` are the two return annotations (torch
    reads each op's schema from them)."""
    ops = []
    for in_place in (False, True):
        op_name = name + "_" if in_place else name
        impl = body(op_name, in_place)
        impl.__annotations__["return"] = returns[in_place]
        mutated = (mutates,) if in_place else ()
        ops.append(define_op(op_name, impl, mutates_args=mutated, fake=fake(op_name, in_place)))
    return ops[0], ops[1]


def eager(op: Any, mutates_args: Iterable[str] = ()) -> Any:
    """An existing ``torch.library.custom_op`` as an :class:`EagerOp` (its Python body runs directly in
    plain eager calls), or the op itself on a torch whose custom ops do not expose their body."""
    fn = getattr(op, "_init_fn", None)
    if fn is None:
        return op
    params = list(inspect.signature(fn).parameters)
    return EagerOp(op, fn, tuple(params.index(m) for m in mutates_args))


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
        if _state.direct:  # inside a direct call already (e.g. a Function's forward run by fast_apply)
            out = self._impl(*args, **kwargs)
        elif kwargs or not EagerOp.direct or not plain_eager(args):
            return self.op(*args, **kwargs)
        else:
            out = run_direct(self._impl, *args)
        for i in self._mutated:
            torch.autograd.graph.increment_version(args[i])
        return out


# ---------------------------------------------------------------------------------------------------------
# Launches
# ---------------------------------------------------------------------------------------------------------


def _fast_launch_available() -> bool:
    if interpreting() or os.environ.get("LCK_KERNELS_FAST_LAUNCH", "1") == "0":
        return False
    try:  # what the fast path relies on; any Triton or torch without it keeps the generic path
        import triton
        from triton import knobs  # noqa: F401

        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
        return (major, minor) >= (3, 5) and hasattr(torch._C, "_cuda_getCurrentRawStream")
    except Exception:
        return False


_FAST = _fast_launch_available()
if _FAST:
    from triton import knobs as _knobs

    _hooks = _knobs.runtime
    _raw_stream = torch._C._cuda_getCurrentRawStream
    _current_device = torch._C._cuda_getDevice


def _hook_set(hook: Any) -> bool:
    # Triton >= 3.6 keeps each launch hook as a chain object that is never None (empty when no hook is
    # installed); older releases keep None or a callable.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def launch_hooked() -> bool:
    """True when a Triton launch hook (a profiler such as proton) is installed: launches then take Triton's
    own path, which calls it."""
    return _FAST and (_hook_set(_hooks.launch_enter_hook) or _hook_set(_hooks.launch_exit_hook))


_I32 = 1 << 31
_LAUNCHES: dict[tuple[Any, ...], Launch] = {}


def launch_for(fn: Any, **meta: Any) -> Launch:
    """The :class:`Launch` of ``fn`` at ``meta``, one per configuration for the life of the process (so
    its compiled handles are shared by every shape that uses the configuration)."""
    key = (fn, *sorted(meta.items()))
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = Launch(fn, **meta)
    return launch


def _specialisation(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What Triton specialises a compiled kernel on, or finer: each tensor's dtype and 16-byte alignment,
    each int's equality to 1, divisibility by 16 and 32-bit range. Two calls with equal tuples run the same
    compiled kernel."""
    key = []
    for a in args:
        if type(a) is int:
            key.append((a == 1, (a & 15) == 0, -_I32 <= a < _I32))
        elif isinstance(a, torch.Tensor):  # parameters too (a weight is usually one)
            key.append((a.dtype, (a.data_ptr() & 15) == 0))
        elif isinstance(getattr(a, "base", None), torch.Tensor) and hasattr(a, "block_shape"):
            # A host TMA descriptor (triton.tools.tensor_descriptor.TensorDescriptor): its element type,
            # block and padding, and its shape and strides as ints.
            dims = (*a.shape, *a.strides)
            key.append((a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None), (a.base.data_ptr() & 15) == 0,
                        tuple((d == 1, (d & 15) == 0, -_I32 <= d < _I32) for d in dims)))  # fmt: skip
        else:
            key.append(type(a))
    return tuple(key)


class Launch:
    """One Triton kernel at one launch configuration: ``meta`` (constexprs and options such as
    ``num_warps``) fixed. Create once per configuration and cache it; call ``launch(grid, *args)`` with the
    runtime arguments in the kernel's order (everything before its constexprs).

    In a direct eager call on a GPU the kernel runs through its compiled handle (Triton's launcher, with
    the arguments Triton itself would pass it), obtained from the first normal launch of each argument
    specialisation; a launch hook (profilers such as proton), the interpreter or an older Triton keep the
    normal ``kernel[grid](...)`` path, and calls that are traced go through ``torch.library.wrap_triton``.
    """

    __slots__ = ("_compiled", "_tail", "fn", "meta")

    def __init__(self, fn: Any, **meta: Any):
        self.fn, self.meta = fn, meta
        self._tail: tuple[Any, ...] | None = None
        self._compiled: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        if _state.direct:
            self.raw(grid, *args)
        elif interpreting():
            self.fn[grid](*args, **self.meta)
        else:  # inside a triton_op being traced or dispatched: let torch see the kernel
            torch.library.wrap_triton(self.fn)[grid](*args, **self.meta)

    def raw(self, grid: tuple[int, ...], *args: Any) -> None:
        """Launch now, whatever is tracing: for plain eager calls and opaque ``custom_op`` bodies (which
        only ever see real tensors)."""
        if not _FAST or launch_hooked():
            self.fn[grid](*args, **self.meta)
            return
        device = _current_device()
        key = (device, *_specialisation(args))
        handle = self._compiled.get(key)
        if handle is None:
            compiled = self.fn[grid](*args, **self.meta)
            self._remember(key, compiled, len(args))
            return
        run, function, packed = handle
        n = len(grid)
        run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(device), function, packed,
            None, None, None, *args, *self._tail,
        )  # fmt: skip

    def _remember(self, key: tuple[Any, ...], compiled: Any, n_args: int) -> None:
        # Triton's launcher takes every argument in signature order, constexprs included (triton >= 3.3):
        # the trailing constexprs are this configuration's, fixed.
        names = getattr(self.fn, "arg_names", None)
        if names is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return
        try:
            self._tail = tuple(self.meta[name] for name in names[n_args:])
        except KeyError:  # a defaulted argument left out: keep the generic path for this kernel
            return
        self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
