"""The models, data and optimizer behind ``lck demo``.

Two model families, each built twice from the same initial weights:
- a plain-PyTorch GPT whose norms, SwiGLU MLPs and loss are either torch's or lck's modules (used on the
  CPU, and on a GPU without megatron-core);
- a Megatron-Core ``GPTModel`` with the local layer spec, built stock or after
  ``apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True, linear_cross_entropy=True,
  attention=True)``.
The data is a fixed random Markov chain over the vocabulary (:class:`MarkovChain`): every token has a few
likely successors, drawn Zipf-distributed, so a small model learns it from the first steps and the loss
falls from ``ln(vocab)`` to near the chain's entropy within the demo's steps.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    batch: int
    vocab: int
    dtype: torch.dtype
    lr: float
    tied: bool = False  # input embedding and output layer share one weight
    experts: int = 0  # > 0: every layer's MLP is an MoE layer of this many experts (Megatron model only)
    topk: int = 0
    moe_ffn: int = 0  # each expert's intermediate width


# name -> (shape, default steps). Each run is timed per step; "about two minutes" for stock + patched
# together is what the GPU presets aim at on one H200, compilation included.
PRESETS: dict[str, tuple[ModelShape, int]] = {
    # Sized for the 2-core CPU machines: Triton's interpreter costs ~0.5 ms per program, and the kernels
    # launch about one program per row, so the batch is kept to 32 tokens.
    "cpu": (ModelShape(2, 32, 2, 64, 16, 2, 64, torch.float32, 1e-2), 40),
    # The GPU default until 2026-12-02: host-bound at this width, and a small vocabulary (1.00x measured).
    "small": (ModelShape(4, 1024, 16, 4096, 1024, 8, 32768, torch.bfloat16, 1e-3), 200),
    # Llama-3's vocabulary at Llama-3.2-1B's width (hidden 2048, ffn 8192, tied embeddings), two layers,
    # 8 x 2048 tokens a step (enough that the optimizer's fixed cost is a small part of it): the output layer
    # and loss are a large share of the step, as in small models with large vocabularies.
    "llama3": (ModelShape(2, 2048, 16, 8192, 2048, 8, 128256, torch.bfloat16, 1e-3, tied=True), 250),
    # The same with eight layers: the output layer's share of the step is smaller, and so is lck's gain.
    "llama3-8l": (ModelShape(8, 2048, 16, 8192, 2048, 8, 128256, torch.bfloat16, 1e-3, tied=True), 100),
    # Qwen3-MoE-like at half of Qwen3-30B-A3B's width (hidden 1024, 64 experts of 384, top-8, QK norm), four
    # layers, 8 x 1024 tokens a step (``lck demo --moe``; Megatron on a GPU only).
    "moe": (
        ModelShape(4, 1024, 16, 3072, 1024, 8, 32768, torch.bfloat16, 1e-3, experts=64, topk=8, moe_ffn=384),
        200,
    ),
}


class MarkovChain:
    """A seeded Markov chain over the vocabulary: every token has 4 successors, taken with probabilities
    (0.55, 0.25, 0.12, 0.08), and the successors are drawn from a Zipf distribution over the token ids.

    The Zipf draw matters. With uniformly drawn successors every token is equally frequent: a model can
    lower its loss only by learning each token's successors, it sits near ``ln(vocab)`` for tens of steps,
    and when it drops hinges on rounding. On an H200 (bf16 Megatron GPTModel, 200 steps, three seeds) the
    stock model ended anywhere between 3.4 and 8.9 nats with the seed, and stock and lck-patched runs ended
    0.2 to 0.7 nats apart, either one ahead. With Zipf-distributed successors the loss falls from the first
    step (frequent tokens first) and the two runs ended 0.1% apart, never more than 0.05 nats apart on the way.
    """

    PROBS = (0.55, 0.25, 0.12, 0.08)

    def __init__(self, vocab: int, seed: int, zipf_exponent: float = 1.0):
        self.generator = torch.Generator().manual_seed(seed)
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        self.token_probs = (ranks**-zipf_exponent / (ranks**-zipf_exponent).sum()).float()
        self.successors = torch.multinomial(
            self.token_probs, vocab * 4, replacement=True, generator=self.generator
        ).view(vocab, 4)

    def sample(self, steps: int, batch: int, seq: int) -> torch.Tensor:
        """``[steps, batch, seq + 1]`` int64 tokens; each sequence starts at a Zipf-drawn token."""
        g, weights = self.generator, torch.tensor(self.PROBS)
        n = steps * batch
        tokens = torch.empty(n, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.multinomial(self.token_probs, n, replacement=True, generator=g)
        for t in range(1, seq + 1):
            pick = torch.multinomial(weights, n, replacement=True, generator=g)
            tokens[:, t] = self.successors[tokens[:, t - 1], pick]
        return tokens.view(steps, batch, seq + 1)

    def floor(self, tokens: torch.Tensor) -> float:
        """The loss a perfect model reaches on ``tokens``: the mean entropy of the next token given the
        previous one over the predicted positions (a token whose successors repeat has a lower one)."""
        w = torch.tensor(self.PROBS, dtype=torch.float64)
        same = (self.successors[:, :, None] == self.successors[:, None, :]).double()
        entropy = -(w * torch.log(same @ w)).sum(-1)  # per token: E_k[-log P(next = successor k)]
        return float(entropy[tokens[..., :-1].reshape(-1)].mean())


def markov_batches(steps: int, shape: ModelShape, seed: int) -> tuple[torch.Tensor, float]:
    """``[steps, batch, seq + 1]`` tokens of the demo's :class:`MarkovChain` (seeded), and their floor in
    nats; a model that learned nothing stays at ``ln(vocab)``."""
    chain = MarkovChain(shape.vocab, seed)
    tokens = chain.sample(steps, shape.batch, shape.seq)
    return tokens, chain.floor(tokens)


# ---------------------------------------------------------------------------------------------------------
# Plain-PyTorch GPT
# ---------------------------------------------------------------------------------------------------------


class _TorchSwiGLUMLP(nn.Module):
    """The torch twin of ``lck_kernels.LckSwiGLUMLP``: same parameter names, eager silu(gate) * up."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, shape: ModelShape, use_lck: bool):
        super().__init__()
        h = shape.hidden
        self.heads = shape.heads
        self.attn_norm = _norm(h, use_lck)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = _norm(h, use_lck)
        if use_lck:
            from lck_kernels import LckSwiGLUMLP

            self.mlp = LckSwiGLUMLP(h, shape.ffn, bias=False)
        else:
            self.mlp = _TorchSwiGLUMLP(h, shape.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.mlp_norm(x))


