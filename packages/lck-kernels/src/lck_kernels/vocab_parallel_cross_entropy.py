"""Vocabulary-parallel (tensor-parallel) cross entropy over a process group.

Each rank of ``group`` holds a contiguous shard of the vocabulary: rank ``r`` of ``tp`` ranks holds the
logits of classes ``[r·V/tp, (r+1)·V/tp)`` (Megatron's split). The per-token loss equals
``torch.nn.functional.cross_entropy`` on the gathered ``[..., V]`` logits (``ignore_index``,
``label_smoothing``, reductions), and the gradient of each shard is that of the gathered logits restricted
to the shard. Compared with Megatron's ``vocab_parallel_cross_entropy`` (per-token losses, no ignore
index), ignored targets here give a loss of 0 and a zero gradient, and ``reduction="mean"`` divides by the
number of non-ignored targets, as torch does.

Communication (collective over ``group``, every rank must call with the same shapes and options):
1. one small all-reduce that checks the call agrees across ranks (token count, shard size, options, the
   targets themselves and their range, each rank's input validity) and ends in a host sync, so a mismatch
   raises the *same* error on every rank before anything is launched;
2. one all-reduce of the per-row shard statistics ``[tokens, tp, 5]`` (an all-gather written as a sum):
   through the runtime's FLSCE context (NVSHMEM when ``lck_runtime.configure(flsce=...)`` made one for this
   group; capacities checked against its ``FusedLinearCrossEntropyConfig`` first), or
   ``torch.distributed.all_reduce`` on ``group`` when the group has no context.
The backward needs no communication: the forward already produced each row's global log-sum-exp.

This module also holds the group plumbing that the fused linear variant
(``vocab_parallel_fused_linear_scaled_cross_entropy``) shares: :class:`TPGroup`, :func:`agree`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lck_kernels import _vocab_parallel_kernels as K
from lck_kernels._common import check_choice, check_same_device, check_tensor, rows_view

OP = "vocab_parallel_cross_entropy"
TARGET_DTYPES = (torch.int64, torch.int32)

# ---------------------------------------------------------------------------------------------------------
# The TP group: membership, the runtime context, reductions
# ---------------------------------------------------------------------------------------------------------


def _runtime_context(group: dist.ProcessGroup) -> Any | None:
    """The runtime's FLSCE context for ``group``, or None when ``configure(flsce=...)`` did not prepare one."""
    from lck_runtime import flsce_context

    return flsce_context(group, required=False)


@dataclass
class TPGroup:
    """A resolved tensor-parallel group and how its reductions run (runtime context or torch.distributed)."""

    group: dist.ProcessGroup
    name: str
    size: int
    rank: int
    ctx: Any | None

    @classmethod
    def resolve(cls, op: str, group_name: str) -> TPGroup:
        from torch.distributed.distributed_c10d import _resolve_process_group

        if not dist.is_initialized():
            raise RuntimeError(f"{op}: torch.distributed is not initialised")
        pg = _resolve_process_group(group_name)
        rank = dist.get_rank(pg)
        if rank < 0:
            raise ValueError(
                f"{op}: this process (global rank {dist.get_rank()}) is not a member of group "
                f"{group_name!r} (ranks {dist.get_process_group_ranks(pg)})"
            )
        return cls(pg, group_name, dist.get_world_size(pg), rank, _runtime_context(pg))

    def comm_device(self, like: Any = None) -> torch.device:
        """Device for this group's torch.distributed collectives: ``like``'s when its backend takes it,
        else CUDA for NCCL groups and CPU otherwise (so a rank with invalid inputs still joins correctly)."""
        backend = str(dist.get_backend(self.group)).lower()
        if isinstance(like, torch.Tensor) and (like.device.type == "cuda" or "gloo" in backend):
            return like.device
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check_capacity(
        self, op: str, tokens: int, *, hidden: int | None = None, local_vocab: int | None = None
    ) -> None:
        """Against the configured ``FusedLinearCrossEntropyConfig`` (same verdict on every rank once agreed)."""
        if self.ctx is not None:
            try:
                self.ctx.check_tokens(tokens, hidden=hidden, local_vocab=local_vocab)
            except ValueError as exc:
                raise ValueError(f"{op}: {exc}") from None

    def all_reduce_(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """In-place sum/max of a contiguous float32 tensor across the group; returns ``t``.

        Through the runtime context when there is one (in pieces of at most ``ctx.capacity`` elements),
        else ``torch.distributed.all_reduce`` on the group.
        """
        if t.numel() == 0 or self.size == 1:
            return t
        if self.ctx is None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
            return t
        # The context's symmetric scratch holds ctx.capacity float32 elements; elementwise reductions
        # can be cut anywhere, and slices of a contiguous 1-D view stay contiguous.
        flat, step = t.view(-1), int(self.ctx.capacity)
        for a in range(0, flat.numel(), step):
            self.ctx.all_reduce_(flat[a : a + step], op)
        return t


def group_name_of(op: str, group: Any) -> str:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op}: group must be a torch.distributed.ProcessGroup (the tensor-parallel group; "
            f"torch.distributed.group.WORLD for all ranks), got {type(group).__name__}"
        )
    return group.group_name


