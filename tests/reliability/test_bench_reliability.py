"""`ctxrelay bench reliability` writes its counts and the bar check they give."""

import json

import pytest

from ctxrelay.cli import bench_module
from ctxrelay_bench.reliability.bench import TOTALS


def test_bench_writes_counted_totals(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    opts = {"fuzz_cases": 20, "tenant_cases": 10, "kills": 2, "contexts": 40, "cli_cases": 0}
    path = bench_module("reliability").bench(options=opts, command="ctxrelay bench reliability (test)")
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert {k: sum(r[k] for r in rows) for k in TOTALS} == doc["totals"]
    assert doc["totals"]["unhandled"] == doc["totals"]["requests_failed"] == 0
    assert doc["measured"]["sigkill_repeats"] == opts["kills"]
    assert doc["bar_met"] is False  # 20 fuzz cases and 2 kills are below the bar, and the file says so
    assert len(doc["fault_kinds"]) >= doc["bar"]["fault_kinds"]


@pytest.mark.real  # the whole bench at the bar's counts (about a minute, most of it the CLI processes)
def test_the_full_bench_meets_the_bar(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    doc = json.loads(bench_module("reliability").bench(command="ctxrelay bench reliability").read_text())
    assert doc["bar_met"], {k: doc[k] for k in ("totals", "measured")}