def _norm(hidden: int, use_lck: bool) -> nn.Module:
    if use_lck:
        from lck_kernels import LckRMSNorm

        return LckRMSNorm(hidden, eps=1e-5)  # "llama" casting: torch.nn.RMSNorm's numerics
    return nn.RMSNorm(hidden, eps=1e-5)


class TinyGPT(nn.Module):
    """Pre-norm GPT: token + learned position embeddings, RMSNorm, SDPA attention, SwiGLU MLP, untied head.

    ``use_lck`` swaps RMSNorm, the SwiGLU MLP and the loss for lck's; parameter names are identical, so
    one model's ``state_dict`` loads into the other.
    """

    def __init__(self, shape: ModelShape, use_lck: bool):
        super().__init__()
        self.shape, self.use_lck = shape, use_lck
        self.tok = nn.Embedding(shape.vocab, shape.hidden)
        self.pos = nn.Embedding(shape.seq, shape.hidden)
        self.blocks = nn.ModuleList(_Block(shape, use_lck) for _ in range(shape.layers))
        self.final_norm = _norm(shape.hidden, use_lck)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tied:
            self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(
                    p, std=0.02 / (math.sqrt(2 * shape.layers) if name.endswith(("proj.weight",)) else 1)
                )

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of ``tokens`` ``[b, s]`` against ``labels`` ``[b, s]`` (float32 scalar)."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x)).reshape(-1, self.shape.vocab)
        if self.use_lck:
            from lck_kernels import cross_entropy

            return cross_entropy(logits, labels.reshape(-1)).float()
        return F.cross_entropy(logits.float(), labels.reshape(-1))


