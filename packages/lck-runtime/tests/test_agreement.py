"""Agreement rounds: the same error on every rank, disagreements named, bounded waits."""

from __future__ import annotations

import pytest

from lck_runtime.agreement import check_ops, compare_plans, setup_timeout, summarize_errors
from lck_runtime.testing import run_workers


def test_compare_plans_names_key_and_ranks() -> None:
    plans = [{"a": 1, "b": {"x": 1}}, {"a": 1, "b": {"x": 2}}, {"a": 1, "b": {"x": 1}}]
    with pytest.raises(ValueError) as info:
        compare_plans("configure", plans)
    msg = str(info.value)
    assert msg.startswith("configure: ranks disagree on b:")
    assert "{'x': 1} on ranks [0, 2]" in msg and "{'x': 2} on ranks [1]" in msg
    compare_plans("configure", [{"a": 1}, {"a": 1}])  # equal: no error
    with pytest.raises(
        ValueError, match="ranks disagree on extra: '<missing>' on ranks \\[0\\], 3 on ranks \\[1\\]"
    ):
        compare_plans("configure", [{"a": 1}, {"a": 1, "extra": 3}])


def test_summarize_errors_is_rank_independent() -> None:
    errors = [None, ("ValueError", "bad tp"), ("ValueError", "bad tp"), ("TypeError", "other")]
    assert summarize_errors(errors) == (
        "ValueError",
        "bad tp (on bootstrap ranks [1, 2]; ranks [3] failed with other errors)",
    )
    assert summarize_errors([("TypeError", "x"), None]) == ("TypeError", "x (on bootstrap rank [0])")


def test_check_ops() -> None:
    check_ops("configure", ["configure", "configure"])
    with pytest.raises(RuntimeError, match="'configure' on ranks \\[0\\], 'finalize' on ranks \\[1\\]"):
        check_ops("configure", ["configure", "finalize"])


def test_setup_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LCK_SETUP_TIMEOUT", raising=False)
    assert setup_timeout() == 600.0
    monkeypatch.setenv("LCK_SETUP_TIMEOUT", "2.5")
    assert setup_timeout() == 2.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("LCK_SETUP_TIMEOUT", bad)
        with pytest.raises(ValueError, match="LCK_SETUP_TIMEOUT"):
            setup_timeout()


def _rounds(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from lck_runtime.agreement import Domain, agree

    d = Domain(group=dist.group.WORLD, ranks=tuple(range(world)), local_rank=rank)
    out: dict = {}
    # 1. a clean round returns every rank's facts in rank order
    out["facts"] = agree(d, "op", error=None, plan={"k": 1}, facts={"me": rank})
    # 2. one rank's local error is raised on every rank, same type and message
    try:
        agree(d, "op", error=TypeError("rank-local problem") if rank == 1 else None, plan={"k": 1})
    except TypeError as exc:
        out["local"] = str(exc)
    # 3. a plan disagreement is a ValueError naming the key on every rank
    try:
        agree(d, "op", error=None, plan={"k": 1, "size": 8 if rank == 2 else 4})
    except ValueError as exc:
        out["plan"] = str(exc)
    # 4. ranks in different operations in the same round
    try:
        agree(d, "configure" if rank == 0 else "finalize", error=None, plan={})
    except RuntimeError as exc:
        out["ops"] = str(exc)
    # 5. an unexpected exception type travels as RuntimeError with its name
    try:
        agree(d, "op", error=KeyError("boom") if rank == 0 else None, plan={})
    except RuntimeError as exc:
        out["other"] = str(exc)
    # 6. still in step afterwards
    out["after"] = agree(d, "op", error=None, plan={"k": 2}, facts=rank * 10)
    return out


def test_agreement_rounds_over_three_processes() -> None:
    outs = run_workers(_rounds, 3, timeout=180)
    for o in outs:
        assert o["facts"] == [{"me": 0}, {"me": 1}, {"me": 2}]
        assert o["local"] == "rank-local problem (on bootstrap rank [1])"
        assert o["plan"].startswith("op: ranks disagree on size: 4 on ranks [0, 1], 8 on ranks [2]")
        assert "'configure' on ranks [0], 'finalize' on ranks [1, 2]" in o["ops"]
        assert o["other"] == "KeyError: 'boom' (on bootstrap rank [0])"
        assert o["after"] == [0, 10, 20]
    assert len({o["plan"] for o in outs}) == 1