# ---------------------------------------------------------------------------------------------------------
# Agreement: one all-reduce (an all-gather written as a max of non-negative numbers) of each rank's
# validity, message, plan fields and target digest, then the same verdict on every rank.
# ---------------------------------------------------------------------------------------------------------

N_FIELDS = 12
_FIELD_LIMBS = 4
_MSG_BYTES = 320
_HEAD = 3  # has_error, error kind (1 TypeError, 2 ValueError), message length
_ROW = _HEAD + _MSG_BYTES + N_FIELDS * _FIELD_LIMBS + K.TARGET_FIELDS * K.TARGET_LIMBS
_TARGET_AT = _HEAD + _MSG_BYTES + N_FIELDS * _FIELD_LIMBS


def _limbs(value: int) -> list[float]:
    u = (int(value) + (1 << 63)) & ((1 << 64) - 1)
    return [float((u >> (K.LIMB_BITS * k)) & 0xFFFF) for k in range(_FIELD_LIMBS)]


def _unlimbs(limbs: list[float]) -> int:
    u = sum(int(x) << (K.LIMB_BITS * k) for k, x in enumerate(limbs))
    return u - (1 << 63)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(v: int) -> float:
    return struct.unpack("<d", struct.pack("<q", v))[0]


@dataclass
class Field:
    label: str  # what the ranks must agree on, as the error message names it
    value: int | float | bool


def _encode(value: int | float | bool) -> int:
    return _float_bits(value) if isinstance(value, float) else int(value)


def agree(
    op: str,
    tp: TPGroup,
    fields: list[Field],
    *,
    error: BaseException | None,
    target: torch.Tensor | None,
    ignore_index: int,
    vocab_size: int | None,
    device: torch.device,
) -> None:
    """Collective over ``tp.group``: raise the same ``TypeError``/``ValueError`` on every rank if any rank
    rejected its inputs (``error``), if the ranks disagree on any field or on the targets, or if a target
    lies outside ``[0, vocab_size)`` without being ``ignore_index``. One small all-reduce and a host sync.
    """
    if len(fields) > N_FIELDS:
        raise AssertionError(f"{op}: {len(fields)} agreement fields > {N_FIELDS}")
    row = [0.0] * _ROW
    if error is not None:
        msg = str(error).encode("utf-8", "replace")[:_MSG_BYTES]
        row[0], row[1], row[2] = 1.0, 1.0 if isinstance(error, TypeError) else 2.0, float(len(msg))
        row[_HEAD : _HEAD + len(msg)] = [float(b) for b in msg]
    else:
        for i, f in enumerate(fields):
            at = _HEAD + _MSG_BYTES + i * _FIELD_LIMBS
            row[at : at + _FIELD_LIMBS] = _limbs(_encode(f.value))
    buf = torch.zeros(tp.size, _ROW, device=device, dtype=torch.float32)
    buf[tp.rank].copy_(torch.tensor(row, dtype=torch.float32))
    if error is None and target is not None:
        digest = torch.empty(K.TARGET_FIELDS * K.TARGET_LIMBS, device=target.device, dtype=torch.float32)
        K.target_digest(target, ignore_index, digest)
        buf[tp.rank, _TARGET_AT:].copy_(digest)
    if tp.size > 1:
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=tp.group)
    rows = buf.cpu().tolist()

    bad = [r for r in range(tp.size) if rows[r][0] > 0]
    if bad:
        r = bad[0]
        text = bytes(int(b) for b in rows[r][_HEAD : _HEAD + int(rows[r][2])]).decode("utf-8", "replace")
        also = f" (rank(s) {bad[1:]} of the group also rejected theirs)" if len(bad) > 1 else ""
        exc = TypeError if rows[r][1] == 1.0 else ValueError
        raise exc(f"{op}: rank {r} of the tensor-parallel group rejected its inputs{also}: {text}")
    for i, f in enumerate(fields):
        at = _HEAD + _MSG_BYTES + i * _FIELD_LIMBS
        vals = [_unlimbs(rows[r][at : at + _FIELD_LIMBS]) for r in range(tp.size)]
        if len(set(vals)) > 1:
            shown = [_bits_float(v) if isinstance(f.value, float) else v for v in vals]
            if isinstance(f.value, bool):
                shown = [bool(v) for v in vals]
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            raise ValueError(
                f"{op}: the ranks of the tensor-parallel group disagree on {f.label} ({per_rank})"
            )
    if target is None:
        return
    digests = [tuple(rows[r][_TARGET_AT:]) for r in range(tp.size)]
    if len(set(digests)) > 1:
        raise ValueError(
            f"{op}: target differs between the ranks of the tensor-parallel group; every rank must pass "
            f"the same targets (they index the whole vocabulary, not the local shard)"
        )
    lo, hi, _ = K.decode_target_digest(list(digests[0]))
    if vocab_size is not None and lo <= hi and (lo < 0 or hi >= vocab_size):
        bad_value = lo if lo < 0 else hi
        raise ValueError(
            f"{op}: target contains {bad_value}, outside the vocabulary [0, {vocab_size}) "
            f"(= tp {tp.size} x local vocabulary {vocab_size // tp.size}) and not ignore_index={ignore_index}"
        )


