"""The host cost of the agreement every synced call and Buffer construction makes (:mod:`lck_ep.agreement`):
its torch calls per agreement stay a handful, whatever the number of digest fields, ranks and experts, so
that it costs about its all-gather. (A torch op per field and per rank had cost the host several times the
all-gather itself on every synced dispatch and combine.) The verdicts themselves are tested with the calls
that make them (``test_reference.py``, ``test_capture.py``)."""

from __future__ import annotations

from typing import Any

from lck_runtime.testing import run_workers

# torch calls of one agreement with an extra part: the head tensor, the extra's conversion and reshape, the
# concatenation, its length, the output and its rows, the all-gather, the host copy, the head columns and
# their conversion to Python ints, the returned columns (71 before they were read as Python ints).
BUDGET = 12


def _count_torch_calls(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    from lck_ep.agreement import DIGEST_FIELDS, agree

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    group, cpu = dist.group.WORLD, torch.device("cpu")
    experts = 256
    n = 1 + world + experts
    extra = torch.arange(n, dtype=torch.int64)
    digest = [1] * len(DIGEST_FIELDS)
    agree(group, cpu, None, DIGEST_FIELDS, digest, extra, n)  # warm the group up
    out: dict[str, Any] = {}
    with Count() as c:
        table = agree(group, cpu, None, DIGEST_FIELDS, digest, extra, n)
    out["with extra"] = c.names
    out["table"] = table.tolist()
    with Count() as c:
        agree(group, cpu, None, DIGEST_FIELDS, digest, None, 0)
    out["without extra"] = c.names
    return out


def test_agreement_makes_a_handful_of_torch_calls() -> None:
    for rank, out in enumerate(run_workers(_count_torch_calls, 2, timeout=120)):
        assert len(out["with extra"]) <= BUDGET, (rank, out["with extra"])
        assert len(out["without extra"]) <= BUDGET, (rank, out["without extra"])
        # every rank's extra part comes back in rank order
        assert out["table"] == [list(range(1 + 2 + 256))] * 2


def _through_gather(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lck_ep.agreement import DIGEST_FIELDS, RoutedCounts, agree

    group, cpu = dist.group.WORLD, torch.device("cpu")
    calls: list[tuple[int, bool, int, int, int]] = []
    settled: list[bool] = []

    class Exchange:  # what NativeEp.agree_start returns, over gloo here
        def __init__(self, vec: torch.Tensor) -> None:
            parts = [torch.empty_like(vec) for _ in range(world)]
            dist.all_gather(parts, vec, group=group)
            self._table = torch.stack(parts)

        def table(self) -> torch.Tensor:
            return self._table

        def settle(self, refused: bool) -> None:
            settled.append(refused)

    def gather(
        head: list[int], routed: RoutedCounts | None, n: int, check_words: int, flag_word: int
    ) -> Exchange:
        # as ep_agree assembles it: the head (kernel arguments), the routing's words, zeros
        calls.append((len(head), routed is not None, n, check_words, flag_word))
        words = [torch.tensor(head, dtype=torch.int64)] + ([routed.words()] if routed is not None else [])
        whole = torch.cat(words)
        return Exchange(torch.cat([whole, whole.new_zeros(n - whole.numel())]))

    digest = [1] * len(DIGEST_FIELDS)
    out: dict[str, Any] = {"table": agree(group, cpu, None, DIGEST_FIELDS, digest, None, 2, gather).tolist()}
    other = [1] * len(DIGEST_FIELDS)
    other[DIGEST_FIELDS.index("hidden")] = 7 + rank
    try:
        agree(group, cpu, None, DIGEST_FIELDS, other, None, 2, gather)
    except ValueError as exc:
        out["disagree"] = str(exc)
    try:
        agree(
            group,
            cpu,
            TypeError("x is float64") if rank == 1 else None,
            DIGEST_FIELDS,
            digest,
            None,
            2,
            gather,
        )
    except TypeError as exc:
        out["local"] = str(exc)
    try:  # a device exchange takes the routing's words or none, not a tensor of them (refused on every rank)
        agree(group, cpu, None, DIGEST_FIELDS, digest, torch.tensor([1, 0]), 2, gather)
    except TypeError as exc:
        out["tensor extra"] = str(exc)
    # a fresh dispatch's routing words: a flag for an entry outside [-1, 4), then the counts, read by the exchange
    counts = torch.tensor([3 + rank, 1], dtype=torch.int32), torch.tensor([1, 2, 0, 1], dtype=torch.int32)
    idx = torch.tensor([[0, -1], [3, 1]])
    routed = RoutedCounts(idx, 4, *counts)
    table = agree(group, cpu, None, DIGEST_FIELDS, digest, routed, 7, gather, lambda ranks: "unused")
    out["routed"] = table.tolist()
    if rank == 1:
        idx = torch.tensor([[0, -1], [4, 1]])
    try:
        flagged_routed = RoutedCounts(idx, 4, *counts)
        agree(
            group, cpu, None, DIGEST_FIELDS, digest, flagged_routed, 7, gather, lambda ranks: f"out: {ranks}"
        )
    except ValueError as exc:
        out["routed flag"] = str(exc)
    # over the group (no gather) the same words are made with torch ops
    out["group"] = agree(group, cpu, None, DIGEST_FIELDS, digest, routed, 7).tolist()
    out["calls"], out["settled"] = calls, settled
    return out


def test_agreement_through_a_gather_function_reaches_the_same_verdicts() -> None:
    """``agree(..., gather)`` (the native backend's device agreement) exchanges the vector through ``gather``
    once per agreement and reads it as the group's all-gather would: the extra part in rank order, a
    disagreement, a rank's local error and a flagged extra word raised alike on every rank (the messages still
    travel through the group), each after the exchange has been told the verdict (``settle``), so that the
    device can clear its refusal."""
    outs = run_workers(_through_gather, 2, timeout=120)
    for out in outs:
        assert out["table"] == [[0, 0], [0, 0]]  # no extra part: zeros, written by the exchange
        assert "Buffer.dispatch: ranks disagree on hidden (rank 0: 7, rank 1: 8)" in out["disagree"], out
        assert out["local"] == "rank 1: x is float64", out["local"]
        assert "extra must be RoutedCounts or None" in out["tensor extra"], out
        # the device checks the status and the 11 digest words, and with a flag the first extra word; the
        # head goes to the exchange as ints, the routing beside it, neither assembled here
        head = 1 + 11
        assert out["calls"][:3] == [(head, False, head + 2, 12, -1)] * 3
        assert out["calls"][3:] == [(head, True, head + 7, 12, 12)] * 2
        assert out["routed"] == [[0, 3, 1, 1, 2, 0, 1], [0, 4, 1, 1, 2, 0, 1]]  # every rank's, in rank order
        assert out["group"] == out["routed"]
        assert out["routed flag"] == "out: [1]", out
        # the device is told the verdict, which it reached itself: agreed, two refusals, agreed, a refusal
        assert out["settled"] == [False, True, True, False, True]
