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
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any lck kernel is imported

import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

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
    config = TransformerConfig(
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
    )
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
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--in-place", action="store_true", help="LckMegatronSwiGLU(in_place=True)")
    args = parser.parse_args()
    LckSwiGLUMLP.in_place = args.in_place
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
        out, _ = layer.mlp(layer.pre_mlp_layernorm(hidden))
        out.sum().backward()
        print(f"CPU: layer 0 norm + MLP output {tuple(out.shape)}; gradients flowed back")
    print("lck SwiGLU calls (layer 0):", layer.mlp.lck_swiglu.calls)
    print("lck RMSNorm calls (layer 0, pre-MLP norm):", layer.pre_mlp_layernorm.calls)
    assert layer.mlp.lck_swiglu.calls["lck"] >= 1 and layer.pre_mlp_layernorm.calls["lck"] >= 1

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
