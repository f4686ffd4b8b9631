"""Distributed checkpoints of patched models, and a patched GPTModel on CUDA.

megatron-core's ``torch_dist`` save stages every tensor with ``torch.cuda.synchronize()`` (0.16.1 and
0.19.2 alike), so the save/load round trip runs on the GPU. On the CPU the test checks what the round
trip relies on: a patched model's ``sharded_state_dict`` is the stock model's, key for key.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_close, build_gpt, transformer_config

from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron

pytestmark = pytest.mark.megatron


def _sharded_layout(model) -> dict[str, tuple]:
    out = {}
    for key, sh in model.sharded_state_dict().items():
        if hasattr(sh, "global_shape"):
            dtype = getattr(sh, "dtype", None)  # ShardedTensor has one, ShardedObject does not
            out[key] = (
                type(sh).__name__,
                tuple(sh.global_shape),
                tuple(sh.global_offset),
                sh.replica_id,
                dtype,
                sh.key,
            )
        else:
            out[key] = (type(sh).__name__, getattr(sh, "key", None))
    return out


def test_patched_sharded_state_dict_matches_stock(megatron_tp1: None) -> None:
    torch.manual_seed(0)
    stock = build_gpt(transformer_config())
    apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    patched = build_gpt(transformer_config())
    assert type(patched.decoder.final_layernorm).__name__ == "LckMegatronRMSNorm"
    assert _sharded_layout(patched) == _sharded_layout(stock)


def _perturbed(model) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.gpu
def test_dist_checkpoint_round_trip_cuda(megatron_tp1: None, tmp_path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    cfg = transformer_config(torch.bfloat16, use_cpu_initialization=False)
    saved = build_gpt(cfg).cuda().bfloat16()
    want = _perturbed(saved)
    (tmp_path / "patched").mkdir()  # megatron-core saves only into an existing directory
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path / "patched"))

    for label, patched in (("patched", True), ("stock", False)):
        if not patched:
            revert_lck_from_megatron()
        model_parallel_cuda_manual_seed(1)
        fresh = build_gpt(cfg).cuda().bfloat16()
        loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path / "patched"))
        fresh.load_state_dict(loaded, strict=False)
        for k, p in fresh.named_parameters():
            assert torch.equal(p, want[k]), f"{label} model: {k} differs after loading the patched checkpoint"


@pytest.mark.gpu
def test_patched_gpt_forward_backward_cuda(megatron_tp1: None) -> None:
    """Same weights, same batch: stock and patched GPTModel losses and gradients agree; lck ran."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    cfg = dict(hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, use_cpu_initialization=False)
    # .bfloat16(): every parameter in bf16, norms included, as Megatron's Float16Module casts them.
    stock = build_gpt(transformer_config(torch.bfloat16, **cfg), vocab_size=8192, seq=256).cuda().bfloat16()
    apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    patched = build_gpt(transformer_config(torch.bfloat16, **cfg), vocab_size=8192, seq=256).cuda().bfloat16()
    with torch.no_grad():
        for (_, a), (_, b) in zip(stock.named_parameters(), patched.named_parameters()):
            b.copy_(a)
    tokens = torch.randint(0, 8192, (4, 256), device="cuda")
    labels = torch.randint(0, 8192, (4, 256), device="cuda")
    pos = torch.arange(256, device="cuda").unsqueeze(0).expand(4, 256)
    losses, grads = {}, {}
    for name, model in (("stock", stock), ("patched", patched)):
        loss = model(tokens, pos, None, labels=labels)
        assert loss.shape == (4, 256) and loss.dtype == torch.float32
        loss.mean().backward()
        losses[name] = loss.detach()
        grads[name] = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    from megatron.core.transformer import mlp

    assert mlp.bias_swiglu_impl.calls["lck"] >= 2, "the patched MLPs did not run lck's SwiGLU"
    assert patched.decoder.final_layernorm.calls["lck"] == 1
    assert_close(losses["patched"], losses["stock"], torch.bfloat16, name="per-token loss", scale=2.0)
    for k, g in grads["stock"].items():
        assert_close(grads["patched"][k], g, torch.bfloat16, name=f"grad {k}", scale=4.0)
