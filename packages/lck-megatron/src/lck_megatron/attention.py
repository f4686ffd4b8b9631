"""``LckDotProductAttention``: Megatron-Core's local core attention, computed by torch's SDPA.

Megatron's local layer specs (``LocalSpecProvider.core_attention``, the BERT, T5, ViT, LLaVA and ModelOpt
local specs) build ``DotProductAttention`` for the unfused attention core: it materialises the
``[b, heads, sq, sk]`` scores with ``baddbmm``, masks them, softmaxes and multiplies by the values.
:class:`LckDotProductAttention` is a subclass with the same constructor, parameters and state dict whose
forward runs ``torch.nn.functional.scaled_dot_product_attention`` instead, which on a GPU picks a flash,
cuDNN or memory-efficient kernel and never holds the scores.

It takes the cases whose math it reproduces (up to rounding): the module's own mask type (causal with
``sq == sk``, or ``sq == 1``; no mask) or an explicit boolean ``attention_mask`` (``True`` = masked, as
Megatron-LM's data loader builds it; it replaces the mask type, as in Megatron's unfused softmax), vanilla
softmax, no sliding window, no ``attention_bias``, no ``packed_seq_params``. Every other call runs Megatron's
own forward, with one log line per reason for the whole process.

An explicit mask goes to SDPA as an additive ``-10000`` where masked (Megatron's ``masked_fill`` value; the
memory-efficient kernel takes it, flash does not), built once per mask tensor: every layer of a step gets the
same one. A row whose every key is masked differs: Megatron averages all values there, SDPA weighs them by
the unmasked scores (both finite; such rows are padding, outside any loss). Context parallelism never
reaches the forward: Megatron's constructor rejects ``context_parallel_size > 1`` for this module.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from lck_megatron._support import LogOnce

_SDPA_GQA_DTYPES = (torch.float16, torch.bfloat16)
# One log line per reason across every layer: a 48-layer model would otherwise log each reason 48 times.
_log = LogOnce()
# The additive form of the last boolean mask seen: (weak reference to it, its version, dtype, additive mask).
# Dropped with the mask, so it holds no memory past the step.
_additive: list[Any] = [None]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Megatron's boolean ``mask`` (``True`` = masked) as SDPA's additive mask in ``dtype``: ``-10000`` where
    masked, ``0`` elsewhere; cached for the mask object (and its version)."""
    hit = _additive[0]
    if hit is not None and hit[0]() is mask and hit[1] == mask._version and hit[2] == dtype:
        return hit[3]
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -10000.0)
    _additive[0] = (weakref.ref(mask, _forget), mask._version, dtype, out)
    return out


def _forget(ref: weakref.ref) -> None:
    # The mask died: drop its additive form, unless a newer mask's has replaced it already.
    if _additive[0] is not None and _additive[0][0] is ref:
        _additive[0] = None


class LckDotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` whose forward runs torch SDPA for the cases it takes.

    Call: ``query`` ``[sq, b, np, hn]``, ``key`` / ``value`` ``[sk, b, ng, hn]`` with ``ng`` dividing ``np``
    (grouped-query attention), ``attention_mask`` None or boolean (see the module docstring). Returns
    ``[sq, b, np * hn]``, contiguous, in the query's dtype, like Megatron. The softmax scale is Megatron's
    net scale: ``softmax_scale`` (the constructor's, i.e. ``config.softmax_scale``) or ``1 / sqrt(hn)``;
    ``apply_query_key_layer_scaling`` divides the scores by the layer number and multiplies them back in the
    softmax, so it cancels.
    Attention dropout (``attention_dropout``) applies in training only, drawn under Megatron's
    model-parallel RNG tracker as Megatron's is (same distribution, not the same mask).

    ``calls`` counts ``{"lck": ..., "megatron": ...}`` forwards; ``fallback_reasons`` lists every reason for
    which a call was handed to Megatron's forward so far (in any instance).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.calls = {"lck": 0, "megatron": 0}

    @property
    def fallback_reasons(self) -> frozenset[str]:
        return _log.seen

    def net_softmax_scale(self) -> float:
        """The factor Megatron's scores are multiplied by before the softmax, all scalings included."""
        coeff = self.scale_mask_softmax.scale  # the layer number under apply_query_key_layer_scaling
        return self.softmax_scale * (coeff if coeff is not None else 1.0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        reason = self._megatron_reason(
            query, key, attention_mask, attention_bias, packed_seq_params, args, kwargs
        )
        if reason is not None:
            _log(f"LckDotProductAttention: running Megatron's DotProductAttention because {reason}")
            if not torch.compiler.is_compiling():
                self.calls["megatron"] += 1
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type,
                attention_bias,
                packed_seq_params,
                *args,
                **kwargs,
            )
        if not torch.compiler.is_compiling():
            self.calls["lck"] += 1

        sq, b, np_, hn = query.shape
        # Megatron ignores the attn_mask_type argument and uses the one it was built with; so does this. An
        # explicit mask replaces it, as in Megatron's unfused softmax.
        causal = self.attn_mask_type == AttnMaskType.causal and sq > 1 and attention_mask is None
        mask = None if attention_mask is None else additive_mask(attention_mask, query.dtype)
        # [s, b, heads, hn] -> [b, heads, s, hn]: views, the last dimension stays contiguous.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = np_ != key.shape[2]
        if gqa and not (query.is_cuda and query.dtype in _SDPA_GQA_DTYPES):
            # enable_gqa is taken by the flash and cuDNN kernels; elsewhere it would drop to the math kernel.
            k, v = (t.repeat_interleave(np_ // key.shape[2], dim=1) for t in (k, v))
            gqa = False
        dropout_p = self.attention_dropout.p if self.training else 0.0
        rng = nullcontext()
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            rng = tensor_parallel.get_cuda_rng_tracker().fork()
        with rng:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self.net_softmax_scale(),
                **({"enable_gqa": True} if gqa else {}),
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn).contiguous()

    def _megatron_reason(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: Any,
        attention_bias: Any,
        packed_seq_params: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str | None:
        """Why this call must run Megatron's forward, or None when SDPA reproduces it."""
        if packed_seq_params is not None:
            return "packed_seq_params is set (packed sequences)"
        if attention_bias is not None:
            return "attention_bias is set"
        if args or kwargs:
            return f"of arguments lck does not know: {len(args)} positional, keywords {sorted(kwargs)}"
        if attention_mask is not None and not _boolean_mask_for(attention_mask, query, key):
            return (
                "attention_mask is not a boolean [b or 1, heads or 1, sq, sk] tensor "
                f"(got {getattr(attention_mask, 'dtype', type(attention_mask).__name__)}, "
                f"shape {tuple(getattr(attention_mask, 'shape', ()))})"
            )
        if self.scale_mask_softmax.window_size is not None:
            return f"sliding-window attention (window_size={self.scale_mask_softmax.window_size})"
        if self.softmax_offset is not None or getattr(self.config, "softmax_type", "vanilla") != "vanilla":
            return f"softmax_type={getattr(self.config, 'softmax_type', None)!r} (SDPA has a vanilla softmax)"
        if attention_mask is None and self.attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            return f"attn_mask_type={self.attn_mask_type} needs a mask"
        if query.dim() != 4 or key.dim() != 4:
            return f"query / key are not [s, b, heads, hn] (shapes {tuple(query.shape)}, {tuple(key.shape)})"
        sq, sk = query.shape[0], key.shape[0]
        if self.attn_mask_type == AttnMaskType.causal and sq not in (1, sk) and attention_mask is None:
            return f"a causal mask with sq={sq} != sk={sk}"
        if key.shape[2] == 0 or query.shape[2] % key.shape[2] != 0:
            return f"{query.shape[2]} query heads are not a multiple of {key.shape[2]} key/value heads"
        return None


def _boolean_mask_for(mask: Any, query: torch.Tensor, key: torch.Tensor) -> bool:
    """A boolean mask SDPA can broadcast over ``[b, heads, sq, sk]`` for these 4-D query and key."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or query.dim() != 4:
        return False
    want = (query.shape[1], query.shape[2], query.shape[0], key.shape[0])
    return mask.device == query.device and all(m in (1, w) for m, w in zip(mask.shape, want, strict=True))
