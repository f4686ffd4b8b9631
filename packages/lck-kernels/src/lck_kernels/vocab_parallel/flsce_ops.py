"""The ``torch.library`` ops of ``vocab_parallel_fused_linear_scaled_cross_entropy``.

``lck::vp_flsce_fwd`` (chunked forward; with a reduction and a gradient needed, also the gradient of the
reduced NLL), ``lck::vp_flsce_bwd`` (recomputing backward for per-token upstream gradients) and
``lck::vp_scale_`` (in-place scale of a gradient prepared in the forward), each with its fake, plus the
chunk size and per-chunk pieces they share; at the end, the autograd wiring (``register_autograd``).
"""

from __future__ import annotations

import torch

from lck_kernels._common import rows_view
from lck_kernels.vocab_parallel import launch as K
from lck_kernels.vocab_parallel.checks import FLSCE_OP as OP
from lck_kernels.vocab_parallel.checks import _agree_and_check, _check_vp_flsce_inputs
from lck_kernels.vocab_parallel.group import TPGroup


def chunk_rows(tokens: int, local_vocab: int, element_size: int, chunk_bytes: int) -> int:
    """Tokens per chunk: as many rows of ``[local_vocab]`` logits as fit ``chunk_bytes``, a multiple of 256
    when at least 256 (whole GEMM tiles), at least 1 and at most ``tokens``."""
    rows = max(1, int(chunk_bytes) // max(1, local_vocab * element_size))
    if rows >= 256:
        rows -= rows % 256
    return max(1, min(int(tokens), rows))


def _stats(tp, logits, t, stats, local_vocab, tau, ignore_index) -> None:
    K.shard_stats(
        logits,
        t,
        stats,
        vocab_start=tp.rank * local_vocab,
        scale=tau,
        ignore_index=ignore_index,
        slot=tp.rank,
    )


def _chunk_grads(
    tp, logits, x_c, weight, t_c, lse, ent, gs, gx_out, gw, first, local_vocab, tau, ignore_index
):
    """dz of the chunk in place over its logits, then ``gx_out = dz W`` and ``gw (+)= dzᵀ x_c`` (local)."""
    K.shard_grad(
        logits,
        logits,
        t_c,
        lse,
        ent,
        g_loss=gs[0],
        g_lse=gs[1],
        g_entropy=gs[2],
        vocab_start=tp.rank * local_vocab,
        vocab_size=tp.size * local_vocab,
        scale=tau,
        ignore_index=ignore_index,
    )
    if gx_out is not None:
        torch.mm(logits, weight, out=gx_out)
    if gw is not None:
        if first:
            torch.mm(logits.t(), x_c, out=gw)
        else:
            gw.addmm_(logits.t(), x_c)


def _sum_grad_x(tp: TPGroup, grad_x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # Each rank holds the contribution of its vocabulary shard; the gradient is their sum. fp32 on the
    # wire (the context's scratch is fp32; summing bf16 partials would add a rounding step).
    partial = grad_x if grad_x.dtype == torch.float32 else grad_x.float()
    tp.all_reduce_(partial, "sum")
    return (partial if partial.dtype == like.dtype else partial.to(like.dtype)).view(like.shape)


def _grads_by_chunk(tp, x, x2, weight, t, rows, local_vocab, tau, ignore_index, gx, gw, prepare):
    """Both ops' gradient pass: per chunk ``[a, b)`` of ``rows`` tokens, its logits into one reused buffer,
    ``prepare(a, b, logits)`` giving the chunk's (lse, entropy, upstream gradients), then ``_chunk_grads``
    into ``gx[a:b]`` and ``gw``. Returns ``gx`` summed over the group (collective iff ``gx`` is given)."""
    tokens = x2.shape[0]
    buf = torch.empty(rows, local_vocab, device=x.device, dtype=x.dtype) if tokens else None
    for a in range(0, tokens, rows):
        b = min(tokens, a + rows)
        x_c = x2[a:b]
        logits = torch.mm(x_c, weight.t(), out=buf[: b - a])
        lse_c, ent_c, gs = prepare(a, b, logits)
        g_rows = gx[a:b] if gx is not None else None
        _chunk_grads(
            tp,
            logits,
            x_c,
            weight,
            t[a:b],
            lse_c,
            ent_c,
            gs,
            g_rows,
            gw,
            a == 0,
            local_vocab,
            tau,
            ignore_index,
        )
    del buf
    if gw is not None and tokens == 0:
        gw.zero_()
    return _sum_grad_x(tp, gx, x) if gx is not None else None


@torch.library.custom_op("lck::vp_flsce_fwd", mutates_args=())
def _vp_flsce_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group_name: str,
    inverse_temperature: float,
    ignore_index: int,
    chunk_bytes: int,
    grad_flags: int,
    reduction: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nll, lse, entropy, grad_x_pre, grad_weight_pre). Collective over the group.

    nll, lse, entropy: float32 shaped like ``target`` (nll a scalar for ``reduction`` 1 = sum, 2 = mean).
    ``grad_flags``: bit 0 x needs a gradient, bit 1 the weight does. With a reduction and a gradient
    needed, the gradients of the reduced NLL are computed here, chunk by chunk (the statistics all-reduce
    then runs per chunk: a chunk's gradient needs its global LSE) and returned as ``*_pre`` (empty
    otherwise) for the backward to scale.
    """
    tau = inverse_temperature
    tp = TPGroup.resolve(OP, group_name)
    x2, t, local_vocab, verdict = _agree_and_check(
        tp, x, weight, target, tau, ignore_index, chunk_bytes, grad_flags, reduction
    )
    tokens, hidden = x2.shape
    vocab = tp.size * local_vocab
    precompute = reduction != 0 and grad_flags != 0
    rows = chunk_rows(tokens, local_vocab, x.element_size(), chunk_bytes)
    if not precompute:
        # All chunks' statistics first, then one all-reduce and one combine for the whole call.
        buf = torch.empty(rows, local_vocab, device=x.device, dtype=x.dtype) if tokens else None
        stats = torch.zeros(tokens, tp.size, K.STATS, device=x.device, dtype=torch.float32)
        for a in range(0, tokens, rows):
            b = min(tokens, a + rows)
            logits = torch.mm(x2[a:b], weight.t(), out=buf[: b - a])
            _stats(tp, logits, t[a:b], stats[a:b], local_vocab, tau, ignore_index)
        del buf
        tp.all_reduce_(stats.view(-1), "sum")
        nll, lse, ent = K.combine(stats, t, ignore_index=ignore_index, label_smoothing=0.0, vocab_size=vocab)
        gx = gw = None
    else:
        nll, lse, ent = (torch.empty(tokens, device=x.device, dtype=torch.float32) for _ in range(3))
        valid = (t != ignore_index).sum()
        # d(sum nll)/d nll_i = 1, d(mean nll)/d nll_i = 1/n_valid: one device scalar, broadcast by stride 0.
        unit = torch.ones(1, device=x.device, dtype=torch.float32)
        unit = (unit / valid if reduction == 2 else unit).expand(tokens)
        gx = torch.empty(tokens, hidden, device=x.device, dtype=x.dtype) if grad_flags & 1 else None
        gw = torch.empty_like(weight, memory_format=torch.contiguous_format) if grad_flags & 2 else None
        stats = torch.empty(rows, tp.size, K.STATS, device=x.device, dtype=torch.float32)

        def prepare(a, b, logits):
            # the chunk's global statistics first: its gradient needs its global LSE
            st = stats[: b - a]
            st.zero_()
            _stats(tp, logits, t[a:b], st, local_vocab, tau, ignore_index)
            tp.all_reduce_(st.view(-1), "sum")
            out = K.combine(st, t[a:b], ignore_index=ignore_index, label_smoothing=0.0, vocab_size=vocab)
            for full, part in zip((nll, lse, ent), out):
                full[a:b].copy_(part)
            return lse[a:b], ent[a:b], (unit[a:b], None, None)

        gx = _grads_by_chunk(tp, x, x2, weight, t, rows, local_vocab, tau, ignore_index, gx, gw, prepare)
    shape = target.shape
    if reduction == 0:
        nll_out = nll.view(shape)
    else:
        nll_out = nll.sum() if reduction == 1 else nll.sum() / (t != ignore_index).sum()
    if verdict is not None:  # captured, or a group of one rank: NaN where an agreement would have raised
        nll_out.add_(verdict)
        lse.add_(verdict)
    return (
        nll_out,
        lse.view(shape),
        ent.view(shape),
        (gx if gx is not None else x.new_empty(0)),  # distinct empties: outputs may not alias
        (gw if gw is not None else x.new_empty(0)),
    )


@_vp_flsce_fwd.register_fake
def _(x, weight, target, group_name, inverse_temperature, ignore_index, chunk_bytes, grad_flags, reduction):
    _check_vp_flsce_inputs(x, weight, target, inverse_temperature, chunk_bytes)
    lse = x.new_empty(target.shape, dtype=torch.float32)
    nll = torch.empty_like(lse) if reduction == 0 else x.new_empty((), dtype=torch.float32)
    precompute = reduction != 0 and grad_flags != 0
    gx = (
        torch.empty_like(x, memory_format=torch.contiguous_format)
        if precompute and grad_flags & 1
        else x.new_empty(0)
    )
    gw = (
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if precompute and grad_flags & 2
        else x.new_empty(0)
    )
    return nll, lse, torch.empty_like(lse), gx, gw


@torch.library.custom_op("lck::vp_flsce_bwd", mutates_args=())
def _vp_flsce_bwd(
    grad_nll: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    group_name: str,
    inverse_temperature: float,
    ignore_index: int,
    chunk_bytes: int,
    need_grad_x: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight_shard) for per-token upstream gradients, recomputing each chunk's logits from
    the saved global LSE/entropy; an empty tensor for one not needed. Collective iff ``need_grad_x``."""
    tp = TPGroup.resolve(OP, group_name)
    x2 = rows_view(OP, "x", x)
    t = target.reshape(-1)
    tokens, hidden = x2.shape
    local_vocab = weight.shape[0]
    flat = [None if g is None else g.reshape(-1).float() for g in (grad_nll, grad_lse, grad_entropy)]
    lse1, ent1 = lse.reshape(-1).contiguous(), entropy.reshape(-1).contiguous()
    gx = torch.empty(tokens, hidden, device=x.device, dtype=x.dtype) if need_grad_x else None
    gw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_grad_weight else None
    rows = chunk_rows(tokens, local_vocab, x.element_size(), chunk_bytes)

    def prepare(a, b, logits):
        return lse1[a:b], ent1[a:b], tuple(None if g is None else g[a:b] for g in flat)

    gx = _grads_by_chunk(
        tp, x, x2, weight, t, rows, local_vocab, inverse_temperature, ignore_index, gx, gw, prepare
    )
    return (gx if gx is not None else x.new_empty(0)), (gw if gw is not None else x.new_empty(0))


@_vp_flsce_bwd.register_fake
def _(
    grad_nll,
    grad_lse,
    grad_entropy,
    x,
    weight,
    target,
    lse,
    entropy,
    group_name,
    inverse_temperature,
    ignore_index,
    chunk_bytes,
    need_grad_x,
    need_grad_weight,
):
    gx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_grad_x else x.new_empty(0)
    gw = (
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if need_grad_weight
        else x.new_empty(0)
    )
    return gx, gw


@torch.library.custom_op("lck::vp_scale_", mutates_args=("t",))
def _vp_scale_(t: torch.Tensor, s: torch.Tensor) -> None:
    """``t *= s`` (``s`` a one-element tensor) in place; no pass over ``t`` when ``s == 1``."""
    K.scale_(t, s.reshape(1).float())


@_vp_scale_.register_fake
def _(t, s):
    return None


def _setup_context(ctx, inputs, output):
    x, weight, target, group_name, tau, ignore_index, chunk_bytes, grad_flags, reduction = inputs
    _, lse, entropy, gx_pre, gw_pre = output
    ctx.save_for_backward(x, weight, target, lse, entropy, gx_pre, gw_pre)
    ctx.options = (group_name, tau, ignore_index, chunk_bytes)
    ctx.reduction, ctx.grad_flags, ctx.ignore_index = reduction, grad_flags, ignore_index
    ctx.mark_non_differentiable(gx_pre, gw_pre)
    ctx.set_materialize_grads(False)  # an unused output (say, the entropy) costs nothing in backward


def _scaled(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``t · s`` for a gradient prepared in the forward. Eager: in place, with no pass when ``s == 1``
    (decided on the device); a second backward through the graph then fails autograd's saved-tensor
    version check instead of scaling twice. Traced (AOT autograd, torch.compile), where mutating a forward
    output inside the backward graph cannot be partitioned: out of place."""
    if type(t) is torch.Tensor and type(s) is torch.Tensor:
        _vp_scale_(t, s)
        return t
    return t * s


def _backward(ctx, grad_nll, grad_lse, grad_entropy, _gx_pre, _gw_pre):
    x, weight, target, lse, entropy, gx_pre, gw_pre = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    nones = (None,) * 7
    if not (need_x or need_w):
        return (None, None, *nones)
    gx = gw = None
    if ctx.reduction != 0 and grad_nll is not None:
        covered = (not need_x or ctx.grad_flags & 1) and (not need_w or ctx.grad_flags & 2)
        if covered:  # the forward prepared d(reduced nll)/d(x, W): scale by the upstream scalar
            gx = _scaled(gx_pre, grad_nll) if need_x else None
            gw = _scaled(gw_pre, grad_nll) if need_w else None
            grad_nll = None
        else:  # not prepared for every input that needs it: recompute, per token
            per_token = grad_nll if ctx.reduction == 1 else grad_nll / (target != ctx.ignore_index).sum()
            grad_nll = per_token.expand(target.shape)
    if grad_nll is not None or grad_lse is not None or grad_entropy is not None:
        rx, rw = _vp_flsce_bwd(
            grad_nll, grad_lse, grad_entropy, x, weight, target, lse, entropy, *ctx.options, need_x, need_w
        )
        gx = rx if gx is None else gx + rx
        gw = rw if gw is None else gw + rw
    return (gx if need_x else None), (gw if need_w else None), *nones


_vp_flsce_fwd.register_autograd(_backward, setup_context=_setup_context)
