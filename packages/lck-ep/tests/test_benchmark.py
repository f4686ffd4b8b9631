"""The EP benchmark runs end to end on the CPU (gloo, one rank) and writes its result files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from lck_ep.benchmark import CPU_SHAPES, main


def test_cpu_smoke_run_writes_json_and_csv(tmp_path: Path, capsys) -> None:
    rc = main(["--cpu", "--gpus", "1", "--iters", "2", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr()
    (json_path,) = tmp_path.glob("cpu-x1-*-ep.json")
    payload = json.loads(json_path.read_text())
    assert payload["meta"]["world"] == 1 and payload["meta"]["backend"] == "gloo"
    assert payload["provenance"]["torch"]
    recs = payload["records"]
    got = {(r["bench"], r["provider"]) for r in recs}
    assert got == {
        ("layout", "torch"),
        ("dispatch", "lck_reference"),
        ("dispatch", "lck_reference_sync_free"),
        ("dispatch_cached", "lck_reference"),
        ("dispatch_expanded", "lck_reference_sync_free"),
        ("combine", "lck_reference"),
        ("combine", "lck_reference_sync_free"),
        ("a2a", "gloo_a2a"),
    }
    for r in recs:
        assert r["error"] is None, r
        assert r["median_ms"] > 0 and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"], r
        assert r["shape"] == CPU_SHAPES[0].label(1)
    rows = list(csv.reader((tmp_path / json_path.name.replace(".json", ".csv")).open()))
    assert rows[0][:5] == ["bench", "provider", "mode", "shape", "dtype"] and len(rows) == len(recs) + 1
    assert "wrote" in capsys.readouterr().out


def test_the_native_bench_toggles_restore_the_attribute_they_set() -> None:
    """``benchmark_native._with`` (behind ``pushed``, ``group_agreement`` and ``blocking_wait``): the value
    holds only while the timed call runs; an attribute of the object's own comes back, one its class held
    shows through again."""
    from lck_ep.benchmark_native import _with

    class State:
        pulls_rows = True

        def __init__(self) -> None:
            self._agree_done = "spinning"

    st, seen = State(), []
    run = _with(st, "_agree_done", "blocking", lambda: seen.append(st._agree_done) or 3)
    assert run() == 3 and seen == ["blocking"] and st._agree_done == "spinning"
    run = _with(st, "pulls_rows", False, lambda: seen.append(st.pulls_rows))
    run()
    assert seen[-1] is False and st.pulls_rows is True and "pulls_rows" not in vars(st)
