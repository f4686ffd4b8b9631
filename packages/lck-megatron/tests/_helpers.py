"""Shared pieces of lck-megatron's tests: tolerances, float64 references, small Megatron models."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

# (relative Frobenius error, atol scaled by max|ref|, rtol) per dtype, as in lck-kernels' tests.
TOL = {
    torch.float32: (1e-5, 1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3, 1e-2),
    torch.bfloat16: (1e-2, 1.6e-2, 3e-2),
}


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, name: str, scale: float = 1.0
) -> None:
    """Relative Frobenius error and elementwise closeness against a float64 reference; NaN never passes."""
    rel, atol, rtol = (t * scale for t in TOL[dtype])
    o, r = out.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    assert o.shape == r.shape, f"{name}: shape {tuple(o.shape)} != reference {tuple(r.shape)}"
    assert not torch.isnan(o).any(), f"{name}: NaN in output"
    err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel:.1e} ({dtype})"
    torch.testing.assert_close(
        o, r, atol=atol * max(1.0, r.abs().max().item()), rtol=rtol, msg=lambda m: f"{name} ({dtype}): {m}"
    )


def kernel_device() -> torch.device:
    """Where a test runs lck's Triton kernels: the CPU under TRITON_INTERPRET=1, else CUDA, else skip."""
    from lck_kernels._common import kernel_device_type

    if kernel_device_type() == "cpu" or torch.cuda.is_available():
        return torch.device(kernel_device_type())
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 to run Triton kernels")


def swiglu_ref(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up on the last dimension's halves, in float64."""
    a, b = y.double().chunk(2, dim=-1)
    return F.silu(a) * b


def init_megatron_parallel(tp: int) -> None:
    """Megatron's parallel_state over the already-initialised default group (gloo on CPU)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tp:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def transformer_config(dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A small SwiGLU TransformerConfig built on the CPU (no CUDA RNG tracker needed)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_mlp(config: Any) -> Any:
    """Megatron's dense MLP (ColumnParallelLinear fc1 with gate|up, RowParallelLinear fc2)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


def mlp_reference(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """The float64 output of an unsharded (TP=1) Megatron MLP: fc2(silu(x W1_gateᵀ) · x W1_upᵀ)."""
    w1 = mlp.linear_fc1.weight.detach().double()
    w2 = mlp.linear_fc2.weight.detach().double()
    h = x.detach().double() @ w1.t()
    return swiglu_ref(h) @ w2.t()


def build_gpt(config: Any, vocab_size: int = 64, seq: int = 16, tied: bool = False) -> Any:
    """A Megatron GPTModel with the local (non-TE) layer spec; buildable on the CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq,
        share_embeddings_and_output_weights=tied,
    )


def run_postprocess(
    model: Any, hidden: torch.Tensor, labels: torch.Tensor, dloss: torch.Tensor, *, positional: bool = True
) -> dict[str, torch.Tensor]:
    """GPTModel._postprocess (output layer + loss, what ``linear_cross_entropy`` replaces) on ``hidden``
    ``[s, b, h]`` and its backward with ``dloss`` ``[b, s]``: the loss, hidden and output-weight gradients."""
    model.zero_grad(set_to_none=True)
    x = hidden.detach().clone().requires_grad_(True)
    ids = torch.zeros_like(labels)
    if positional:
        loss = model._postprocess(x, ids, ids, labels, None, None, None)
    else:
        loss = model._postprocess(
            hidden_states=x,
            input_ids=ids,
            position_ids=ids,
            labels=labels,
            rotary_pos_emb=None,
            rotary_pos_cos=None,
            rotary_pos_sin=None,
        )
    loss.backward(dloss)
    tied = model.share_embeddings_and_output_weights
    weight = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
    return {"loss": loss.detach(), "hidden grad": x.grad, "weight grad": weight.grad.clone()}


def run_mlp(mlp, x: torch.Tensor, dout: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward+backward of a Megatron MLP on a copy of ``x``: output, input and weight gradients."""
    for p in mlp.parameters():
        p.grad = None
    xi = x.detach().clone().requires_grad_(True)
    out, out_bias = mlp(xi)
    assert out_bias is None
    out.backward(dout)
    return {
        "output": out.detach(),
        "input grad": xi.grad,
        "fc1 weight grad": mlp.linear_fc1.weight.grad.clone(),
        "fc2 weight grad": mlp.linear_fc2.weight.grad.clone(),
    }


def stock_and_patched_mlp(
    mlp, x: torch.Tensor, dout: torch.Tensor, in_place: bool, where: str = ""
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``run_mlp`` on Megatron's stock SwiGLU, then again with lck's patched in (and reverted after); the
    patched run must have taken lck's kernel, not the fallback."""
    from megatron.core.transformer import mlp as mlp_module

    from lck_megatron import apply_lck_to_megatron, revert_lck_from_megatron

    stock = run_mlp(mlp, x, dout)
    apply_lck_to_megatron(rms_norm=False, swiglu=True, swiglu_in_place=in_place)
    impl = mlp_module.bias_swiglu_impl
    patched = run_mlp(mlp, x, dout)
    assert impl.calls == {"lck": 1, "fallback": 0}, (
        f"{where}the patched MLP did not run lck's kernel: {impl.calls}"
    )
    revert_lck_from_megatron()
    return stock, patched


def run_interpreted_workers(fn, world: int, what: str, timeout: float) -> list:
    """``fn(rank, world)`` on ``world`` gloo processes under Triton's interpreter; skipped unless this
    process runs the interpreter too (the CPU variant)."""
    import os

    from lck_runtime.testing import run_workers

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"CPU {what} needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return run_workers(fn, world, timeout=timeout, env={"TRITON_INTERPRET": "1"})
