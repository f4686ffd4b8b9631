"""A patched GPTModel trained under Megatron's own CUDA graphs (``cuda_graph_impl="local"``).

Megatron's ``CudaGraphManager`` records each transformer layer's first eager forward and backward, captures
them when the training loop calls ``create_cudagraphs()``, and from then on replays the layer as two graphs,
adding weight gradients into ``param.main_grad`` inside the backward graph (as its DDP wrapper expects).
lck's RMSNorm and SwiGLU sit inside those layers, so they run inside Megatron's captures. The same patched
model run eagerly is the reference: loss and every gradient must agree on fresh batches, step after step,
and the graphs must really have been captured and replayed.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from _helpers import assert_close, build_gpt, transformer_config

from lck_megatron import apply_lck_to_megatron

pytestmark = [pytest.mark.megatron, pytest.mark.gpu]

VOCAB, SEQ, BATCH = 8192, 256, 4


def _local_graphs_supported() -> str | None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    seed_args = inspect.signature(model_parallel_cuda_manual_seed).parameters
    if "cuda_graph_impl" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        return "this megatron-core has no cuda_graph_impl"
    if not {"use_cudagraphable_rng", "force_reset_rng"} <= set(seed_args):
        return "this megatron-core cannot reset the RNG tracker to a graph-safe one"
    return None


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen)
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
    return tokens, pos, labels


def _step(model, batch, cot: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward; each parameter's gradient as a DDP-wrapped model would see it (its .grad plus
    what the captured backward added into main_grad), both cleared first."""
    for p in model.parameters():
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()
    tokens, pos, labels = batch
    loss = model(tokens, pos, None, labels=labels)
    (loss * cot).sum().backward()
    grads = {}
    for k, p in model.named_parameters():
        g = torch.zeros_like(p, dtype=torch.float32)
        if p.grad is not None:
            g += p.grad.float()
        if hasattr(p, "main_grad"):
            g += p.main_grad
        grads[k] = g
    return loss.detach().clone(), grads


def test_patched_gpt_trains_under_megatron_local_cuda_graphs(megatron_tp1: None) -> None:
    reason = _local_graphs_supported()
    if reason is not None:
        pytest.skip(reason)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import cuda_graphs, mlp

    apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
    # Megatron refuses to build a graph manager unless the RNG tracker is graph-safe.
    model_parallel_cuda_manual_seed(0, use_cudagraphable_rng=True, force_reset_rng=True)
    try:
        shape = dict(
            hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, use_cpu_initialization=False
        )
        eager = build_gpt(transformer_config(torch.bfloat16, **shape), vocab_size=VOCAB, seq=SEQ)
        graphed = build_gpt(
            transformer_config(torch.bfloat16, cuda_graph_impl="local", **shape), vocab_size=VOCAB, seq=SEQ
        )
        eager, graphed = eager.cuda().bfloat16().train(), graphed.cuda().bfloat16().train()
        with torch.no_grad():
            for (ka, a), (kb, b) in zip(eager.named_parameters(), graphed.named_parameters()):
                assert ka == kb
                b.copy_(a)
        for p in graphed.parameters():  # where Megatron's DDP wrapper would put them
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        managers = [layer.cudagraph_manager for layer in graphed.decoder.layers]
        gen = torch.Generator(device="cuda").manual_seed(123)

        for step in range(4):
            batch = _batch(step)
            cot = torch.rand(BATCH, SEQ, device="cuda", generator=gen) + 0.5
            want_loss, want = _step(eager, batch, cot)
            got_loss, got = _step(graphed, batch, cot)
            if step == 0:  # the first step recorded the layers; the training loop now captures them
                assert all(m.cudagraph_runners for m in managers), "Megatron did not record the layers"
                before = mlp.bias_swiglu_impl.calls["lck"]
                cuda_graphs.create_cudagraphs()  # warms each layer up again, then captures it
                in_capture = mlp.bias_swiglu_impl.calls["lck"] - before
            assert_close(got_loss, want_loss, torch.bfloat16, name=f"step {step}: per-token loss")
            for k, g in want.items():
                assert_close(got[k], g, torch.bfloat16, name=f"step {step}: grad {k}", scale=4.0)

        runners = [r for m in managers for r in m.cudagraph_runners]
        assert runners and all(r.fwd_graph is not None and r.bwd_graph is not None for r in runners), (
            "Megatron did not capture forward and backward graphs for every layer"
        )
        assert in_capture > 0, "lck's SwiGLU did not run while Megatron captured the layers"
        norms = [type(layer.pre_mlp_layernorm).__name__ for layer in graphed.decoder.layers]
        assert norms == ["LckMegatronRMSNorm"] * len(norms), f"the graphed layers' norms are {norms}"
    finally:
        cuda_graphs.delete_cuda_graphs()
        model_parallel_cuda_manual_seed(0, force_reset_rng=True)
