"""The ``torch.library`` ops of ``vocab_parallel_cross_entropy`` (``lck::vp_cross_entropy_fwd`` / ``_bwd``)
and their autograd registration."""

from __future__ import annotations

import torch

from lck_kernels._common import rows_view
from lck_kernels.vocab_parallel import launch as K
from lck_kernels.vocab_parallel.checks import CE_OP as OP
from lck_kernels.vocab_parallel.checks import check_vocab_parallel_cross_entropy_inputs
from lck_kernels.vocab_parallel.group import Field, TPGroup, agree


@torch.library.custom_op("lck::vp_cross_entropy_fwd", mutates_args=())
def _vp_cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, group_name: str, label_smoothing: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and log-sum-exp (float32, shaped like ``target``). Collective over the group."""
    tp = TPGroup.resolve(OP, group_name)
    error: BaseException | None = None
    try:
        z, t = check_vocab_parallel_cross_entropy_inputs(logits, target, label_smoothing)
        tp.check_device(OP, "logits_shard", logits)
    except (TypeError, ValueError) as exc:
        error, z, t = exc, None, None
    tokens, local_vocab = (z.shape[0], z.shape[1]) if z is not None else (0, 0)
    fields = [
        Field("the operation (every rank must call the same op)", 1),
        Field("the number of tokens (logits_shard's leading dimensions)", tokens),
        Field(
            "the local vocabulary size logits_shard.shape[-1] (every rank must hold an equal shard)",
            local_vocab,
        ),
        Field("label_smoothing", float(label_smoothing)),
        Field("ignore_index", int(ignore_index)),
        Field("whether the group has a runtime FLSCE context (lck_runtime.configure)", tp.ctx is not None),
    ]
    vocab = tp.size * local_vocab
    verdict = agree(
        OP,
        tp,
        fields,
        error=error,
        target=t,
        ignore_index=ignore_index,
        vocab_size=vocab,
        device=tp.comm_device(logits),
    )
    assert z is not None and t is not None
    tp.check_capacity(OP, tokens, local_vocab=local_vocab)
    stats = torch.zeros(tokens, tp.size, K.STATS, device=z.device, dtype=torch.float32)
    K.shard_stats(
        z,
        t,
        stats,
        vocab_start=tp.rank * local_vocab,
        scale=1.0,
        ignore_index=ignore_index,
        slot=tp.rank,
        smoothing=label_smoothing > 0.0,
        entropy=False,
    )
    tp.all_reduce_(stats.view(-1), "sum")
    loss, lse, _ = K.combine(
        stats, t, ignore_index=ignore_index, label_smoothing=label_smoothing, vocab_size=vocab
    )
    if verdict is not None:  # captured, or a group of one rank: NaN where an agreement would have raised
        loss.add_(verdict)
        lse.add_(verdict)
    return loss.view(target.shape), lse.view(target.shape)


@_vp_cross_entropy_fwd.register_fake
def _(logits, target, group_name, label_smoothing, ignore_index):
    check_vocab_parallel_cross_entropy_inputs(logits, target, label_smoothing)
    out = logits.new_empty(target.shape, dtype=torch.float32)
    return out, torch.empty_like(out)


@torch.library.custom_op("lck::vp_cross_entropy_bwd", mutates_args=())
def _vp_cross_entropy_bwd(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    group_name: str,
    label_smoothing: float,
    ignore_index: int,
) -> torch.Tensor:
    """``d loss / d logits_shard`` given the upstream per-token gradient. Local: no communication."""
    tp = TPGroup.resolve(OP, group_name)
    z = rows_view(OP, "logits_shard", logits)
    local_vocab = z.shape[1]
    grad = torch.empty(z.shape, device=z.device, dtype=z.dtype)
    g = grad_loss.reshape(-1)
    K.shard_grad(
        z,
        grad,
        target.reshape(-1),
        lse.reshape(-1).contiguous(),
        None,
        g_loss=g if g.dtype == torch.float32 else g.float(),
        vocab_start=tp.rank * local_vocab,
        vocab_size=tp.size * local_vocab,
        scale=1.0,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    return grad.view(logits.shape)


@_vp_cross_entropy_bwd.register_fake
def _(grad_loss, logits, target, lse, group_name, label_smoothing, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target, group_name, label_smoothing, ignore_index = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.options = (group_name, label_smoothing, ignore_index)


def _backward(ctx, grad_loss, grad_lse):
    logits, target, lse = ctx.saved_tensors
    grad = None
    if ctx.needs_input_grad[0]:
        grad = _vp_cross_entropy_bwd(grad_loss, logits, target, lse, *ctx.options)
    return grad, None, None, None, None


_vp_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)
