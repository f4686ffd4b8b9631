"""Megatron-Core's output layer and language-model loss as one fused linear cross entropy.

A Megatron language model called with ``labels`` runs ``logits, _ = self.output_layer(hidden, weight=...)``
(``[s, b, vocab/tp]``, materialised in the model's dtype) and then ``self.compute_language_model_loss(labels,
logits)``, which returns the float32 per-token loss ``[b, s]``. At a 128k vocabulary those logits, their
float32 copies and their gradients are the largest tensors of the step. With
``apply_lck_to_megatron(linear_cross_entropy=True)`` the method that runs those two calls (``GPTModel._postprocess``;
``HybridModel.forward`` and ``MambaModel.forward`` where the installed version defines them) is wrapped: on a call
that lck takes, the output layer computes the loss itself with lck's fused linear cross entropy
(``lck_kernels.fused_linear_scaled_cross_entropy`` at TP=1, ``vocab_parallel_fused_linear_scaled_cross_entropy``
over the output layer's tensor-parallel group otherwise; see :mod:`lck_megatron._fused_loss` for the schedule)
and ``compute_language_model_loss`` hands that loss back in Megatron's ``[b, s]`` layout. The output layer is
still called through ``nn.Module.__call__`` (its hooks run), with the weight Megatron passes (the shared
embedding weight when input and output weights are tied). Under sequence parallelism the hidden states are
gathered over the group first, and their gradient split back.

Megatron's own path runs, with one log line per reason, for calls without labels (logits wanted), multi-token
prediction, inference contexts, an ``output_processor``, MuP logit scaling, the config logger, deferred
embedding weight gradients, CPU or fine-grained activation offloading, an overridden
``compute_language_model_loss``, an output layer that is not a bias-free ``ColumnParallelLinear`` (the
MXFP8 TE head, for one), logits gathered over TP (``parallel_output=False``), dtypes lck's kernels do not
take and devices where Triton cannot run. Argument positions are read from the installed methods with
``inspect.signature`` once, when the patch is applied.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lck_megatron._fused_loss import GatherSequence, ScheduleChoice, per_token_loss
from lck_megatron._support import LogOnce, kernel_unavailable_reason

# (module, class, method that calls the output layer and then compute_language_model_loss)
HOMES = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel", "_postprocess"),
    ("megatron.core.models.hybrid.hybrid_model", "HybridModel", "forward"),
    ("megatron.core.models.mamba.mamba_model", "MambaModel", "forward"),
)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_READ = ("labels", "inference_context", "inference_params", "output_processor", "runtime_gather_output")
_CONFIG_FLAGS = ("defer_embedding_wgrad_compute", "cpu_offloading", "fine_grained_activation_offloading")


class _Args:
    """Where a wrapped method takes the arguments lck reads (every one defaults to None in Megatron)."""

    def __init__(self, fn: Callable[..., Any]):
        params = list(inspect.signature(fn).parameters)[1:]  # without self
        self.positions = {name: params.index(name) for name in _READ if name in params}

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = self.positions.get(name)
        return args[i] if i is not None and i < len(args) else None


class _Call:
    """One model call that lck takes: its labels, then the loss the output layer computed."""

    __slots__ = ("consumed", "labels", "loss")

    def __init__(self, labels: torch.Tensor):
        self.labels, self.loss, self.consumed = labels, None, False


class LinearCrossEntropyRoute:
    """The wrapper factory and its bookkeeping: ``calls`` counts the model calls lck took (``"lck"``) and
    handed to Megatron (``"megatron"``); ``fallback_reasons`` holds the reasons logged."""

    def __init__(self) -> None:
        from megatron.core.models.common.language_module.language_module import LanguageModule
        from megatron.core.tensor_parallel import ColumnParallelLinear

        self._loss_method = LanguageModule.compute_language_model_loss
        self._column_parallel = ColumnParallelLinear
        self._config_logger = _optional("megatron.core.config_logger", "has_config_logger_enabled")
        self._inference_mode = _optional("megatron.core.inference.utils", "InferenceMode")
        self._log = LogOnce()
        self.choice = ScheduleChoice()
        self.calls = {"lck": 0, "megatron": 0}

    @property
    def fallback_reasons(self) -> frozenset[str]:
        return self._log.seen

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any] | None:
        """``original`` (a model method) taking lck's route when it can; None if it takes no ``labels``."""
        spec = _Args(original)
        if "labels" not in spec.positions:
            return None

        @functools.wraps(original)
        def method(model: Any, *args: Any, **kwargs: Any) -> Any:
            reason = self._megatron_reason(model, spec, args, kwargs)
            if reason is None:
                return self._run(model, original, args, kwargs, spec.get(args, kwargs, "labels"))
            if reason:  # "" is a stage without an output layer: nothing to route, nothing to log
                self._fall_back(type(model).__name__, reason)
            return original(model, *args, **kwargs)

        method.lck_route = self  # type: ignore[attr-defined]
        return method

    def _fall_back(self, where: str, reason: str) -> None:
        self._log(f"lck: {where}'s output layer and loss are handled by Megatron because {reason}")
        if not torch.compiler.is_compiling():
            self.calls["megatron"] += 1

    def _megatron_reason(self, model: Any, spec: _Args, args: tuple, kwargs: dict) -> str | None:
        if not getattr(model, "post_process", True):
            return ""
        if spec.get(args, kwargs, "labels") is None:
            return "it was called without labels (the logits are returned)"
        if torch.compiler.is_compiling():
            return "torch.compile is tracing it"
        config = model.config
        if getattr(config, "mtp_num_layers", None) or getattr(model, "mtp_process", False):
            return "multi-token prediction is on (mtp_num_layers)"
        if spec.get(args, kwargs, "inference_context") is not None or spec.get(
            args, kwargs, "inference_params"
        ):
            return "it runs with an inference context"
        if self._inference_mode is not None and self._inference_mode.is_active():
            return "Megatron's inference mode is active"
        if spec.get(args, kwargs, "output_processor") is not None:
            return "an output_processor is given"
        if getattr(config, "use_mup", False):
            return "MuP scales its logits (use_mup=True)"
        if self._config_logger is not None and self._config_logger(config):
            return "the config logger records its logits"
        for flag in _CONFIG_FLAGS:
            if getattr(config, flag, False):
                return f"config.{flag} is set"
        if type(model).compute_language_model_loss is not self._loss_method:
            return f"{type(model).__name__} overrides compute_language_model_loss"
        if "compute_language_model_loss" in vars(model):
            return "compute_language_model_loss is replaced on the model instance"
        layer = getattr(model, "output_layer", None)
        if type(layer) is not self._column_parallel:
            return f"its output layer is a {type(layer).__name__}, not a ColumnParallelLinear"
        if "forward" in vars(layer):
            return "its output layer's forward is replaced on the instance"
        if getattr(layer, "bias", None) is not None:
            return "its output layer has a bias"
        if getattr(layer, "explicit_expert_comm", False) or getattr(layer, "disable_grad_reduce", False):
            return "its output layer skips Megatron's gradient reduction"
        if getattr(layer, "gtp_remat_size", 1) > 1:
            return "its output layer's weight is GTP-sharded"
        gather = spec.get(args, kwargs, "runtime_gather_output")
        if (layer.gather_output if gather is None else gather) and _size(layer.tp_group) > 1:
            return "its logits are gathered over tensor parallelism (parallel_output=False)"
        return None

    def _run(self, model: Any, original: Callable[..., Any], args: tuple, kwargs: dict, labels: Any) -> Any:
        layer = model.output_layer
        call = _Call(labels)
        # Instance attributes for this call only: nn.Module.__call__ (and its hooks) reaches the output
        # layer's forward through self.forward, and the model calls self.compute_language_model_loss.
        layer.forward = functools.partial(self._output_layer_forward, layer, call, type(model).__name__)
        model.compute_language_model_loss = functools.partial(self._loss, model, call)
        try:
            out = original(model, *args, **kwargs)
        finally:
            vars(layer).pop("forward", None)
            vars(model).pop("compute_language_model_loss", None)
        if call.loss is not None and not call.consumed:
            raise RuntimeError(
                f"lck: {type(model).__name__} did not pass its output layer's result to "
                "compute_language_model_loss; revert lck's linear_cross_entropy patch for this model"
            )
        return out

    def _output_layer_forward(
        self,
        layer: Any,
        call: _Call,
        where: str,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        megatron_forward = type(layer).forward
        w = weight if weight is not None else layer.weight
        reason = "" if call.loss is not None else _tensor_reason(input_, w)
        if reason is not None:
            if reason:
                self._fall_back(where, reason)
            return megatron_forward(layer, input_, weight, runtime_gather_output)
        group = layer.tp_group
        tp = _size(group)
        x = input_
        if layer.sequence_parallel and tp > 1:
            x = GatherSequence.apply(x, group)
        labels = call.labels
        if x.dim() != 3 or tuple(labels.shape) != (x.shape[1], x.shape[0]):
            raise ValueError(
                f"lck linear cross entropy: labels have shape {tuple(labels.shape)}, expected [b, s] = "
                f"{(x.shape[1], x.shape[0]) if x.dim() == 3 else '?'} for hidden states {tuple(x.shape)}"
            )
        s, b, h = x.shape
        target = labels.t().reshape(-1)  # [s, b] order, as the hidden states
        loss = per_token_loss(x.reshape(s * b, h), w, target, group if tp > 1 else None, self.choice, layer)
        call.loss = loss.view(s, b)
        if not torch.compiler.is_compiling():
            self.calls["lck"] += 1
        return call.loss, None

    def _loss(self, model: Any, call: _Call, labels: torch.Tensor, logits: Any) -> torch.Tensor:
        if call.loss is not None and logits is call.loss:
            call.consumed = True
            return logits.transpose(0, 1).contiguous()  # [s, b] => [b, s], as Megatron returns it
        if call.loss is not None:
            raise RuntimeError(
                f"lck: {type(model).__name__} changed its output layer's result before the loss; revert lck's "
                "linear_cross_entropy patch for this model"
            )
        return self._loss_method(model, labels, logits)


def _tensor_reason(x: Any, w: Any) -> str | None:
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "its hidden states or output weight are not tensors"
    if x.dtype not in _SUPPORTED_DTYPES:
        return f"its hidden states have dtype {x.dtype}"
    if w.dtype != x.dtype:
        return f"its output weight has dtype {w.dtype} and its hidden states {x.dtype}"
    return kernel_unavailable_reason(x)


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _optional(module: str, attr: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None
