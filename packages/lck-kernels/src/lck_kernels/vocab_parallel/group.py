"""The tensor-parallel group plumbing both vocabulary-parallel ops share.

:class:`TPGroup` resolves a group by name and runs its reductions (through the runtime's FLSCE context
when ``lck_runtime.configure(flsce=...)`` prepared one, else ``torch.distributed``); :func:`agree` makes
the ranks agree on a call (shapes, options, targets, each rank's input validity) in one small all-reduce
and raises the same error on every rank; :func:`check_target` validates targets against the rows they
label. Used by ``vocab_parallel_cross_entropy`` and ``vocab_parallel_fused_linear_scaled_cross_entropy``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lck_kernels._common import check_tensor
from lck_kernels.vocab_parallel import capture
from lck_kernels.vocab_parallel import digest as D

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

    def check_device(self, op: str, name: str, t: torch.Tensor) -> None:
        """``t`` is on the device the runtime context was configured for (any device without a context)."""
        if self.ctx is not None and t.device != self.ctx.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but lck_runtime.configure prepared {self.ctx.device}"
            )

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
            from lck_runtime.collectives import torch_all_reduce_

            return torch_all_reduce_(t, op, self.group)
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
_ROW = _HEAD + _MSG_BYTES + N_FIELDS * _FIELD_LIMBS + D.TARGET_FIELDS * D.TARGET_LIMBS
_TARGET_AT = _HEAD + _MSG_BYTES + N_FIELDS * _FIELD_LIMBS


def _limbs(value: int) -> list[float]:
    u = (int(value) + (1 << 63)) & ((1 << 64) - 1)
    return [float((u >> (D.LIMB_BITS * k)) & 0xFFFF) for k in range(_FIELD_LIMBS)]


def _unlimbs(limbs: list[float]) -> int:
    u = sum(int(x) << (D.LIMB_BITS * k) for k, x in enumerate(limbs))
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


def _row(error: BaseException | None, values: list[int]) -> list[float]:
    """This rank's agreement row: validity, error kind and message, or the encoded fields (targets: zeros)."""
    row = [0.0] * _ROW
    if error is not None:
        msg = str(error).encode("utf-8", "replace")[:_MSG_BYTES]
        row[0], row[1], row[2] = 1.0, 1.0 if isinstance(error, TypeError) else 2.0, float(len(msg))
        row[_HEAD : _HEAD + len(msg)] = [float(b) for b in msg]
    else:
        for i, value in enumerate(values):
            at = _HEAD + _MSG_BYTES + i * _FIELD_LIMBS
            row[at : at + _FIELD_LIMBS] = _limbs(value)
    return row


def _raise_on_rejection_or_disagreement(
    op: str, tp: TPGroup, fields: list[Field], rows: list[list[float]]
) -> None:
    """The same error on every rank (every rank holds the same ``rows``) if any rank rejected its inputs
    or the ranks disagree on a field."""
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


def agree(
    op: str,
    tp: TPGroup,
    fields: list[Field],
    *,
    error: BaseException | None,
    target: torch.Tensor | None,
    ignore_index: int,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Collective over ``tp.group``: raise the same ``TypeError``/``ValueError`` on every rank if any rank
    rejected its inputs (``error``), if the ranks disagree on any field or on the targets, or if a target
    lies outside ``[0, vocab_size)`` without being ``ignore_index``. One small all-reduce and a host sync;
    returns None.

    A group of one rank has no peer to agree with: its local problems raise from the host, and the target
    range is checked on the device (no host sync, which would hold the host until the forward is done,
    once per call): the return value is then a 0-D float32 tensor, 0.0 or NaN, for the op to add to its
    loss, as ``lck_kernels.cross_entropy`` turns such a target into NaN.

    Inside CUDA-graph capture the validity and fields are agreed through the host on the group's gloo
    mirror (the same errors on every rank, at capture time; the call's fields must also have been agreed
    eagerly before, on every rank), and the target checks run on the device at every replay: the return
    value is then a 0-D float32 tensor, 0.0 or NaN, for the op to add to its loss
    (``capture.py``).
    """
    if len(fields) > N_FIELDS:
        raise AssertionError(f"{op}: {len(fields)} agreement fields > {N_FIELDS}")
    values = [_encode(f.value) for f in fields]
    capturing = capture.capturing(device)
    if tp.size == 1 and not capturing:  # one rank cannot disagree with itself: only its own error can raise
        if error is not None:
            _raise_on_rejection_or_disagreement(op, tp, fields, [_row(error, values)])
        capture.remember(tp.name, values, device, tp.group)  # a later capture needs this eager agreement
        return None if target is None else D.range_verdict(target, ignore_index, vocab_size)
    row = _row(error, values)
    if capturing:
        agreed = error is None and capture.agreed_before(tp.name, values, device)
        rows = capture.host_rows(op, tp, [*row[:_TARGET_AT], 1.0 if agreed else 0.0])
        _raise_on_rejection_or_disagreement(op, tp, fields, rows)
        missing = [r for r in range(tp.size) if rows[r][-1] == 0.0]
        if missing:
            raise capture.not_agreed_error(op, tp, missing)
        return capture.captured_agreement(
            op, tp, values, target=target, ignore_index=ignore_index, vocab_size=vocab_size, device=device
        )
    buf = torch.zeros(tp.size, _ROW, device=device, dtype=torch.float32)
    buf[tp.rank].copy_(torch.tensor(row, dtype=torch.float32))
    if error is None and target is not None:
        digest = torch.empty(D.TARGET_FIELDS * D.TARGET_LIMBS, device=target.device, dtype=torch.float32)
        D.target_digest(target, ignore_index, digest)
        buf[tp.rank, _TARGET_AT:].copy_(digest)
    if tp.size > 1:
        from lck_runtime.collectives import reduces_on_host

        if reduces_on_host(tp.group):
            # The rows are read on the host anyway: gloo gets that copy, not its own CUDA path (extra
            # streams, and a context on GPU 0 for a rank of another GPU).
            buf = buf.cpu()
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=tp.group)
    rows = buf.cpu().tolist()
    _raise_on_rejection_or_disagreement(op, tp, fields, rows)
    if target is not None:
        _check_targets(op, tp, rows, ignore_index, vocab_size)
    capture.remember(tp.name, values, device, tp.group)
    return None


def _check_targets(op: str, tp: TPGroup, rows: list[list[float]], ignore_index: int, vocab_size: int) -> None:
    digests = [tuple(rows[r][_TARGET_AT:]) for r in range(tp.size)]
    if len(set(digests)) > 1:
        raise ValueError(
            f"{op}: target differs between the ranks of the tensor-parallel group; every rank must pass "
            f"the same targets (they index the whole vocabulary, not the local shard)"
        )
    lo, hi, _ = D.decode_target_digest(list(digests[0]))
    if lo <= hi and (lo < 0 or hi >= vocab_size):
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
