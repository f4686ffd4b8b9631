"""``LckMegatronSwiGLU``: lck's fused gate-up SwiGLU behind Megatron-Core's ``bias_swiglu_impl`` call.

Megatron's dense MLP (and the shared experts of its MoE layer) computes its activation as
``bias_swiglu_impl(intermediate, bias, fp8_input_store, cpu_offload_input)`` on the output of
``linear_fc1``: one ``[s, b, 2·ffn_local]`` (or ``[tokens, 2·ffn_local]``) buffer whose last dimension
holds the gate in ``[0, n)`` and the up projection in ``[n, 2n)``. This module takes the same call,
positionally, and runs ``lck_kernels.swiglu_packed`` on that buffer in place of Megatron's TorchScript
fusion: no chunk copies, one kernel forward and one backward.

What lck does not cover is handed to ``fallback_impl`` (Megatron's own function by default), with one
log line per reason: a bias, ``fp8_input_store=True``, ``cpu_offload_input=True``, arguments of newer
Megatron versions set to non-default values, and tensors on a device where Triton cannot run. With
``fallback_impl=None`` those calls raise ``ValueError`` instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lck_megatron._support import LogOnce, is_default, kernel_unavailable_reason

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The parameters Megatron's bias_swiglu_impl has had since 0.16; anything else is a newer addition.
_KNOWN_PARAMS = ("input", "bias", "fp8_input_store", "cpu_offload_input")


class _MegatronDefault:
    def __repr__(self) -> str:
        return "<megatron's bias_swiglu_impl>"


MEGATRON_DEFAULT: Any = _MegatronDefault()


def megatron_bias_swiglu_impl() -> Callable[..., torch.Tensor]:
    """Megatron-Core's own ``bias_swiglu_impl``, even while lck's patch is applied."""
    try:
        from megatron.core.fusions import fused_bias_swiglu
    except ImportError as exc:
        raise ImportError(
            "LckMegatronSwiGLU: fallback_impl defaults to megatron-core's bias_swiglu_impl, but "
            f"megatron-core is not importable ({exc}); install megatron-core, pass your own callable, "
            "or pass fallback_impl=None to raise on calls lck does not cover"
        ) from exc
    impl = fused_bias_swiglu.bias_swiglu_impl
    # While patched, the module attribute is an LckMegatronSwiGLU: its fallback is the original.
    while isinstance(impl, LckMegatronSwiGLU):
        impl = impl.fallback_impl
    return impl


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return None


class LckMegatronSwiGLU(nn.Module):
    """Drop-in for Megatron's ``bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)``.

    Args:
        fallback_impl: the callable that receives calls lck does not cover; by default Megatron-Core's
            ``bias_swiglu_impl`` (the original, also while :func:`apply_lck_to_megatron` is in effect).
            ``None`` makes those calls raise ``ValueError`` naming the argument instead.
        in_place: write the input gradient into the ``linear_fc1`` output buffer during backward
            (about 20% less activation memory). Opt-in: the buffer is overwritten, so a second backward
            through the same graph raises, and it must not be combined with activation recompute or
            CUDA-graph capture that replays the backward.

    Call: ``input`` is a 2-D ``[tokens, 2n]`` or 3-D ``[s, b, 2n]`` float32/float16/bfloat16 tensor whose
    last dimension is even; returns ``[tokens, n]`` / ``[s, b, n]`` in the input's dtype, like Megatron.
    A non-contiguous input is copied first (Megatron's own function rejects it). Validation errors
    (``TypeError``/``ValueError``) name the argument and happen before any kernel runs.
    """

    def __init__(
        self, fallback_impl: Callable[..., torch.Tensor] | None = MEGATRON_DEFAULT, in_place: bool = False
    ):
        super().__init__()
        if not isinstance(in_place, bool):
            raise TypeError(f"LckMegatronSwiGLU: in_place must be a bool, got {type(in_place).__name__}")
        if fallback_impl is MEGATRON_DEFAULT:
            fallback_impl = megatron_bias_swiglu_impl()
        elif fallback_impl is not None and not callable(fallback_impl):
            raise TypeError(
                "LckMegatronSwiGLU: fallback_impl must be a callable like megatron's bias_swiglu_impl or "
                f"None, got {type(fallback_impl).__name__}"
            )
        while isinstance(fallback_impl, LckMegatronSwiGLU):  # never fall back into ourselves
            fallback_impl = fallback_impl.fallback_impl
        # Kept out of nn.Module's registry: a callable module here is not a submodule of ours.
        self.__dict__["fallback_impl"] = fallback_impl
        self.in_place = in_place
        self._fallback_signature = _signature(fallback_impl) if fallback_impl is not None else None
        self._log = LogOnce()
        self.calls = {"lck": 0, "fallback": 0}

    def extra_repr(self) -> str:
        fb = self.fallback_impl
        name = "None" if fb is None else f"{getattr(fb, '__module__', '?')}.{getattr(fb, '__qualname__', fb)}"
        return f"in_place={self.in_place}, fallback_impl={name}"

    @property
    def fallback_reasons(self) -> frozenset[str]:
        """The distinct reasons for which calls were handed to the fallback (or refused) so far."""
        return self._log.seen

    def forward(
        self,
        input: torch.Tensor,
        bias: torch.Tensor | None,
        fp8_input_store: bool = False,
        cpu_offload_input: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"LckMegatronSwiGLU: input must be a torch.Tensor, got {type(input).__name__}")
        if input.dim() not in (2, 3):
            raise ValueError(
                "LckMegatronSwiGLU: input must be 2-D [tokens, 2n] or 3-D [s, b, 2n], got shape "
                f"{tuple(input.shape)}"
            )
        if input.shape[-1] % 2 != 0:
            raise ValueError(
                "LckMegatronSwiGLU: input's last dimension holds gate and up halves and must be even, got "
                f"{input.shape[-1]} (shape {tuple(input.shape)})"
            )
        if input.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"LckMegatronSwiGLU: input must be float32, float16 or bfloat16, got {input.dtype}"
            )
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(
                f"LckMegatronSwiGLU: bias must be a torch.Tensor or None, got {type(bias).__name__}"
            )

        reason = self._fallback_reason(input, bias, fp8_input_store, cpu_offload_input, args, kwargs)
        if reason is not None:
            self._hand_over(reason)
            return self.fallback_impl(input, bias, fp8_input_store, cpu_offload_input, *args, **kwargs)

        # Lazy: importing lck_megatron must not import Triton.
        from lck_kernels import swiglu_packed

        if not torch.compiler.is_compiling():
            self.calls["lck"] += 1
        y = input if input.is_contiguous() else input.contiguous()
        return swiglu_packed(y, in_place=self.in_place)

    def _fallback_reason(
        self,
        input: torch.Tensor,
        bias: torch.Tensor | None,
        fp8_input_store: Any,
        cpu_offload_input: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[str, str] | None:
        """(argument name, reason) when lck cannot take this call, else None."""
        if bias is not None:
            return "bias", "bias is not None (lck's fused SwiGLU has no bias term)"
        if fp8_input_store:
            return "fp8_input_store", "fp8_input_store=True (the input is kept in FP8 for backward)"
        if cpu_offload_input:
            return "cpu_offload_input", "cpu_offload_input=True (the input is marked for CPU offloading)"
        extra = self._non_default_extras(args, kwargs)
        if extra:
            return extra[0], f"argument {extra[0]!r} is set to a non-default value lck does not implement"
        device_reason = kernel_unavailable_reason(input)
        if device_reason is not None:
            return "input", device_reason
        return None

    def _non_default_extras(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """Names of arguments beyond Megatron 0.16's four whose values differ from the fallback's defaults."""
        if not args and not kwargs:
            return []
        sig = self._fallback_signature
        if sig is None:
            return [f"extra positional argument {i}" for i in range(len(args))] + sorted(kwargs)
        params = [p for p in sig.parameters.values() if p.name not in _KNOWN_PARAMS]
        named: dict[str, Any] = {}
        for i, value in enumerate(args):
            if i >= len(params) or params[i].kind not in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                raise TypeError(
                    f"LckMegatronSwiGLU: too many positional arguments ({4 + len(args)}) for the fallback's "
                    f"signature {sig}"
                )
            named[params[i].name] = value
        by_name = {p.name: p for p in params}
        accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        for name, value in kwargs.items():
            if name not in by_name and not accepts_var_kw:
                raise TypeError(
                    f"LckMegatronSwiGLU: unexpected keyword argument {name!r} (fallback signature {sig})"
                )
            named[name] = value
        out = []
        for name, value in named.items():
            p = by_name.get(name)
            if not is_default(value, p.default if p is not None else inspect.Parameter.empty):
                out.append(name)
        return out

    def _hand_over(self, reason: tuple[str, str]) -> None:
        """Log and count a call handed to ``fallback_impl``, or refuse it when there is none."""
        arg, why = reason
        if self.fallback_impl is None:
            self._log(f"LckMegatronSwiGLU: refused a call: {why}")
            raise ValueError(
                f"LckMegatronSwiGLU: {arg}: {why}, and fallback_impl=None; pass fallback_impl=megatron's "
                "bias_swiglu_impl (the default) to hand such calls to Megatron"
            )
        self._log(f"LckMegatronSwiGLU: handing calls to {self._fallback_name()} because {why}")
        if not torch.compiler.is_compiling():
            self.calls["fallback"] += 1

    def _fallback_name(self) -> str:
        fb = self.fallback_impl
        return f"{getattr(fb, '__module__', '?')}.{getattr(fb, '__qualname__', repr(fb))}"
