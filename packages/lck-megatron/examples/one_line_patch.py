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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any lck kernel is imported

from _example import finish, start, tiny_config, train_and_round_trip
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import mlp as megatron_mlp

from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron


def build(cuda: bool) -> GPTModel:
    # bias_activation_fusion: Megatron calls bias_swiglu_impl, lck's after the patch.
    config = tiny_config(cuda, bias_activation_fusion=True)
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
    args, cuda, store = start(parser)

    # The one line. Idempotent and reversible; log output says which Megatron modules were rebound.
    patched = apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    for feature, sites in patched.items():
        print(f"{feature}: {len(sites)} sites, e.g. {sites[0]}")

    model = build(cuda)
    print("final norm:", type(model.decoder.final_layernorm).__name__)
    swiglu = megatron_mlp.bias_swiglu_impl  # read after the patch: lck's module

    if cuda:
        train_and_round_trip(model, build, args.steps, store)
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
    finish()


if __name__ == "__main__":
    main()
