"""Cross-rank agreement before a collective: every rank raises the same error, or none does.

Each rank validates its own arguments, then contributes one int64 vector to an all-gather over the
group: ``[status, digest fields..., extra...]``. ``status`` is 0 when the local checks passed; the
digest holds the call's host-known parameters (operation, hidden size, dtype, top-k, handle sequence
number, ...); ``extra`` carries device-computed values the caller needs from every rank anyway (the
dispatch counts, a flag for out-of-range expert indices), so the agreement costs no extra collective
on the dispatch path. After the gather every rank holds the same matrix and derives the same verdict:

- some rank failed locally: the failing ranks' messages are shared (``all_gather_object``, only on this
  error path) and every rank raises the same text with the lowest failing rank's kind of exception
  (``TypeError``, ``ValueError``, else ``RuntimeError`` naming the original type);
- the digests differ: every rank raises ``ValueError`` naming the first differing field and each
  rank's value.

The vector has the same length for every operation of a Buffer, so a rank calling ``combine`` while
another calls ``dispatch`` is reported as a disagreement on ``op``, not a mismatched collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from lck_ep.host_copy import to_device

__all__ = [
    "BUFFER_FIELDS",
    "DEVICE_AGREEMENT",
    "DIGEST_FIELDS",
    "OPS",
    "Agreement",
    "Exchange",
    "RoutedCounts",
    "agree",
    "dtype_code",
    "start_agreement",
]

# The parameters of a dispatch or combine call that every rank must pass identically.
DIGEST_FIELDS = (
    "op",
    "hidden",
    "dtype",
    "num_topk",
    "cached",
    "handle_seq",
    "expand",
    "expert_alignment",
    "num_worst_tokens",
    "has_topk_weights",
    "num_bias",
)
# The construction parameters of a Buffer.
BUFFER_FIELDS = (
    "op",
    "max_tokens_per_rank",
    "hidden",
    "num_topk",
    "num_experts",
    "sync_free",
    "device_type",
    "native",
    "early_receive_bytes",
)
OPS = {1: "dispatch", 2: "combine", 3: "__init__"}
# BUFFER_FIELDS' "native": 0 reference, 1 native, this for a native state whose synced calls agree through the
# workspaces (unless EP_DEVICE_AGREEMENT=0), else the hybrid pair's settings (2 + a 48-bit hash: below this).
DEVICE_AGREEMENT = 1 << 62
_DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}
_DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in _DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.get(dtype, 0)


def _show(field: str, value: int) -> str:
    if field == "op":
        return OPS.get(value, str(value))
    if field == "dtype":
        return _DTYPE_NAMES.get(value, "other")
    if field == "device_type":
        return {0: "cpu", 1: "cuda"}.get(value, "other")
    if field == "native":
        names = {0: "reference", 1: "nvshmem, EP_DEVICE_AGREEMENT=0", DEVICE_AGREEMENT: "nvshmem"}
        return names.get(value, f"nvshmem, hybrid settings {value}")
    if field in ("cached", "expand", "has_topk_weights", "sync_free"):
        return str(bool(value))
    return str(value)


class RoutedCounts(NamedTuple):
    """A fresh dispatch's extra words, left to whoever builds the vector: a flag word, 1 when an entry of
    ``topk_idx`` lies outside ``[-1, num_experts)``, then the layout's int32 tokens per rank and per expert
    widened to int64. The device exchange reads them in its own kernel (no launch of their own); over the group
    :meth:`words` computes them with torch ops."""

    topk_idx: torch.Tensor  # [T, K] int64, contiguous
    num_experts: int
    per_rank: torch.Tensor  # [W] int32, contiguous
    per_expert: torch.Tensor  # [E] int32, contiguous

    def words(self) -> torch.Tensor:
        # An entry outside [-1, e) is one whose (entry + 1) // (e + 1) is not 0: three launches, not five.
        bad = torch.floor_divide(self.topk_idx + 1, self.num_experts + 1).any().reshape(1)
        return torch.cat([bad, self.per_rank, self.per_expert]).to(torch.int64)


class Exchange(Protocol):
    """A device all-gather already enqueued (:meth:`lck_ep.native.NativeEp.agree_start`)."""

    def table(self) -> torch.Tensor:
        """The gathered ``[world, n]`` int64 matrix on the CPU (waits for the exchange only)."""
        ...

    def settle(self, refused: bool) -> None:
        """Tell the device the host's verdict, which it reached on the same table."""
        ...


