"""Megatron-Core MoE layers through lck: a token dispatcher over ``lck_ep.Buffer`` and grouped experts.

``apply_lck_to_megatron(moe=True)`` wraps ``MoELayer.__init__`` (on the class) and rebinds the names
``MoEAlltoAllTokenDispatcher`` / ``MoEFlexTokenDispatcher`` in ``megatron.core.transformer.moe.moe_layer``
to switches that build :class:`LckTokenDispatcher` while a supported layer is being built (and Megatron's
own class otherwise). Megatron's config chooses the backend as it does for its own dispatchers: a layer
whose ``moe_token_dispatcher_type`` is ``"alltoall"`` or ``"flex"`` gets lck's (the flex dispatcher's
DeepEP / HybridEP / NCCL-EP backends are then not needed); ``"allgather"`` stays Megatron's.

What a patched layer runs, per forward:

1. the router is Megatron's; its ``(probs [T, E], routing_map [T, E] bool)`` become ``topk_idx [T, K]``
   (the chosen experts in ascending order, -1 for a slot a token does not use) and ``topk_weights
   [T, K]`` (``probs`` gathered there, so the router's gradient flows);
2. the experts (Megatron's ``SequentialMLP``, its instance's class switched to :class:`LckSequentialMLP`)
   run lck-ep's MoE function: tokens to the expert-major layout through ``lck_ep.Buffer.dispatch(...,
   expand=True)`` over the expert-parallel group (a local sort at EP=1), grouped GEMM, SwiGLU weighted by
   the routing weight in one kernel (Megatron's ``weighted_bias_swiglu_impl``), grouped GEMM, and
   ``Buffer.combine`` back to the tokens; backward likewise.

Weights: the experts keep Megatron's parameters as they are: ``local_experts.{i}.linear_fc1.weight``
``[2F, H]`` (gate rows, then up rows) and ``local_experts.{i}.linear_fc2.weight`` ``[H, F]``, built and
initialised by Megatron. Each forward stacks them into ``[L, 2F, H]`` / ``[L, H, F]`` (one copy of the
layer's expert weights, small beside the GEMMs) and hands the grouped GEMMs their transposed views
(``[L, H, 2F]`` / ``[L, F, H]``, column-major, which ``torch._grouped_mm`` takes without a copy). So the
``state_dict`` and ``sharded_state_dict`` are SequentialMLP's own: checkpoints load either way, and
Megatron's dist-checkpoint conversions to and from GroupedMLP / TEGroupedMLP apply unchanged. (Holding
one stacked parameter would save that copy but would change the names, and Megatron's DDP re-points each
parameter into its own buffers, which would undo any shared storage.)

Configurations lck does not take keep Megatron's dispatcher and experts, with one logged reason each:
see :func:`unsupported_reason`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# This module is imported by the patch when moe=True is asked for, so megatron-core is importable then.
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from lck_megatron._bindings import Binding
from lck_megatron._support import LogOnce, logger

__all__ = [
    "LckRouting",
    "LckSequentialMLP",
    "LckTokenDispatcher",
    "MoERoute",
    "routing_to_topk",
    "unsupported_reason",
]

MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
DISPATCHERS = ("MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher")
TAKEN_DISPATCHER_TYPES = ("alltoall", "flex")

_building = threading.local()  # .active: a supported MoELayer is being built on this thread


def routing_to_topk(
    routing_map: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [T, K] int64, topk_weights [T, K])`` from Megatron's ``routing_map`` ``[T, E]`` (bool) and
    ``probs`` ``[T, E]``: each token's chosen experts in ascending order, then -1 (weight 0) for unused slots.

    A stable descending sort of the mask puts the chosen experts first, in expert order, with no host
    synchronisation; gathering ``probs`` keeps the router's gradient.
    """
    mask = routing_map.to(torch.int8)
    chosen, order = torch.sort(mask, dim=1, descending=True, stable=True)
    k = min(topk, mask.shape[1])
    used = chosen[:, :k].bool()
    idx = torch.where(used, order[:, :k], -1)
    weights = torch.where(used, probs.gather(1, order[:, :k]), 0)
    return idx, weights


@dataclass
class LckRouting:
    """What :class:`LckTokenDispatcher` hands the experts in the ``tokens_per_expert`` slot of Megatron's
    experts call: the routing and the Buffer (None at EP=1) that moves the rows."""

    topk_idx: torch.Tensor
    buffer: Any
    num_experts: int
    weights_buffer: Any = None  # callable: the K-wide Buffer that brings the routing weights' gradient home


def unsupported_reason(config: Any, pg_collection: Any = None) -> str | None:
    """Why a Megatron MoE layer built from ``config`` stays on Megatron's path, or None when lck takes it."""
    kind = getattr(config, "moe_token_dispatcher_type", None)
    if kind not in TAKEN_DISPATCHER_TYPES:
        return f"moe_token_dispatcher_type={kind!r} (lck takes 'alltoall' and 'flex')"
    for flag in ("fp8", "fp4"):
        if getattr(config, flag, None):
            return f"{flag}={getattr(config, flag)!r} (lck's experts run bf16/fp16/fp32)"
    if getattr(config, "add_bias_linear", False):
        return "add_bias_linear=True (lck's grouped experts have no bias)"
    if (
        not getattr(config, "gated_linear_unit", False)
        or getattr(config, "activation_func", None) is not F.silu
    ):
        return "the experts' activation is not SwiGLU (gated_linear_unit=True with activation_func=F.silu)"
    if getattr(config, "glu_linear_offset", 0.0) or getattr(config, "activation_func_clamp_value", None):
        return "glu_linear_offset / activation_func_clamp_value are set (lck's SwiGLU takes neither)"
    if getattr(config, "moe_shared_expert_overlap", False):
        return "moe_shared_expert_overlap=True (its overlap lives in Megatron's dispatchers)"
    if getattr(config, "moe_expert_capacity_factor", None) is not None or getattr(
        config, "moe_pad_expert_input_to_capacity", False
    ):
        return "moe_expert_capacity_factor / moe_pad_expert_input_to_capacity (lck drops no tokens)"
    if getattr(config, "moe_expert_rank_capacity_factor", None) is not None:
        return "moe_expert_rank_capacity_factor is set (lck drops no tokens)"
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
        # A synced Buffer reads the received counts on the host, and the grouped GEMMs outside bf16 read
        # the expert offsets there: neither can be captured.
        return (
            f"cuda_graph_impl={config.cuda_graph_impl!r} (lck's MoE path is not captured in CUDA graphs yet)"
        )
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input=True (lck weights the activation)"
    if getattr(config, "moe_latent_size", None):
        return "moe_latent_size is set"
    for flag in ("delay_wgrad_compute", "overlap_moe_expert_parallel_comm"):
        if getattr(config, flag, False):
            return f"{flag}=True (lck's experts compute weight gradients in their own backward)"
    if getattr(config, "transformer_impl", None) == "inference_optimized":
        return "transformer_impl='inference_optimized'"
    tp = getattr(pg_collection, "expt_tp", None)
    if tp is not None and tp.size() > 1:
        return f"expert tensor parallelism of {tp.size()} (lck's grouped experts hold whole experts)"
    if importlib.util.find_spec("lck_ep") is None:
        return "lck-ep is not installed (pip install 'lck-megatron[ep]')"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device and TRITON_INTERPRET=1 is not set (lck's kernels cannot run here)"
    return None


class LckTokenDispatcher(MoETokenDispatcher):
    """Megatron's token-dispatcher interface over ``lck_ep.Buffer`` (built at the first forward, collective
    over the expert-parallel group; none at EP=1).

    The row movement itself runs inside the experts' autograd function (so that forward and backward
    share the Buffer's handle): ``token_dispatch`` / ``token_combine`` pass tensors through, and
    ``dispatch_postprocess`` hands the experts an :class:`LckRouting`.
    """

    def __init__(
        self, num_local_experts: int, local_expert_indices: list[int], config: Any, pg_collection: Any
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.buffer: Any = None
        self._weights_buf: Any = None
        self._hidden_shape: torch.Size | None = None
        self._topk_idx: torch.Tensor | None = None

    def _ensure_buffer(self, x: torch.Tensor) -> Any:
        """The Buffer over the EP group, built at the first forward (collective). Its token capacity is the
        runtime's ``MoEConfig.max_tokens`` when ``lck_runtime.configure(moe=...)`` set one for the group (and
        then the native kernels move the rows), else the largest token count of that first call over the
        group; a later call with more tokens raises the Buffer's error naming ``max_tokens_per_rank``."""
        if self.ep_size == 1:
            return None
        if self.buffer is None:
            import torch.distributed as dist

            from lck_ep import Buffer

            cap = _configured_max_tokens(self.ep_group)
            if cap is None:
                t = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ep_group)
                cap = int(t.item())
            self.buffer = Buffer(self.ep_group, cap, x.shape[1], self.topk, self.num_experts, device=x.device)
        return self.buffer

    def _weights_buffer(self) -> Any:
        if self._weights_buf is None:
            from lck_ep import Buffer

            b = self.buffer
            self._weights_buf = Buffer(
                b.group, b.max_tokens_per_rank, b.num_topk, b.num_topk, b.num_experts, device=b.device
            )
        return self._weights_buf

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self._hidden_shape = tokens.shape
        x = tokens.reshape(-1, tokens.shape[-1])
        self._topk_idx, weights = routing_to_topk(routing_map, probs, self.topk)
        return x, weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, *args: Any, **kwargs: Any):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        assert self._topk_idx is not None, (
            "LckTokenDispatcher: dispatch_postprocess before dispatch_preprocess"
        )
        buf = self._ensure_buffer(hidden_states)
        routing = LckRouting(
            self._topk_idx, buf, self.num_experts, self._weights_buffer if buf is not None else None
        )
        self._topk_idx = None
        return hidden_states, routing, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self._hidden_shape is not None
        return hidden_states.view(self._hidden_shape)