def torch_step_fn(
    model: TinyGPT, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    autocast = device.type == "cuda" and model.shape.dtype == torch.bfloat16

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(tokens, labels)

    return step


# ---------------------------------------------------------------------------------------------------------
# Megatron-Core GPTModel
# ---------------------------------------------------------------------------------------------------------


@contextmanager
def megatron_parallel(seed: int) -> Iterator[None]:
    """torch.distributed (one rank, NCCL) and Megatron's parallel state at TP=PP=1, torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not dist.is_initialized()
    path = None
    if created:
        fd, path = tempfile.mkstemp(prefix="lck-demo-pg-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    owned = not parallel_state.model_parallel_is_initialized()
    if owned:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        if owned:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def apply_demo_patch(shape: ModelShape) -> None:
    """Patch Megatron as ``lck demo``'s ``megatron+lck`` run does: every lck feature the preset's model uses."""
    from lck_megatron.patch import apply_lck_to_megatron

    apply_lck_to_megatron(
        rms_norm=True,
        cross_entropy=True,
        swiglu=True,
        linear_cross_entropy=True,
        moe=shape.experts > 0,
        attention=True,
    )


def build_megatron_gpt(shape: ModelShape, seed: int) -> nn.Module:
    """A Megatron ``GPTModel`` (local spec, RMSNorm, SwiGLU through ``bias_swiglu_impl``) on the GPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = _moe_settings(shape)
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,  # routes the activation through bias_swiglu_impl
        add_bias_linear=False,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=shape.dtype == torch.bfloat16,
        params_dtype=shape.dtype,
        masked_softmax_fusion=False,  # the fused kernels need Apex / TE
        cross_entropy_loss_fusion=False,
        **moe,
    )
    spec_moe = {"num_experts": shape.experts, "moe_grouped_gemm": False, "qk_layernorm": True} if moe else {}
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", **spec_moe),
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=shape.tied,
    )
    # Megatron trains bf16 models wrapped in Float16Module, which casts every parameter (the norms' too)
    # to bf16; do the same, or the norms would keep float32 weights under bf16 activations.
    return model.cuda().to(shape.dtype)


def _moe_settings(shape: ModelShape) -> dict[str, Any]:
    """TransformerConfig fields of an MoE shape (Qwen3-MoE-like: softmax over the top-k, a small load-balancing
    loss, no token dropping, Megatron's all-to-all dispatcher); ``{}`` for a dense shape."""
    if shape.experts <= 0:
        return {}
    return dict(
        num_moe_experts=shape.experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.moe_ffn,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_router_dtype="fp32",
        qk_layernorm=True,
    )


def reset_moe_metrics() -> None:
    """Drop Megatron's per-layer MoE metrics (the router's load-balancing loss per layer). Its training loop
    reports and clears them every step; the demo does not report them, and a tracker left from an earlier
    model in the same process is sized by that model's layer count (an IndexError with a deeper one)."""
    try:
        from megatron.core.transformer.moe import moe_logging  # Megatron-Core 0.17 and later
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.get_moe_layer_wise_logging_tracker().clear()
        return
    moe_logging.destroy_moe_metrics_tracker()


def megatron_step_fn(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    reset_moe_metrics()

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        loss = model(tokens, pos, None, labels=labels).float().mean()  # per-token loss [b, s]
        reset_moe_metrics()  # as Megatron's training loop clears them once it has logged them
        return loss

    return step


# ---------------------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------------------


class MasterWeightAdamW:
    """AdamW over float32 master copies of (possibly bfloat16) parameters, as mixed-precision training does.

    Low-precision parameters cannot absorb small updates (a bf16 weight of 0.02 moves in steps of ~1e-4),
    so the optimizer keeps float32 masters and copies them back after each step. Float32 parameters are
    updated directly.
    """

    def __init__(self, params: list[nn.Parameter], lr: float):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.base_lr = lr

    def step(self, step: int, total: int) -> None:
        warm = max(1, total // 20)
        scale = (
            (step + 1) / warm
            if step < warm
            else 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))
        )
        for group in self.opt.param_groups:
            group["lr"] = self.base_lr * max(scale, 0.1)
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.data.copy_(m)
            p.grad = None
        for m in self.masters:
            m.grad = None

    @staticmethod
    def state_of(model: nn.Module) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
