"""Benchmark result files carry provenance and every record."""

from __future__ import annotations

import csv
import json

from lck_runtime.benchmarking import Record, summarize, write_results


def test_write_results_json_and_csv(tmp_path) -> None:
    recs = [
        Record("rms_norm", "lck", "fwd", "16x8", "float32", median_ms=0.5, extra={"gbps": 1.0}),
        Record("rms_norm", "torch", "fwd", "16x8", "float32", error="RuntimeError: boom"),
    ]
    paths = write_results(recs, tmp_path, "cpu-test", meta={"note": "unit"})
    data = json.loads(paths["json"].read_text())
    for key in ("date", "commit", "torch", "triton", "gpu"):
        assert key in data["provenance"], key
    assert [r["provider"] for r in data["records"]] == ["lck", "torch"]
    rows = list(csv.DictReader(paths["csv"].open()))
    assert rows[0]["median_ms"] == "0.5" and rows[1]["error"] == "RuntimeError: boom"


def test_summarize_quantiles() -> None:
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median_ms"] == 3.0 and s["p20_ms"] == 2.0 and s["p80_ms"] == 4.0
