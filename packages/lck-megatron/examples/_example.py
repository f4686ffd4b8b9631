"""What both examples share: the tiny GPT's config, one-rank setup and teardown, and the GPU run
(a few training steps, then a distributed checkpoint saved and loaded back into a fresh model).

The examples differ only in how lck enters the model: a global patch (``one_line_patch.py``) or a
hand-built layer spec (``hand_built_spec.py``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig


def tiny_config(cuda: bool, num_layers: int = 2, **extra: Any) -> TransformerConfig:
    """A 2-layer SwiGLU + RMSNorm GPT: bf16 at width 256 on the GPU, float32 at width 32 on the CPU."""
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=256 if cuda else 32,
        ffn_hidden_size=704 if cuda else 48,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=cuda,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        use_cpu_initialization=not cuda,
        **extra,
    )


def start(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, bool, str]:
    """Parse ``--steps`` and the example's own flags, and set up one rank (NCCL on a GPU, else gloo)
    with Megatron's model-parallel state and seeds; returns (args, cuda, scratch directory)."""
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    store = tempfile.mkdtemp(prefix="lck-example-")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{store}/pg", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    return args, cuda, store


def train_and_round_trip(model: GPTModel, build: Callable[[bool], GPTModel], steps: int, store: str) -> None:
    """On the GPU: ``steps`` AdamW steps on random tokens, then a distributed checkpoint saved and loaded
    into ``build(True)``, whose parameters must equal the trained ones."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 1024, (4, 129), device="cuda")
    pos = torch.arange(128, device="cuda").unsqueeze(0).expand(4, 128)
    for step in range(steps):
        loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    ckpt = os.path.join(store, "ckpt")
    os.makedirs(ckpt, exist_ok=True)  # megatron-core saves only into an existing directory
    dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    fresh = build(True)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt), strict=False)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    print(f"distributed checkpoint round trip: {'identical' if same else 'DIFFERENT'}")
    assert same


def finish() -> None:
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
