"""Collective agreement: every rank of the bootstrap group learns every rank's request, then all of
them raise the same error, or none does.

A round has two steps:

1. An *arrival barrier* through the default c10d store, bounded by ``LCK_SETUP_TIMEOUT`` seconds
   (default 600): each rank marks its arrival and waits for all of them. A rank that never comes
   (it skipped the call, crashed, or called a different lck collective with another bootstrap group)
   makes the others fail with a ``RuntimeError`` naming the missing ranks, instead of hanging in a
   collective. The store is used rather than a new process group because creating a subgroup on
   part of the world shifts torch's group counters on those ranks only, which would break the
   user's later ``new_group`` calls.
2. An ``all_gather_object`` over the bootstrap group (everyone has arrived, so it completes) of
   each rank's report: the operation name, a local error if the rank's own checks failed, a *plan*
   that must be identical everywhere, and per-rank facts (memberships, host, device).

Errors are then decided from the gathered reports alone, so every rank raises the same exception
type with the same message. A timed-out domain is poisoned: ranks are out of step afterwards, and
every later round on it fails at once with the original diagnostic.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = ["Domain", "agree", "setup_timeout"]

_DEFAULT_TIMEOUT_S = 600.0
_RAISABLE = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}

# Per bootstrap domain (its ordered global ranks): the next round number and, after a timeout, why
# the domain is unusable. Kept for the life of the process: finalize() does not reset the rounds,
# so keys of an earlier configure/finalize cycle can never be mistaken for a later round's.
_rounds: dict[tuple[int, ...], int] = {}
_poisoned: dict[tuple[int, ...], str] = {}


def setup_timeout() -> float:
    """Seconds a setup collective waits for all ranks (``LCK_SETUP_TIMEOUT``, default 600)."""
    raw = os.environ.get("LCK_SETUP_TIMEOUT")
    if raw is None or raw == "":
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"LCK_SETUP_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"LCK_SETUP_TIMEOUT must be > 0 seconds, got {raw!r}")
    return value


@dataclass
class Domain:
    """The bootstrap group as the agreement sees it."""

    group: Any  # torch.distributed.ProcessGroup
    ranks: tuple[int, ...]  # ordered global ranks; bootstrap-local rank i is ranks[i]
    local_rank: int
    tag: str = field(init=False)

    def __post_init__(self) -> None:
        self.tag = hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:16]

    @property
    def size(self) -> int:
        return len(self.ranks)


def _ranks_text(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


def _arrive(domain: Domain, op: str, timeout: float) -> None:
    import torch.distributed as dist

    if domain.ranks in _poisoned:
        raise RuntimeError(
            f"{op}: an earlier lck setup collective over this bootstrap group failed and left the ranks "
            f"out of step ({_poisoned[domain.ranks]}); restart the job"
        )
    store = dist.distributed_c10d._get_default_store()
    seq = _rounds.get(domain.ranks, 0)
    _rounds[domain.ranks] = seq + 1
    base = f"lck/agree/{domain.tag}/{seq}"
    me = domain.local_rank
    store.set(f"{base}/r{me}", op)
    if store.add(f"{base}/count", 1) == domain.size:
        store.set(f"{base}/all", "1")
    store_error: RuntimeError | None = None
    try:
        store.wait([f"{base}/all"], timedelta(seconds=timeout))
    except RuntimeError as exc:  # DistStoreError and the stores' plain timeout errors
        store_error = exc
    if store_error is not None:
        # Raised outside the except block: the store's error is in the message, and an exception the
        # caller was already handling (the failure that sent it to finalize() in a finally) stays
        # chained and shown instead of being hidden behind this timeout.
        missing = [r for r in range(domain.size) if not store.check([f"{base}/r{r}"])]
        global_missing = [domain.ranks[r] for r in missing]
        why = (
            f"{op}: timed out after {timeout:g} s waiting for bootstrap ranks {_ranks_text(missing)} "
            f"(global ranks {_ranks_text(global_missing)}) to call an lck setup collective (round {seq}); "
            "every rank of the bootstrap group must make the same lck_runtime setup calls in the same "
            f"order (raise LCK_SETUP_TIMEOUT to wait longer). Store error: {store_error}"
        )
        _poisoned[domain.ranks] = why
        # A straggler that arrives after this tells the others left; it must not enter the gather.
        store.set(f"{base}/abort", str(me))
        raise RuntimeError(why)
    if store.check([f"{base}/abort"]):
        why = (
            f"{op}: bootstrap rank {store.get(f'{base}/abort').decode()} gave up waiting for this rank "
            f"(round {seq}) before it arrived; the ranks are out of step"
        )
        _poisoned[domain.ranks] = why
        raise RuntimeError(why)
    # Everyone has passed round seq-1 (they all posted round seq): its keys can go.
    if seq > 0:
        prev = f"lck/agree/{domain.tag}/{seq - 1}"
        _delete(store, f"{prev}/r{me}")
        if me == 0:
            _delete(store, f"{prev}/count")
            _delete(store, f"{prev}/all")


def _delete(store: Any, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # some stores cannot delete; stale keys are harmless, rounds never repeat
        pass


def _raise(kind: str, message: str) -> None:
    raise _RAISABLE.get(kind, RuntimeError)(message)


def _error_of(exc: BaseException) -> tuple[str, str]:
    kind = type(exc).__name__
    if kind in _RAISABLE:
        return kind, str(exc)
    return "RuntimeError", f"{kind}: {exc}"


def local_error(exc: BaseException | None) -> tuple[str, str] | None:
    """Pack a rank's own validation failure so that every rank can re-raise it identically."""
    return None if exc is None else _error_of(exc)


