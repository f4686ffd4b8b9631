"""Routes Megatron-Core's vocab-parallel cross entropy (plain and fused) to lck's kernels.

Megatron computes the language-model loss with one of two functions, both returning the per-token
loss ``[s, b]`` (float32) of logits ``[s, b, vocab/tp]`` sharded contiguously over the tensor-parallel
group:

- ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target,
  label_smoothing=0.0[, tp_group=None])`` (``tp_group`` appeared after 0.16), and
- ``megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy(
  vocab_parallel_logits, target, tp_group)`` (``cross_entropy_loss_fusion=True``, native impl).

:class:`LckVocabParallelCrossEntropy` replaces either one with the same signature (read from the
installed function with ``inspect.signature``). With a tensor-parallel group of one rank it runs
``lck_kernels.cross_entropy`` (no collectives); with more it runs
``lck_kernels.vocab_parallel_cross_entropy`` over the group. Megatron's label smoothing spreads the
smoothing mass over the *other* classes (``alpha·K/(K−1)`` in torch's convention); the route converts,
so losses match Megatron's. At TP>1 Megatron computes the smoothing term over each rank's vocabulary
shard alone, which no unsharded loss reproduces: those calls stay with Megatron. Differences: lck treats a target of ``-100`` as ignored (loss and gradient
0) where Megatron has no ignore index, and the fused route returns gradients in the logits' dtype where
Megatron's fused function always returns bfloat16.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from lck_megatron._support import LogOnce, is_default, kernel_unavailable_reason

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KNOWN_PARAMS = ("vocab_parallel_logits", "target", "label_smoothing", "tp_group")


def _tensor_parallel_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(check_initialized=True)


class LckVocabParallelCrossEntropy:
    """A drop-in for one of Megatron's vocab-parallel cross-entropy functions.

    ``original`` is the Megatron function being replaced: it defines the accepted signature and
    receives the calls lck does not cover (logits on a device where Triton cannot run, an unsupported
    dtype, label smoothing outside torch's range after conversion, arguments of newer versions set to
    non-default values), with one log line per reason.

    Call: ``vocab_parallel_logits`` ``[..., vocab/tp]`` float32/float16/bfloat16, ``target`` an integer
    tensor of shape ``logits.shape[:-1]`` holding global vocabulary ids; returns the float32 per-token
    loss of ``target``'s shape. Collective over the tensor-parallel group (``tp_group`` when the
    signature has one and it is given, else Megatron's global tensor-parallel group) when it has more
    than one rank. Shapes and dtypes are validated (``ValueError``/``TypeError`` naming the argument)
    before anything runs.
    """

    def __init__(self, original: Callable[..., torch.Tensor]):
        if not callable(original):
            raise TypeError(
                f"LckVocabParallelCrossEntropy: original must be callable, got {type(original).__name__}"
            )
        while isinstance(original, LckVocabParallelCrossEntropy):
            original = original.original
        self.original = original
        self._signature = inspect.signature(original)
        functools.update_wrapper(self, original)  # name, docs and __wrapped__ (inspect follows it)
        self._log = LogOnce()
        self.calls = {"lck": 0, "fallback": 0}

    def __repr__(self) -> str:
        return (
            f"LckVocabParallelCrossEntropy(original={self.original.__module__}.{self.original.__qualname__})"
        )

    @property
    def fallback_reasons(self) -> frozenset[str]:
        return self._log.seen

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.original.__qualname__} (routed by lck): {exc}") from None
        bound.apply_defaults()
        a = bound.arguments
        names = list(self._signature.parameters)
        logits, target = a[names[0]], a[names[1]]
        label_smoothing = a.get("label_smoothing", 0.0)
        group = a.get("tp_group")
        _check_inputs(logits, target, label_smoothing)

        reason = self._fallback_reason(logits, a)
        tp = None
        smoothing = 0.0
        if reason is None:
            if group is None:
                group = _tensor_parallel_group()
            tp = torch.distributed.get_world_size(group)
            if tp > 1 and label_smoothing:
                # Megatron's own smoothing term at TP>1 averages log-probabilities over each rank's vocabulary
                # shard only (ranks then report different losses); lck's smooths over the whole vocabulary.
                # Keep the patch a drop-in: such calls stay with Megatron.
                reason = "label smoothing at TP>1 is computed per vocabulary shard by Megatron"
            else:
                smoothing, reason = _torch_label_smoothing(label_smoothing, logits.shape[-1] * tp)
        if reason is not None:
            self._log(f"lck: {self.original.__qualname__} is handled by Megatron because {reason}")
            if not torch.compiler.is_compiling():
                self.calls["fallback"] += 1
            return self.original(*args, **kwargs)

        if not torch.compiler.is_compiling():
            self.calls["lck"] += 1
        flat_logits = logits.reshape(-1, logits.shape[-1])
        if not flat_logits.is_contiguous():
            flat_logits = flat_logits.contiguous()
        flat_target = target.reshape(-1)
        if tp == 1:
            from lck_kernels import cross_entropy

            loss = cross_entropy(flat_logits, flat_target, label_smoothing=smoothing, reduction="none")
        else:
            from lck_kernels import vocab_parallel_cross_entropy

            loss = vocab_parallel_cross_entropy(
                flat_logits, flat_target, group, label_smoothing=smoothing, reduction="none"
            )
        return loss.float().view(target.shape)

    def _fallback_reason(self, logits: torch.Tensor, a: dict[str, Any]) -> str | None:
        if logits.dtype not in _SUPPORTED_DTYPES:
            return f"logits have dtype {logits.dtype}"
        for name, param in self._signature.parameters.items():
            if name in _KNOWN_PARAMS or name not in a:
                continue
            if not is_default(a[name], param.default):
                return f"argument {name!r} is set to a non-default value lck does not implement"
        return kernel_unavailable_reason(logits)


def _check_inputs(logits: Any, target: Any, label_smoothing: Any) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"vocab_parallel_logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"vocab_parallel_logits must be [..., vocab/tp] with vocab/tp > 0, got {tuple(logits.shape)}"
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target has shape {tuple(target.shape)} but vocab_parallel_logits has shape {tuple(logits.shape)}; "
            "expected target.shape == logits.shape[:-1]"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class ids, got dtype {target.dtype}")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but vocab_parallel_logits is on {logits.device}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")


def _torch_label_smoothing(megatron_smoothing: float, vocab_size: int) -> tuple[float, str | None]:
    """Megatron's label smoothing as torch's (smoothing mass over all K classes), or a fallback reason.

    Megatron gives ``alpha / (K − 1)`` to every wrong class; torch gives ``alpha' / K`` to every class.
    The two losses agree when ``alpha' = alpha · K / (K − 1)``, which torch accepts while it is ≤ 1.
    """
    alpha = float(megatron_smoothing)
    if alpha == 0.0:
        return 0.0, None
    if vocab_size < 2:
        return 0.0, f"label smoothing over a vocabulary of {vocab_size} class"
    converted = alpha * vocab_size / (vocab_size - 1)
    if converted > 1.0:
        return 0.0, f"label_smoothing={alpha} exceeds (K-1)/K for K={vocab_size}"
    return converted, None
