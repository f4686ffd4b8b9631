"""Mode 2: a hand-built Megatron-Core layer spec that uses lck's modules directly, with no global patch.

    python packages/lck-megatron/examples/hand_built_spec.py [--steps 20] [--in-place]

The MLP subclass below computes its activation with ``LckMegatronSwiGLU`` (Megatron's own
``bias_swiglu_impl`` remains the fallback for a bias, FP8 input store or CPU offload), and every norm slot,
the final one included, gets ``LckWrappedTorchNorm``. On a GPU this trains a small ``GPTModel`` and
round-trips a distributed checkpoint; without one it runs the first layer's norm and MLP on the CPU
through Triton's interpreter (Megatron's attention needs CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any lck kernel is imported

from _example import finish, start, tiny_config, train_and_round_trip
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from lck_megatron import LckMegatronSwiGLU, LckWrappedTorchNorm


class LckSwiGLUMLP(MLP):
    """Megatron's dense MLP (fc1 → SwiGLU → fc2) with the activation computed by lck."""

    in_place = False  # set True for ~20% less activation memory (no activation recompute then)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lck_swiglu = LckMegatronSwiGLU(in_place=self.in_place)

    def forward(self, hidden_states, *args, **kwargs):
        intermediate, bias = self.linear_fc1(hidden_states)
        # The call mirrors Megatron's bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input).
        intermediate = self.lck_swiglu(intermediate, bias, self.config.activation_func_fp8_input_store, False)
        return self.linear_fc2(intermediate)


def lck_layer_spec() -> ModuleSpec:
    """Megatron's local GPT layer spec with lck's MLP and norms swapped in (0.16.x and 0.19.x)."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mlp = spec.submodules.mlp
    if isinstance(mlp, ModuleSpec):  # 0.16.x: ModuleSpec(module=MLP, submodules=...)
        mlp = dataclasses.replace(mlp, module=LckSwiGLUMLP)
    else:  # 0.19.x: functools.partial(MLP.as_mlp_submodule, submodules=...)
        mlp = functools.partial(LckSwiGLUMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    submodules = dataclasses.replace(
        spec.submodules, mlp=mlp, input_layernorm=LckWrappedTorchNorm, pre_mlp_layernorm=LckWrappedTorchNorm
    )
    return dataclasses.replace(spec, submodules=submodules)


def build(cuda: bool, num_layers: int = 2) -> GPTModel:
    config = tiny_config(cuda, num_layers)
    # A block spec names the final norm too; a bare layer spec would leave it to Megatron's default.
    block = TransformerBlockSubmodules(
        layer_specs=[lck_layer_spec()] * num_layers, layer_norm=LckWrappedTorchNorm
    )
    model = GPTModel(
        config=config, transformer_layer_spec=block, vocab_size=1024 if cuda else 64, max_sequence_length=128
    )
    # bf16 on the GPU, every parameter included, as Megatron's Float16Module wrapper casts them.
    return model.cuda().bfloat16() if cuda else model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-place", action="store_true", help="LckMegatronSwiGLU(in_place=True)")
    args, cuda, store = start(parser)
    LckSwiGLUMLP.in_place = args.in_place

    model = build(cuda)
    layer = model.decoder.layers[0]
    print(
        "mlp:",
        type(layer.mlp).__name__,
        "| norms:",
        type(layer.input_layernorm).__name__,
        type(model.decoder.final_layernorm).__name__,
    )

    if cuda:
        train_and_round_trip(model, build, args.steps, store)
    else:
        hidden = torch.randn(16, 2, model.config.hidden_size, requires_grad=True)
        out, _ = layer.mlp(layer.pre_mlp_layernorm(hidden))
        out.sum().backward()
        print(f"CPU: layer 0 norm + MLP output {tuple(out.shape)}; gradients flowed back")
    print("lck SwiGLU calls (layer 0):", layer.mlp.lck_swiglu.calls)
    print("lck RMSNorm calls (layer 0, pre-MLP norm):", layer.pre_mlp_layernorm.calls)
    assert layer.mlp.lck_swiglu.calls["lck"] >= 1 and layer.pre_mlp_layernorm.calls["lck"] >= 1

    finish()


if __name__ == "__main__":
    main()