def exchange(domain: Domain, op: str, report: Any, *, timeout: float | None = None) -> list[Any]:
    """Bounded arrival barrier, then ``all_gather_object`` of ``report``; returns reports by local rank."""
    import torch.distributed as dist

    _arrive(domain, op, setup_timeout() if timeout is None else timeout)
    out: list[Any] = [None] * domain.size
    dist.all_gather_object(out, report, group=domain.group)
    return out


def agree(
    domain: Domain,
    op: str,
    *,
    error: BaseException | None,
    plan: dict[str, Any],
    facts: Any = None,
) -> list[Any]:
    """One agreement round. Returns every rank's ``facts`` (by bootstrap-local rank).

    Raises on every rank alike: the lowest rank's local ``error`` (same type, message annotated with
    the ranks that reported it), then a disagreement between ranks on the operation or on any key of
    ``plan`` (a ``ValueError`` naming the key and which ranks hold which value).
    """
    report = {"op": op, "error": local_error(error), "plan": plan, "facts": facts}
    reports = exchange(domain, op, report)
    check_ops(op, [r["op"] for r in reports])
    errors = [r["error"] for r in reports]
    if any(e is not None for e in errors):
        kind, message = summarize_errors(errors)
        _raise(kind, message)
    compare_plans(op, [r["plan"] for r in reports])
    return [r["facts"] for r in reports]


def check_ops(op: str, ops: Sequence[str]) -> None:
    if len(set(ops)) > 1:
        raise RuntimeError(
            f"{op}: ranks called different lck setup collectives in the same round: {_groups(ops)}"
        )


def summarize_errors(errors: Sequence[tuple[str, str] | None]) -> tuple[str, str]:
    """The lowest failing rank's error, annotated identically on every rank."""
    failing = [(r, e) for r, e in enumerate(errors) if e is not None]
    _, (kind, message) = failing[0]
    same = [r for r, e in failing if e == (kind, message)]
    others = [r for r, e in failing if e != (kind, message)]
    where = f"on bootstrap rank{'s' if len(same) > 1 else ''} {_ranks_text(same)}"
    if others:
        where += f"; ranks {_ranks_text(others)} failed with other errors"
    return kind, f"{message} ({where})"


def _groups(values: Sequence[Any]) -> str:
    seen: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        seen.setdefault(repr(v), []).append(r)
    return ", ".join(f"{v} on ranks {_ranks_text(rs)}" for v, rs in seen.items())


def compare_plans(op: str, plans: Sequence[dict[str, Any]]) -> None:
    """Raise ``ValueError`` on the first key (in the first rank's key order) whose values differ."""
    keys = list(plans[0])
    for p in plans[1:]:
        for k in p:
            if k not in keys:
                keys.append(k)
    for k in keys:
        values = [p.get(k, "<missing>") for p in plans]
        if any(v != values[0] for v in values[1:]):
            raise ValueError(
                f"{op}: ranks disagree on {k}: {_groups(values)}; every rank of the bootstrap group "
                "must make the same call"
            )
