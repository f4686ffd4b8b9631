"""TP=2 over gloo, two real processes: Megatron's MLP, vocab-parallel cross entropy and output layer + loss
(``linear_cross_entropy``), stock vs lck.

One spawned world runs every TP=2 case (importing megatron-core costs tens of seconds per process on the
CPU machines). References are float64 and built from each rank's own shards, then summed over the
tensor-parallel group where Megatron sums (row-parallel output, column-parallel input gradient), so they
hold whatever layout megatron-core gives the shards.
"""

from __future__ import annotations

import pytest
from _helpers import run_interpreted_workers

pytestmark = pytest.mark.megatron


def _mlp_cases(rank: int, group) -> int:
    import torch
    import torch.distributed as dist
    from _helpers import assert_close, build_mlp, stock_and_patched_mlp, swiglu_ref, transformer_config

    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((12,), (6, 2)):
            for in_place in (False, True):
                torch.manual_seed(1234)  # the same input on both ranks, as Megatron's TP requires
                config = transformer_config(dtype, tensor_model_parallel_size=2)
                mlp = build_mlp(config)
                assert mlp.linear_fc1.weight.shape[0] == 2 * config.ffn_hidden_size // 2
                x = torch.randn(*shape, config.hidden_size, dtype=dtype)
                dout = torch.randn(*shape, config.hidden_size, dtype=dtype)
                stock, patched = stock_and_patched_mlp(mlp, x, dout, in_place, where=f"rank {rank}: ")

                w1 = mlp.linear_fc1.weight.detach().double().requires_grad_(True)
                w2 = mlp.linear_fc2.weight.detach().double().requires_grad_(True)
                x64 = x.double().requires_grad_(True)
                partial = swiglu_ref(x64 @ w1.t()) @ w2.t()
                partial.backward(dout.double())
                ref = {"output": partial.detach().clone(), "input grad": x64.grad.clone()}
                for t in ref.values():
                    dist.all_reduce(t, group=group)  # row-parallel output / column-parallel input grad
                ref["fc1 weight grad"], ref["fc2 weight grad"] = w1.grad, w2.grad
                scale = 2.0 if dtype == torch.bfloat16 else 4.0
                for name, r in ref.items():
                    tag = f"rank {rank} {dtype} {len(shape) + 1}-D in_place={in_place}"
                    assert_close(stock[name], r, dtype, name=f"{tag} stock {name}", scale=scale)
                    assert_close(patched[name], r, dtype, name=f"{tag} lck {name}", scale=scale)
                checked += 1
    return checked


def _cross_entropy_cases(rank: int, group) -> int:
    import torch
    from _helpers import assert_close
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from lck_megatron.cross_entropy import LckVocabParallelCrossEntropy

    checked = 0
    s, b, vocab = 5, 3, 96
    shard = vocab // 2
    for dtype in (torch.float32, torch.bfloat16):
        for kind, smoothing in (("plain", 0.0), ("plain", 0.1), ("fused", 0.0)):
            torch.manual_seed(99)
            full = (torch.randn(s, b, vocab) * 3).to(dtype)
            # Targets spread over both shards, plus a row whose targets all sit in rank 1's shard.
            target = torch.randint(0, vocab, (s, b))
            target[0] = torch.randint(shard, vocab, (b,))
            dloss = torch.rand(s, b)
            local = full[..., rank * shard : (rank + 1) * shard]
            original = vocab_parallel_cross_entropy if kind == "plain" else fused_vocab_parallel_cross_entropy
            route = LckVocabParallelCrossEntropy(original)
            full64 = full.double().requires_grad_(True)
            logp = torch.log_softmax(full64, -1)
            nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            # Megatron at TP>1 smooths over the local shard only: alpha·Kl/(Kl−1) and the shard's mean log-prob.
            k = smoothing * shard / (shard - 1)
            ref = (
                (1 - k) * nll - k * logp[..., rank * shard : (rank + 1) * shard].mean(-1)
                if smoothing
                else nll
            )
            ref.backward(dloss.double())
            ref_grad = full64.grad[..., rank * shard : (rank + 1) * shard]
            for name, fn in (("megatron", original), ("lck", route)):
                x = local.detach().clone().requires_grad_(True)
                if kind == "plain":
                    loss = fn(x, target, smoothing)
                else:
                    loss = fn(x, target, group)
                loss.backward(dloss)
                tag = f"rank {rank} {kind} smoothing={smoothing} {dtype} {name}"
                loss_dtype = torch.float32  # both compute and return the loss in float32
                grad_dtype = torch.bfloat16 if (name == "megatron" and kind == "fused") else dtype
                assert_close(loss, ref, loss_dtype, name=f"{tag} loss")
                assert_close(x.grad, ref_grad, grad_dtype, name=f"{tag} logits-shard gradient")
            # Smoothing at TP>1 stays with Megatron (see lck_megatron.cross_entropy); the rest runs lck.
            want = {"lck": 0, "fallback": 1} if smoothing else {"lck": 1, "fallback": 0}
            assert route.calls == want, f"rank {rank} smoothing={smoothing}: {route.calls}"
            checked += 1
    return checked