class LckSequentialMLP(SequentialMLP):
    """Megatron's ``SequentialMLP`` (same parameters, state dicts and checkpoint mapping) whose forward runs
    all local experts as lck's grouped experts when its dispatcher is :class:`LckTokenDispatcher`.

    Instances are Megatron-built ``SequentialMLP`` objects whose class the patch switched; called with
    Megatron's own ``tokens_per_expert`` it runs ``SequentialMLP.forward``.
    """

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):  # type: ignore[override]
        if not isinstance(tokens_per_expert, LckRouting):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        from lck_ep.moe import checks
        from lck_ep.moe.function import MoEFunction, Plan

        x, routing, weights = permuted_local_hidden_states, tokens_per_expert, permuted_probs
        # [L, 2F, H] and [L, H, F] stacks (Megatron's per-expert layouts), passed as [L, H, 2F] / [L, F, H]
        # column-major views: the grouped GEMMs read either layout.
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        checks.check_forward(
            x, routing.topk_idx, weights, hidden=w1.shape[1], num_experts=routing.num_experts,
            dtype=w1.dtype, device=w1.device,
        )  # fmt: skip
        retain = torch.is_grad_enabled() and (
            x.requires_grad or weights.requires_grad or w1.requires_grad or w2.requires_grad
        )
        buf = routing.buffer
        plan = Plan(
            num_experts=routing.num_experts,
            alignment=1,
            buffer=buf,
            weights_buffer=routing.weights_buffer,
            context=None,
            retain=retain,
        )
        out = MoEFunction.apply(x, weights, w1, w2, routing.topk_idx, plan)
        return out, None


def _configured_max_tokens(group: Any) -> int | None:
    """``MoEConfig.max_tokens`` of the runtime's MoE context for ``group``, or None when there is none."""
    try:
        from lck_runtime.contexts import moe_context
    except ImportError:
        return None
    try:
        ctx = moe_context(group, required=False)
    except (ValueError, RuntimeError):  # a group the runtime does not know
        return None
    return ctx.config.max_tokens if ctx is not None and ctx.alive else None


class _DispatcherSwitch:
    """Stands for one of Megatron's dispatcher classes in ``moe_layer``: lck's dispatcher while a supported
    layer is being built on this thread, Megatron's class otherwise."""

    def __init__(self, original: type) -> None:
        self.original = original
        self.__name__ = original.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_building, "active", False):
            return LckTokenDispatcher(*args, **kwargs)
        return self.original(*args, **kwargs)


class MoERoute:
    """What the ``moe`` feature holds: counts of layers built through lck and of those left to Megatron,
    and the reasons logged (once each)."""

    def __init__(self) -> None:
        self.layers = {"lck": 0, "megatron": 0}
        self.fallback = LogOnce(logger, logging.INFO)

    @property
    def fallback_reasons(self) -> frozenset[str]:
        return self.fallback.seen

    def wrap_init(self, init: Any, switches: dict[str, _DispatcherSwitch]) -> Any:
        route = self

        def __init__(layer: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            pg = kwargs.get("pg_collection")
            if pg is None and len(args) >= 3:
                pg = args[2]
            if pg is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

                pg = get_default_pg_collection()
                kwargs["pg_collection"] = pg
            reason = unsupported_reason(config, pg)
            _building.active = reason is None
            try:
                init(layer, config, *args, **kwargs)
            finally:
                _building.active = False
            if reason is None and type(layer.experts) is not SequentialMLP:
                reason = f"the experts are {type(layer.experts).__name__} (lck takes the local spec's SequentialMLP)"
                original = switches[
                    f"MoE{'Flex' if config.moe_token_dispatcher_type == 'flex' else 'AlltoAll'}TokenDispatcher"
                ]
                layer.token_dispatcher = original.original(
                    layer.num_local_experts, layer.local_expert_indices, config=config, pg_collection=pg
                )
            if reason is None:
                layer.experts.__class__ = LckSequentialMLP
                route.layers["lck"] += 1
            else:
                route.layers["megatron"] += 1
                route.fallback(f"lck: this Megatron MoE layer stays on Megatron's path: {reason}")

        __init__.lck_moe = route  # type: ignore[attr-defined]
        __init__.__wrapped__ = init  # type: ignore[attr-defined]
        return __init__


def apply_moe(route: MoERoute) -> list[Binding]:
    """Wrap ``MoELayer.__init__`` and rebind the dispatcher names of ``moe_layer``; returns the new sites
    (none when already patched)."""
    module = importlib.import_module(MOE_LAYER)
    cls = module.MoELayer
    init = vars(cls)["__init__"]
    if getattr(init, "lck_moe", None) is not None:
        return []
    made = []
    switches = {}
    for name in DISPATCHERS:
        original = getattr(module, name)
        switch = _DispatcherSwitch(original)
        switches[name] = switch
        setattr(module, name, switch)
        made.append(Binding(MOE_LAYER, name, original, switch))
    wrapper = route.wrap_init(init, switches)
    cls.__init__ = wrapper
    made.append(Binding(f"{MOE_LAYER}.MoELayer", "__init__", init, wrapper, owner=cls))
    return made