# (the vector's head as ints: status and digest words, the routing words that follow it or None, the vector's
# length, words checked on the device: status and digest, the extra flag word or -1) -> the exchange
Gather = Callable[[list[int], "RoutedCounts | None", int, int, int], Exchange]


class Agreement:
    """One agreement, started by :func:`start_agreement`; :meth:`result` raises its verdict or returns the
    gathered extra part. When ``deferred``, the verdict is read only there: work enqueued on the stream before
    it is skipped on every rank if the arguments are refused (the device reached the same verdict first)."""

    def __init__(self, result: Callable[[], torch.Tensor], deferred: bool) -> None:
        self._result: Callable[[], torch.Tensor] | None = result
        self._table: torch.Tensor | None = None
        self.deferred = deferred

    def result(self) -> torch.Tensor:
        if self._result is not None:
            read, self._result = self._result, None
            self._table = read()
        assert self._table is not None
        return self._table


def agree(
    group: dist.ProcessGroup,
    device: torch.device,
    local_error: BaseException | None,
    fields: Sequence[str],
    digest: Sequence[int] | None,
    extra: torch.Tensor | RoutedCounts | None,
    extra_len: int,
    gather: Gather | None = None,
    flag: Callable[[list[int]], str] | None = None,
) -> torch.Tensor:
    """All-gather ``[status, digest, extra]`` and raise the same error everywhere on any problem.

    ``digest`` has one int per entry of ``fields`` (ignored when ``local_error`` is set; ``fields``
    must be the same sequence on every rank);
    ``extra`` is an int64 device tensor of ``extra_len`` elements (over the group only), a
    :class:`RoutedCounts` (its flag and counts, ``extra_len`` words), or None (zeros are sent). Returns the
    gathered ``extra`` part, ``[world, extra_len]`` int64 on the CPU. Collective over ``group``; it
    synchronises the host with the device once (the ``.cpu()`` of the gathered matrix). ``gather``, when
    given, all-gathers the vector (built on ``device``) in place of the group's all-gather (a native state's
    :meth:`lck_ep.native.NativeEp.agree_start`); the group then carries only the messages of a failure.
    ``flag``, when given, refuses the call if the extra part's first word is set on any rank: ``ValueError``
    with ``flag(those ranks)``.
    """
    return start_agreement(
        group, device, local_error, fields, digest, extra, extra_len, gather, flag
    ).result()


