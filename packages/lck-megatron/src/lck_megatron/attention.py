"""``LckDotProductAttention``: Megatron-Core's local core attention, computed by torch's SDPA.

Megatron's local layer specs (``LocalSpecProvider.core_attention``, the BERT, T5, ViT, LLaVA and ModelOpt
local specs) build ``DotProductAttention`` for the unfused attention core: it materialises the
``[b, heads, sq, sk]`` scores with ``baddbmm``, masks them, softmaxes and multiplies by the values.
:class:`LckDotProductAttention` is a subclass with the same constructor, parameters and state dict whose
forward runs ``torch.nn.functional.scaled_dot_product_attention`` instead, which on a GPU picks a flash,
cuDNN or memory-efficient kernel and never holds the scores.

It takes the cases whose math it reproduces exactly (up to rounding): no explicit ``attention_mask``, the
module's own mask type (causal with ``sq == sk``, or ``sq == 1``; no mask), vanilla softmax, no sliding
window, no ``attention_bias``, no ``packed_seq_params``. Every other call runs Megatron's own forward, with
one log line per reason for the whole process. (Context parallelism never reaches the forward: Megatron's
constructor rejects ``context_parallel_size > 1`` for this module.)
"""

from __future__ import annotations

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


class LckDotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` whose forward runs torch SDPA for the cases it takes.

    Call: ``query`` ``[sq, b, np, hn]``, ``key`` / ``value`` ``[sk, b, ng, hn]`` with ``ng`` dividing ``np``
    (grouped-query attention), ``attention_mask`` None. Returns ``[sq, b, np * hn]``, contiguous, in the
    query's dtype, like Megatron. The softmax scale is Megatron's net scale: ``softmax_scale`` (the
    constructor's, i.e. ``config.softmax_scale``) or ``1 / sqrt(hn)``; ``apply_query_key_layer_scaling``
    divides the scores by the layer number and multiplies them back in the softmax, so it cancels.
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
        # Megatron ignores the attn_mask_type argument and uses the one it was built with; so does this.
        causal = self.attn_mask_type == AttnMaskType.causal and sq > 1
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
        if attention_mask is not None:
            return "an explicit attention_mask is given (lck takes mask=None, masking by attn_mask_type)"
        if self.scale_mask_softmax.window_size is not None:
            return f"sliding-window attention (window_size={self.scale_mask_softmax.window_size})"
        if self.softmax_offset is not None or getattr(self.config, "softmax_type", "vanilla") != "vanilla":
            return f"softmax_type={getattr(self.config, 'softmax_type', None)!r} (SDPA has a vanilla softmax)"
        if self.attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            return f"attn_mask_type={self.attn_mask_type} needs a mask"
        if query.dim() != 4 or key.dim() != 4:
            return f"query / key are not [s, b, heads, hn] (shapes {tuple(query.shape)}, {tuple(key.shape)})"
        sq, sk = query.shape[0], key.shape[0]
        if self.attn_mask_type == AttnMaskType.causal and sq not in (1, sk):
            return f"a causal mask with sq={sq} != sk={sk}"
        if key.shape[2] == 0 or query.shape[2] % key.shape[2] != 0:
            return f"{query.shape[2]} query heads are not a multiple of {key.shape[2]} key/value heads"
        return None