def check_target(op: str, target: Any, rows_shape: tuple[int, ...], rows_name: str) -> torch.Tensor:
    check_tensor(op, "target", target, dtypes=TARGET_DTYPES)
    if tuple(target.shape) != rows_shape:
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)}; expected {rows_shape} (the leading "
            f"dimensions of {rows_name})"
        )
    return target.reshape(-1)


# ---------------------------------------------------------------------------------------------------------
# The torch.library ops
# ---------------------------------------------------------------------------------------------------------


def _check_vocab_parallel_cross_entropy_inputs(
    logits: Any, target: Any, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(OP, "logits_shard", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"{OP}: logits_shard must be [..., local_vocab] with local_vocab >= 1, got {tuple(logits.shape)}"
        )
    z = rows_view(OP, "logits_shard", logits)
    t = check_target(OP, target, tuple(logits.shape[:-1]), "logits_shard")
    check_same_device(OP, logits_shard=logits, target=target)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{OP}: label_smoothing must be in [0, 1], got {label_smoothing}")
    return z, t


@torch.library.custom_op("lck::vp_cross_entropy_fwd", mutates_args=())
def _vp_cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, group_name: str, label_smoothing: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and log-sum-exp (float32, shaped like ``target``). Collective over the group."""
    tp = TPGroup.resolve(OP, group_name)
    error: BaseException | None = None
    try:
        z, t = _check_vocab_parallel_cross_entropy_inputs(logits, target, label_smoothing)
        if tp.ctx is not None and logits.device != tp.ctx.device:
            raise ValueError(
                f"{OP}: logits_shard is on {logits.device} but lck_runtime.configure prepared {tp.ctx.device}"
            )
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
    agree(
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
    return loss.view(target.shape), lse.view(target.shape)


@_vp_cross_entropy_fwd.register_fake
def _(logits, target, group_name, label_smoothing, ignore_index):
    _check_vocab_parallel_cross_entropy_inputs(logits, target, label_smoothing)
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

# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "none",
) -> torch.Tensor:
    """Cross entropy of logits sharded over the vocabulary across ``group`` (collective over ``group``).

    Args:
        logits_shard: ``[..., V/tp]`` float32/float16/bfloat16, unit stride in the last dimension; rank
            ``r`` of ``group`` holds the classes ``[r·V/tp, (r+1)·V/tp)``. All ranks hold equal shards.
        target: ``[...]`` int64/int32 class indices into the *whole* vocabulary ``[0, V)``, the same on
            every rank, or ``ignore_index``.
        group: the tensor-parallel ``ProcessGroup``. Its reductions go through the runtime's FLSCE context
            when ``lck_runtime.configure(flsce=...)`` prepared one for it (capacities are then checked
            against that ``FusedLinearCrossEntropyConfig``), else through ``torch.distributed``.
        label_smoothing: in ``[0, 1]``, torch's definition (uniform over the whole vocabulary ``V``).
        ignore_index: targets equal to it give loss 0 and a zero gradient.
        reduction: ``"none"`` (per-token, shaped like ``target``), ``"sum"`` or ``"mean"`` (over the
            non-ignored targets; NaN when all are ignored, as in torch).

    Returns the loss in ``logits_shard.dtype`` (computed in float32), equal to
    ``F.cross_entropy(gathered_logits, target, ...)`` within rounding. Differentiable w.r.t.
    ``logits_shard``; the backward is local (no communication).

    Validation: local problems (dtype, device, shape, stride, option range) and disagreements between the
    ranks (token count, shard size, options, targets, target range, runtime context) raise the same
    ``TypeError``/``ValueError`` on every rank; so does exceeding the configured capacities.
    """
    name = group_name_of(OP, group)
    check_choice(OP, "reduction", reduction, ("none", "sum", "mean"))
    for arg, value in (("logits_shard", logits_shard), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{OP}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    loss, _ = _vp_cross_entropy_fwd(logits_shard, target, name, float(label_smoothing), int(ignore_index))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / (target != ignore_index).sum()
    return loss.to(logits_shard.dtype)


class LckVocabParallelCrossEntropy(torch.nn.Module):
    """``nn.Module`` form of :func:`vocab_parallel_cross_entropy` (``forward(logits_shard, target)``)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "none",
    ) -> None:
        super().__init__()
        check_choice(OP, "reduction", reduction, ("none", "sum", "mean"))
        self.group, self.label_smoothing, self.ignore_index, self.reduction = (
            group,
            label_smoothing,
            ignore_index,
            reduction,
        )

    def forward(self, logits_shard: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits_shard,
            target,
            self.group,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )
