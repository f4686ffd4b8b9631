"""``apply_lck_to_megatron(moe=True)``: a patched Megatron MoE layer against the stock one, state dicts, revert,
the fallback policy.

On the CPU two things of Megatron's MoE layer need CUDA: ``MoEAlltoAllTokenDispatcher.__init__`` creates a CUDA
stream, and the router's ``gating`` moves its weight to the current CUDA device. So the CPU tests take the stock
reference from Megatron's allgather dispatcher (at EP=1 it computes the same function as the alltoall one, with
the same ``SequentialMLP``), and run the router's gate as a plain CPU linear (the rest of the router, top-k,
softmax and routing map, is Megatron's). The ``gpu`` test compares with the stock alltoall layer on CUDA as is.
lck's kernels run under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close, kernel_device, run_interpreted_workers, transformer_config

pytestmark = pytest.mark.megatron

E, K, FFN = 4, 2, 48


def moe_config(dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        num_moe_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
    )
    kwargs.update(overrides)
    return transformer_config(dtype, **kwargs)


def build_moe(config: Any) -> Any:
    """Megatron's MoELayer from its local (non-TE) spec: router, dispatcher, SequentialMLP experts."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if callable(spec):  # 0.19: a builder
        return spec(config=config)
    from megatron.core.transformer.spec_utils import build_module  # 0.16: a ModuleSpec

    return build_module(spec, config=config)


@pytest.fixture
def cpu_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's router gate without its move to CUDA (see the module docstring)."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe.router import TopKRouter

    monkeypatch.setattr(TopKRouter, "gating", lambda self, x: F.linear(x.float(), self.weight.float()))


def _fwd_bwd(layer: Any, x: torch.Tensor, dout: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    out, bias = layer(xi)
    assert bias is None
    out.backward(dout)
    got = {"out": out.detach(), "dx": xi.grad}
    got.update({n: p.grad for n, p in layer.named_parameters()})
    return got


def _stock_and_patched(dtype: torch.dtype, dispatcher: str = "alltoall") -> tuple[Any, Any]:
    from lck_megatron import apply_lck_to_megatron
    from lck_megatron.moe import LckSequentialMLP, LckTokenDispatcher

    stock_kind = "alltoall" if torch.cuda.is_available() else "allgather"
    torch.manual_seed(0)
    stock = build_moe(moe_config(dtype, moe_token_dispatcher_type=stock_kind))
    apply_lck_to_megatron(rms_norm=False, moe=True)
    patched = build_moe(moe_config(dtype, moe_token_dispatcher_type=dispatcher))
    assert isinstance(patched.token_dispatcher, LckTokenDispatcher)
    assert type(patched.experts) is LckSequentialMLP
    patched.load_state_dict(stock.state_dict())
    dev = kernel_device()
    return stock.to(dev), patched.to(dev)


@pytest.mark.parametrize(
    ("dispatcher", "dtype"),
    [("alltoall", torch.float32), ("flex", torch.float32), ("alltoall", torch.bfloat16)],
    ids=["alltoall", "flex", "alltoall-bf16"],
)
def test_patched_layer_matches_stock(
    megatron_tp1: None, cpu_gate: None, dispatcher: str, dtype: torch.dtype
) -> None:
    try:
        stock, patched = _stock_and_patched(dtype, dispatcher)
    except (AssertionError, ValueError, ImportError) as exc:
        if dispatcher == "flex" and "lck" not in str(exc):
            pytest.skip(f"this megatron-core does not accept a flex config here: {exc}")
        raise
    dev = kernel_device()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, 32, generator=gen).to(dev, dtype)
    dout = torch.randn(8, 2, 32, generator=gen).to(dev, dtype)
    want = _fwd_bwd(stock, x, dout)
    got = _fwd_bwd(patched, x, dout)
    assert set(got) == set(want)
    for name, ref in want.items():
        assert ref is not None and got[name] is not None, name
        # bf16: two bf16 computations that round at different points, so twice the tolerance against float64
        assert_close(got[name], ref, dtype, name=name, scale=2.0 if dtype == torch.bfloat16 else 1.0)


def test_routing_to_topk_keeps_expert_order_and_marks_unused_slots() -> None:
    from lck_megatron.moe import routing_to_topk

    routing = torch.tensor([[False, True, False, True], [True, False, False, False], [False] * 4])
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7], [1.0, 0.0, 0.0, 0.0], [0.0] * 4], requires_grad=True)
    idx, w = routing_to_topk(routing, probs, 2)
    assert idx.tolist() == [[1, 3], [0, -1], [-1, -1]]
    assert w.tolist() == [[pytest.approx(0.3), pytest.approx(0.7)], [1.0, 0.0], [0.0, 0.0]]
    w.sum().backward()
    assert probs.grad.tolist() == routing.float().tolist()