def _linear_cross_entropy_cases(rank: int, group) -> int:
    """GPTModel._postprocess at TP=2, stock vs lck on the same model: without and with sequence parallelism,
    untied and tied output weights, a mean (gradients prepared in the forward) then a masked loss."""
    import torch
    from _helpers import assert_close, build_gpt, run_postprocess, transformer_config

    from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron
    from lck_megatron.patch import linear_cross_entropy_route

    checked = 0
    s, b, vocab = 8, 2, 96
    for sp, tied in ((False, False), (True, True)):
        torch.manual_seed(4321)  # the same weights, hidden states and labels on both ranks
        model = build_gpt(
            transformer_config(tensor_model_parallel_size=2), vocab_size=vocab, seq=s, tied=tied
        )
        hidden = torch.randn(s, b, model.config.hidden_size)
        labels = torch.randint(0, vocab, (b, s))
        upstream = {"mean": torch.full((b, s), 1.0 / (b * s)), "mask": (torch.rand(b, s) > 0.3).float()}
        # Megatron's SP linear needs CUDA (a global memory buffer), and its local spec builds torch norms only
        # without SP: the reference is the stock model without SP, whose hidden-state gradient (all-reduced
        # over the group) sliced to this rank's sequence chunk is what the SP run must give.
        stock = {name: run_postprocess(model, hidden, labels, g) for name, g in upstream.items()}
        if sp:
            model.output_layer.sequence_parallel, model.output_layer.allreduce_dgrad = True, False
            chunk = slice(rank * s // 2, (rank + 1) * s // 2)
            hidden = hidden[chunk]
            for ref in stock.values():
                ref["hidden grad"] = ref["hidden grad"][chunk]
        apply_lck_to_megatron(rms_norm=False, linear_cross_entropy=True)
        route = linear_cross_entropy_route()
        for name, g in upstream.items():
            out = run_postprocess(model, hidden, labels, g)
            for key, ref in stock[name].items():
                tag = f"rank {rank} sp={sp} tied={tied} {name} {key}"
                assert_close(out[key], ref, torch.float32, name=tag, scale=4.0)
            checked += 1
        assert route.calls == {"lck": 2, "megatron": 0}, f"rank {rank}: {route.calls}"
        revert_lck_from_megatron()
    return checked


def _tp2_worker(rank: int, world: int) -> dict[str, int]:
    from _helpers import init_megatron_parallel
    from megatron.core import parallel_state

    init_megatron_parallel(2)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        assert group.size() == 2
        return {
            "mlp": _mlp_cases(rank, group),
            "cross_entropy": _cross_entropy_cases(rank, group),
            "linear_cross_entropy": _linear_cross_entropy_cases(rank, group),
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_mlp_cross_entropy_and_output_layer_over_gloo() -> None:
    out = run_interpreted_workers(_tp2_worker, 2, "TP=2", timeout=900)
    assert out == [{"mlp": 8, "cross_entropy": 6, "linear_cross_entropy": 4}] * 2