def start_agreement(
    group: dist.ProcessGroup,
    device: torch.device,
    local_error: BaseException | None,
    fields: Sequence[str],
    digest: Sequence[int] | None,
    extra: torch.Tensor | RoutedCounts | None,
    extra_len: int,
    gather: Gather | None = None,
    flag: Callable[[list[int]], str] | None = None,
) -> Agreement:
    """:func:`agree` in two steps. Over the group it is complete on return (a refusal raises here); through
    ``gather`` the exchange is only enqueued and the returned agreement is ``deferred``."""
    n = len(fields)
    head = [1 if local_error is not None else 0]
    head += [0] * n if local_error is not None or digest is None else [int(v) for v in digest]
    if local_error is not None:
        extra = None
    if gather is None:
        # Without waiting for the stream: a synced call must not first wait for every earlier launch.
        vec = to_device(head, torch.int64, device)
        if extra_len:
            if isinstance(extra, RoutedCounts):
                extra = extra.words()
            tail = (
                extra.to(device=device, dtype=torch.int64).reshape(-1)
                if extra is not None
                else torch.zeros(extra_len, dtype=torch.int64, device=device)
            )
            vec = torch.cat([vec, tail])
        world = dist.get_world_size(group)
        gathered = vec.new_empty(world, vec.numel())
        dist.all_gather(list(gathered.unbind(0)), vec, group=group)
        try:
            table = _verdict(group, local_error, fields, gathered.cpu(), flag if extra_len else None)
        except _Refused as refused:
            raise refused.error from None
        return Agreement(lambda: table, deferred=False)
    # The exchange takes the head as ints (no copy to the device) and reads a dispatch's routing words itself;
    # it writes zeros for an absent extra part.
    if extra is not None and not isinstance(extra, RoutedCounts):
        raise TypeError("start_agreement: through a device exchange, extra must be RoutedCounts or None")
    # The device checks the status and digest words, and the flag word, exactly as _verdict does.
    exchange = gather(
        head, extra, len(head) + extra_len, 1 + n, 1 + n if flag is not None and extra_len else -1
    )

    def result() -> torch.Tensor:
        # exchange.table() raises NativeTimeoutError itself when a member did not arrive.
        try:
            table = _verdict(group, local_error, fields, exchange.table(), flag if extra_len else None)
        except _Refused as refused:
            exchange.settle(True)
            raise refused.error from None
        exchange.settle(False)
        return table

    return Agreement(result, deferred=True)


class _Refused(RuntimeError):
    """The verdict's error, carried out of _verdict so that the device is told before it is raised."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _verdict(
    group: dist.ProcessGroup,
    local_error: BaseException | None,
    fields: Sequence[str],
    table: torch.Tensor,
    flag: Callable[[list[int]], str] | None,
) -> torch.Tensor:
    """The verdict on the gathered ``table`` (the same on every rank): raise :class:`_Refused` carrying the
    error to raise, or return the extra part."""
    n = len(fields)
    # The verdicts read the status and digest columns as Python ints, converted at once: a torch op per
    # field and rank had cost the host several times the all-gather itself.
    heads = table[:, : 2 + n if flag is not None else 1 + n].tolist()
    world = len(heads)
    failed = [r for r in range(world) if heads[r][0] != 0]
    if failed:
        local = None
        if local_error is not None:
            kind = "TypeError" if isinstance(local_error, TypeError) else "ValueError"
            if not isinstance(local_error, (TypeError, ValueError)):
                kind = "RuntimeError"
            local = (
                kind,
                f"{local_error}"
                if kind != "RuntimeError"
                else f"{type(local_error).__name__}: {local_error}",
            )
        messages: list[tuple[str, str] | None] = [None] * world
        dist.all_gather_object(messages, local, group=group)
        first = failed[0]
        kind, text = messages[first] or ("ValueError", "invalid arguments")
        also = f" (ranks {failed} failed their checks)" if len(failed) > 1 else ""
        exc_type = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        # The local message already names the operation; prefix the rank so every rank reads the same.
        raise _Refused(exc_type(f"rank {first}: {text}{also}"))
    for i, field in enumerate(fields, start=1):
        if any(row[i] != heads[0][i] for row in heads):
            values = ", ".join(f"rank {r}: {_show(field, heads[r][i])}" for r in range(world))
            # Worded from the gathered table only, so that it reads the same on every rank.
            op = OPS.get(heads[0][1], "call")
            raise _Refused(
                ValueError(
                    f"Buffer.{op}: ranks disagree on {field} ({values}); every rank of the group must make "
                    "the same call with the same parameters"
                )
            )
    if flag is not None:
        flagged = [r for r in range(world) if heads[r][1 + n]]
        if flagged:
            raise _Refused(ValueError(flag(flagged)))
    return table[:, 1 + n :]