def test_state_dicts_are_interchangeable(megatron_tp1: None) -> None:
    from lck_megatron import apply_lck_to_megatron

    torch.manual_seed(0)
    stock = build_moe(moe_config(moe_token_dispatcher_type="allgather"))
    apply_lck_to_megatron(rms_norm=False, moe=True)
    patched = build_moe(moe_config())
    a, b = stock.state_dict(), patched.state_dict()
    assert list(a) == list(b), "the patched layer must keep Megatron's parameter names and order"
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]  # Megatron's _extra_state entries are None
    assert all(isinstance(b[k], torch.Tensor) for k in tensors)
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in tensors)
    assert "experts.local_experts.0.linear_fc1.weight" in b and b[
        "experts.local_experts.0.linear_fc1.weight"
    ].shape == (
        2 * FFN,
        32,
    )
    patched.load_state_dict(a, strict=True)
    stock.load_state_dict(b, strict=True)
    assert all(torch.equal(stock.state_dict()[k], patched.state_dict()[k]) for k in tensors)


def test_revert_restores_every_symbol_and_apply_is_idempotent(megatron_tp1: None) -> None:
    from megatron.core.transformer.moe import moe_layer

    from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron
    from lck_megatron.moe import DISPATCHERS

    before = {n: getattr(moe_layer, n) for n in DISPATCHERS}
    init = vars(moe_layer.MoELayer)["__init__"]
    first = apply_lck_to_megatron(rms_norm=False, moe=True)["moe"]
    assert sorted(first) == sorted(
        [f"{moe_layer.__name__}.{n}" for n in DISPATCHERS] + [f"{moe_layer.__name__}.MoELayer.__init__"]
    )
    wrapped = vars(moe_layer.MoELayer)["__init__"]
    assert wrapped is not init and all(getattr(moe_layer, n) is not before[n] for n in DISPATCHERS)
    assert apply_lck_to_megatron(rms_norm=False, moe=True)["moe"] == first  # nothing wrapped twice
    assert vars(moe_layer.MoELayer)["__init__"] is wrapped
    restored = revert_lck_from_megatron()
    assert sorted(restored) == sorted(first)
    assert vars(moe_layer.MoELayer)["__init__"] is init
    assert all(getattr(moe_layer, n) is before[n] for n in DISPATCHERS)
    assert revert_lck_from_megatron() == []


def test_unsupported_layer_stays_megatron_and_logs_once(
    megatron_tp1: None, caplog: pytest.LogCaptureFixture
) -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from lck_megatron import apply_lck_to_megatron
    from lck_megatron.patch import moe_route

    apply_lck_to_megatron(rms_norm=False, moe=True)
    with caplog.at_level(logging.INFO, logger="lck_megatron"):
        layers = [build_moe(moe_config(moe_token_dispatcher_type="allgather")) for _ in range(2)]
    for layer in layers:
        assert type(layer.experts) is SequentialMLP
        assert type(layer.token_dispatcher) is MoEAllGatherTokenDispatcher
    logged = [r.getMessage() for r in caplog.records if "stays on Megatron's path" in r.getMessage()]
    assert len(logged) == 1 and "moe_token_dispatcher_type='allgather'" in logged[0], logged
    route = moe_route()
    assert route.layers["megatron"] >= 2 and any("allgather" in r for r in route.fallback_reasons)


def _cfg(**overrides: Any) -> Any:
    base = dict(
        moe_token_dispatcher_type="alltoall",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"fp8": "hybrid"}, "fp8"),
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"moe_shared_expert_overlap": True}, "moe_shared_expert_overlap"),
        ({"moe_expert_capacity_factor": 1.0}, "capacity"),
        ({"moe_pad_expert_input_to_capacity": True}, "capacity"),
        ({"activation_func": F.gelu}, "SwiGLU"),
        ({"gated_linear_unit": False}, "SwiGLU"),
        ({"moe_apply_probs_on_input": True}, "moe_apply_probs_on_input"),
        ({"moe_expert_rank_capacity_factor": 1.5}, "capacity"),
        ({"cuda_graph_impl": "local"}, "CUDA graphs"),
        ({"delay_wgrad_compute": True}, "delay_wgrad_compute"),
        ({"moe_token_dispatcher_type": "allgather"}, "allgather"),
    ],
)
def test_unsupported_reasons_name_the_setting(overrides: dict[str, Any], named: str) -> None:
    from lck_megatron.moe import unsupported_reason

    reason = unsupported_reason(_cfg(**overrides))
    assert reason is not None and named in reason, reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_patched_layer_matches_stock_alltoall_cuda(megatron_tp1: None, dtype: torch.dtype) -> None:
    stock, patched = _stock_and_patched(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 4, 32, generator=gen).to("cuda", dtype)
    dout = torch.randn(512, 4, 32, generator=gen).to("cuda", dtype)
    want = _fwd_bwd(stock, x, dout)
    got = _fwd_bwd(patched, x, dout)
    for name, ref in want.items():
        assert_close(got[name], ref, dtype, name=name, scale=2.0)


