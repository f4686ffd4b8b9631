"""The RMSNorm that Megatron-Core's norm slots receive when lck's patch is applied.

Megatron's local (non-Transformer-Engine, non-Apex) specs fill every norm slot with
``WrappedTorchNorm``: a factory whose constructor returns ``torch.nn.RMSNorm`` (or ``LayerNorm`` /
``L2Norm``) depending on ``config.normalization``. :class:`LckWrappedTorchNorm` is the same factory
with one change: for ``normalization == "RMSNorm"`` it returns :class:`LckMegatronRMSNorm`, a
``torch.nn.RMSNorm`` subclass whose forward runs ``lck_kernels.rms_norm``. Parameters, state-dict keys
and distributed-checkpoint layout stay those of ``torch.nn.RMSNorm``, so checkpoints move freely
between stock and patched models. Every other configuration is built by Megatron's own factory, with
its own checks. TE and Apex norms are never touched: the patch rebinds only ``WrappedTorchNorm``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lck_megatron._support import LogOnce, kernel_unavailable_reason

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LckMegatronRMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by lck's Triton kernel over the last dimension.

    Same constructor, parameters and numerics as ``torch.nn.RMSNorm`` (``llama`` casting: normalise in
    float32, cast to the input dtype, then multiply by the weight). Input: ``[..., hidden]`` with
    ``hidden == normalized_shape``; output: the same shape and dtype. Cases the kernel does not take
    (no affine weight, a multi-dimensional ``normalized_shape``, a weight dtype different from the
    input's, a device where Triton cannot run) run ``torch.nn.RMSNorm.forward``, with one log line per
    reason.
    """

    # Read by Megatron's FSDP adapter, which otherwise knows norms by class name only: the weight is
    # replicated across tensor-parallel ranks, like torch.nn.RMSNorm's.
    tensor_model_parallel = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._log = LogOnce()
        self.calls = {"lck": 0, "torch": 0}

    def _torch_reason(self, x: torch.Tensor) -> str | None:
        if self.weight is None:
            return "elementwise_affine=False"
        if len(self.normalized_shape) != 1:
            return f"normalized_shape {tuple(self.normalized_shape)} spans several dimensions"
        if x.dtype not in _SUPPORTED_DTYPES:
            return f"input dtype {x.dtype}"
        if self.weight.dtype != x.dtype:
            return f"weight dtype {self.weight.dtype} differs from input dtype {x.dtype}"
        return kernel_unavailable_reason(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"LckMegatronRMSNorm: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or tuple(x.shape[-len(self.normalized_shape) :]) != tuple(self.normalized_shape):
            raise ValueError(
                f"LckMegatronRMSNorm: x has shape {tuple(x.shape)} but the norm was built for trailing "
                f"dimensions {tuple(self.normalized_shape)}"
            )
        reason = self._torch_reason(x)
        if reason is not None:
            self._log(f"LckMegatronRMSNorm: running torch.nn.RMSNorm because {reason}")
        if reason is not None or x.device != self.weight.device:  # a device mismatch: torch's own error
            if not torch.compiler.is_compiling():
                self.calls["torch"] += 1
            return super().forward(x)

        # Lazy: importing lck_megatron must not import Triton. The package's top binds the function (after
        # its subpackage of the same name), and only top-level names are lck-kernels' public API.
        from lck_kernels import rms_norm

        if not torch.compiler.is_compiling():
            self.calls["lck"] += 1
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # torch's own default
        y = x if x.is_contiguous() else x.contiguous()
        return rms_norm(y, self.weight, eps=eps, offset=0.0, casting_mode="llama")


def megatron_wrapped_torch_norm() -> type:
    """Megatron-Core's own ``WrappedTorchNorm``, even while lck's patch is applied."""
    from lck_megatron._bindings import original

    return original("megatron.core.transformer.torch_norm", "WrappedTorchNorm")


class LckWrappedTorchNorm:
    """Megatron's ``WrappedTorchNorm`` factory, building :class:`LckMegatronRMSNorm` for RMSNorm configs.

    Called like ``WrappedTorchNorm(config, hidden_size, eps=1e-5, ...)`` (arguments are matched against
    the installed megatron-core's signature with ``inspect.signature``, so extra parameters of any
    version pass through). For ``config.normalization == "RMSNorm"`` with none of the options torch
    norms reject (zero-centred gamma, persistent or memory-efficient layer norm, sequence parallelism),
    returns ``LckMegatronRMSNorm(hidden_size, eps=eps)``; otherwise returns what Megatron's factory
    returns (and raises what it raises).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:  # type: ignore[misc]
        original = megatron_wrapped_torch_norm()
        bound = inspect.signature(original).bind(*args, **kwargs)  # TypeError exactly as Megatron's
        bound.apply_defaults()
        params = bound.arguments
        config = params.get("config")
        hidden_size = params.get("hidden_size")
        eps = params.get("eps", 1e-5)
        if config is None or not _lck_takes(config, params):
            return original(*args, **kwargs)
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size <= 0:
            raise ValueError(f"LckWrappedTorchNorm: hidden_size must be a positive int, got {hidden_size!r}")
        return LckMegatronRMSNorm(normalized_shape=hidden_size, eps=eps)


def _lck_takes(config: Any, params: dict[str, Any]) -> bool:
    if getattr(config, "normalization", None) != "RMSNorm":
        return False
    if params.get("persist_layer_norm") or params.get("zero_centered_gamma"):
        return False
    return not any(
        getattr(config, flag, False)
        for flag in (
            "layernorm_zero_centered_gamma",
            "persist_layer_norm",
            "sequence_parallel",
            "memory_efficient_layer_norm",
        )
    )
