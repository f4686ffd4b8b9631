"""Mode 1: one line makes Megatron-Core run lck's RMSNorm, SwiGLU and vocab-parallel cross entropy.

    python packages/lck-megatron/examples/one_line_patch.py [--steps 20]

Call ``apply_lck_to_megatron`` on every rank before the model is built. On a GPU this trains a small
``GPTModel`` (local spec, bf16) for a few steps, then saves it as a distributed checkpoint and loads it
back into a fresh model. Without a GPU Megatron's attention cannot run (it allocates on CUDA), so the
script builds the same model on the CPU and runs its first MLP and its language-model loss through lck's
kernels in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any lck kernel is imported

import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import mlp as megatron_mlp
from megatron.core.transformer.transformer_config import TransformerConfig

from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron


def build(cuda: bool) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=256 if cuda else 32,
        ffn_hidden_size=704 if cuda else 48,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,  # Megatron calls bias_swiglu_impl: lck's after the patch
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=cuda,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        use_cpu_initialization=not cuda,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=1024 if cuda else 64,
        max_sequence_length=128,
    )
    # bf16 on the GPU, every parameter included, as Megatron's Float16Module wrapper casts them.
    return model.cuda().bfloat16() if cuda else model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    # The one line. Idempotent and reversible; log output says which Megatron modules were rebound.
    patched = apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    for feature, sites in patched.items():
        print(f"{feature}: {len(sites)} sites, e.g. {sites[0]}")

    model = build(cuda)
    print("final norm:", type(model.decoder.final_layernorm).__name__)
    swiglu = megatron_mlp.bias_swiglu_impl  # read after the patch: lck's module

    if cuda:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 1024, (4, 129), device="cuda")
        pos = torch.arange(128, device="cuda").unsqueeze(0).expand(4, 128)
        for step in range(args.steps):
            loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 5 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {loss.item():.4f}")
        ckpt = os.path.join(store, "ckpt")
        os.makedirs(ckpt, exist_ok=True)  # megatron-core saves only into an existing directory
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        fresh = build(cuda)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt), strict=False)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        print(f"distributed checkpoint round trip: {'identical' if same else 'DIFFERENT'}")
        assert same
    else:
        hidden = torch.randn(16, 2, model.config.hidden_size, requires_grad=True)
        out, _ = model.decoder.layers[0].mlp(model.decoder.layers[0].pre_mlp_layernorm(hidden))
        logits = torch.randn(16, 2, 64, requires_grad=True)
        loss = model.compute_language_model_loss(torch.randint(0, 64, (2, 16)), logits)
        (out.sum() + loss.sum()).backward()
        print(f"CPU: MLP output {tuple(out.shape)}, loss {tuple(loss.shape)}; gradients flowed back")
    print("lck SwiGLU calls:", swiglu.calls)
    print("lck RMSNorm calls (layer 0, pre-MLP norm):", model.decoder.layers[0].pre_mlp_layernorm.calls)
    assert swiglu.calls["lck"] >= 1

    revert_lck_from_megatron()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