def _tiny_moe_gpt(dispatcher: str = "alltoall") -> Any:
    """The demo's MoE GPTModel (its TransformerConfig MoE fields and spec) at a CPU size."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from lck_megatron._demo_models import PRESETS, _moe_settings

    shape = replace(PRESETS["moe"][0], layers=2, hidden=32, heads=4, experts=E, topk=K, moe_ffn=FFN)
    settings = {**_moe_settings(shape), "moe_token_dispatcher_type": dispatcher}
    config = transformer_config(torch.float32, **settings)
    spec = get_gpt_layer_local_spec(
        num_experts=E, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)


def _stock_and_patched_gpt() -> tuple[Any, Any]:
    from lck_megatron import apply_lck_to_megatron
    from lck_megatron.moe import LckSequentialMLP
    from lck_megatron.patch import moe_route

    torch.manual_seed(0)
    stock = _tiny_moe_gpt(
        "alltoall" if torch.cuda.is_available() else "allgather"
    )  # see the module docstring
    apply_lck_to_megatron(rms_norm=False, moe=True)
    patched = _tiny_moe_gpt()
    assert moe_route().layers == {"lck": 2, "megatron": 0}
    assert sum(type(m) is LckSequentialMLP for m in patched.modules()) == 2
    assert list(stock.state_dict()) == list(patched.state_dict())
    patched.load_state_dict(stock.state_dict())
    return stock, patched


def test_demo_moe_model_is_patched(megatron_tp1: None) -> None:
    """The demo's MoE GPTModel: every MoE layer through lck, Megatron's state dict (its attention needs CUDA,
    so the forward is the gpu test below)."""
    stock, patched = _stock_and_patched_gpt()

    def layout(model: Any) -> dict[str, tuple]:  # what Megatron's dist checkpoint saves and matches on load
        out = {}
        for k, v in model.sharded_state_dict().items():
            shape, offset = tuple(getattr(v, "global_shape", ())), tuple(getattr(v, "global_offset", ()))
            out[k] = (
                type(v).__name__,
                getattr(v, "key", None),
                shape,
                offset,
                getattr(v, "replica_id", None),
            )
        return out

    got, want = layout(patched), layout(stock)
    assert any("local_experts" in k or "experts." in k for k in want)
    assert got == want


@pytest.mark.gpu
def test_demo_moe_model_matches_stock_cuda(megatron_tp1: None) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # Megatron's attention forks this tracker: seed it here, not rely on another test having done so.
    model_parallel_cuda_manual_seed(3)
    stock, patched = _stock_and_patched_gpt()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3)).cuda()
    pos = torch.arange(16, device="cuda").unsqueeze(0).expand(2, 16)
    got = []
    for model in (stock.cuda(), patched.cuda()):
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        got.append((loss.detach(), model.embedding.word_embeddings.weight.grad))
    assert_close(got[1][0], got[0][0], torch.float32, name="loss")
    assert_close(got[1][1], got[0][1], torch.float32, name="embedding gradient", scale=10.0)


def test_demo_moe_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from lck_megatron import demo

    with pytest.raises(SystemExit):
        demo._parse(["--moe", "--shape", "small"])
    assert "--moe trains the moe preset" in capsys.readouterr().err
    args = demo._parse(["--moe"])
    assert (args.shape, args.backend) == ("moe", "megatron")
    if not torch.cuda.is_available():
        assert demo.main(["--moe", "--out", "unused"]) == 2  # Megatron's model needs CUDA
        assert "needs a CUDA device" in capsys.readouterr().err


def test_demo_resets_megatron_moe_metrics_between_models() -> None:
    """Megatron's per-layer MoE metrics are sized by the first model that records them: the demo drops them
    (as Megatron's training loop clears them each step), so a deeper model after a shallower one in the
    same process does not fail in its router."""
    from lck_megatron._demo_models import reset_moe_metrics

    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        def record(layer: int, layers: int) -> None:
            get_moe_metrics_tracker().record("load_balancing_loss", torch.tensor(0.5), layer, layers)

    except ImportError:  # Megatron-Core 0.16
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        def record(layer: int, layers: int) -> None:
            save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), layer, layers)

    reset_moe_metrics()
    record(2, 2)
    with pytest.raises(IndexError):
        record(3, 4)
    reset_moe_metrics()
    record(3, 4)
    reset_moe_metrics()


@pytest.mark.gpu
def test_demo_moe_agrees_and_runs_every_layer_through_lck(tmp_path: Any) -> None:
    """``lck demo --moe`` with its defaults: the loss curves agree (the demo's own check), every MoE layer ran
    through lck, peak memory is reported. Tokens/s is printed, not asserted (a timed test would flake on a
    shared GPU): the demo's committed results record it."""
    import json

    from lck_megatron import demo
    from lck_megatron._demo_models import PRESETS

    assert demo.main(["--moe", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "demo.json").read_text())
    shape, _ = PRESETS["moe"]
    assert payload["preset"] == "moe"
    assert payload["runs"][1]["lck_calls"]["moe_layers"] == {"lck": shape.layers, "megatron": 0}
    assert all(r["peak_mib"] > 0 for r in payload["runs"])
    assert payload["summary"]["agree"] and payload["summary"]["speedup"] > 0, payload["summary"]


def _ep2_reference(
    router_w: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, xs: list, douts: list, rank: int
):
    """Float64 MoE over every rank's tokens with every expert (Megatron's default router: softmax over the top-k
    logits): this rank's output, its input and router-weight gradients (its own tokens), and the experts'
    weight gradients (every rank's tokens)."""
    r = router_w.double().requires_grad_(True)
    a, b = w1.double().requires_grad_(True), w2.double().requires_grad_(True)
    outs, own = [], None
    for src, (x, dout) in enumerate(zip(xs, douts)):
        xd = x.reshape(-1, x.shape[-1]).double().requires_grad_(src == rank)
        logits = xd @ r.t()
        top = logits.topk(K, dim=1).indices
        mask = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=1)
        h = torch.einsum("th,efh->tef", xd, a)
        act = F.silu(h[..., :FFN]) * h[..., FFN:]
        y = torch.einsum("te,tef,ehf->th", probs, act, b)
        outs.append((y * dout.reshape(y.shape).double()).sum())
        if src == rank:
            own = (xd, y)
    assert own is not None
    dx, dr = torch.autograd.grad(outs[rank], (own[0], r), retain_graph=True)
    da, db = torch.autograd.grad(sum(outs), (a, b))
    return own[1], dx, dr, da, db


def _ep2_worker(rank: int, world: int) -> int:
    """At EP=2 over gloo (Megatron's stock dispatchers need CUDA there): the patched layer, rows through
    lck_ep.Buffer, each rank with its own tokens (uneven counts) and half of the experts, against float64."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter

    from lck_megatron import apply_lck_to_megatron

    TopKRouter.gating = lambda self, x: F.linear(
        x.float(), self.weight.float()
    )  # a spawned process: no revert needed
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    try:
        apply_lck_to_megatron(rms_norm=False, moe=True)
        torch.manual_seed(0)  # the same router on both ranks
        layer = build_moe(moe_config())
        local = layer.experts.local_experts
        assert layer.token_dispatcher.ep_size == 2 and len(local) == E // 2
        g = torch.Generator().manual_seed(5)  # every expert's weights, known on both ranks
        w1 = torch.randn(E, 2 * FFN, 32, generator=g) * 0.2
        w2 = torch.randn(E, 32, FFN, generator=g) * 0.2
        with torch.no_grad():
            for i, expert in enumerate(local):
                expert.linear_fc1.weight.copy_(w1[rank * len(local) + i])
                expert.linear_fc2.weight.copy_(w2[rank * len(local) + i])
        xs, douts = [], []
        for src in range(world):
            gen = torch.Generator().manual_seed(10 + src)
            xs.append(torch.randn(6 + 2 * src, 1, 32, generator=gen))
            douts.append(torch.randn(6 + 2 * src, 1, 32, generator=gen))
        got = _fwd_bwd(layer, xs[rank], douts[rank])
        assert layer.token_dispatcher.buffer is not None
        y, dx, dr, da, db = _ep2_reference(layer.router.weight.detach(), w1, w2, xs, douts, rank)
        mine = slice(rank * len(local), (rank + 1) * len(local))
        want = {"out": y.reshape(xs[rank].shape), "dx": dx.reshape(xs[rank].shape), "router.weight": dr}
        for i in range(len(local)):
            want[f"experts.local_experts.{i}.linear_fc1.weight"] = da[mine][i]
            want[f"experts.local_experts.{i}.linear_fc2.weight"] = db[mine][i]
        assert set(got) == set(want), sorted(got)
        for name, ref in want.items():
            assert_close(got[name], ref, torch.float32, name=f"rank {rank} {name}")
        return len(want)
    finally:
        parallel_state.destroy_model_parallel()


def test_ep2_matches_float64_over_gloo() -> None:
    out = run_interpreted_workers(_ep2_worker, 2, "EP=2", timeout=600)
    assert out == [3 + 2 * (E // 2)] * 2  # out, dx, the router weight, each local expert's two weights
