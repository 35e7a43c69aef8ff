import json
import math
import time

import pytest
import torch

from ctxrelay import results as R
from ctxrelay.errors import UsageError
from ctxrelay_bench import runs
from ctxrelay_bench.plots import heatmap, line_plot, plot_path, scatter_plot


def test_machine_facts():
    facts = R.machine_facts()
    assert facts["torch_threads"] == torch.get_num_threads()
    assert facts["cores"] >= 1 and facts["device"] in ("cpu", "cuda")
    assert facts["torch"] == torch.__version__ and facts["cpu_model"]


def test_write_results_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    rows = [{"transport": "native", "method": "prefill", "receiver": "m", "context_tokens": 8, "native_ttft_s": 0.1}]
    path = R.write_results("unit", rows, "ctxrelay bench native --model m", {"notes": "x"})
    assert path == tmp_path / "unit.json"
    doc = json.loads(path.read_text())
    assert doc["command"] == "ctxrelay bench native --model m"
    assert doc["rows"] == rows and doc["notes"] == "x"
    assert doc["machine"]["torch_threads"] == torch.get_num_threads()
    assert R.read_results(path) == doc


def test_write_results_refuses_bad_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    with pytest.raises(UsageError, match="transport"):
        R.write_results("x", [{"method": "m"}], "cmd")
    with pytest.raises(UsageError, match="non-finite"):
        R.write_results("x", [{"transport": "native", "kl": math.nan}], "cmd")
    with pytest.raises(UsageError, match="context_tokens"):
        R.write_results("x", [{"transport": "native", "context_tokens": 0}], "cmd")
    with pytest.raises(UsageError, match="command"):
        R.write_results("x", [], "")
    with pytest.raises(UsageError, match="override"):
        R.write_results("x", [], "cmd", {"rows": []})
    with pytest.raises(UsageError, match="plain file stem"):
        R.write_results("../x", [], "cmd")
    assert not list(tmp_path.iterdir())


def test_machine_busy_share():
    busy = runs.machine_busy(sample_s=0.2)
    assert busy is None or 0.0 <= busy <= 1.0
    # a threshold every share meets returns after one sample, however long it may wait
    t0 = time.monotonic()
    busy = runs.wait_until_quiet(threshold=1.0, max_wait_s=60, poll_s=0.1)
    assert busy is None or 0.0 <= busy <= 1.0
    assert time.monotonic() - t0 < 5


def test_plots_write_png(tmp_path):
    p = plot_path(tmp_path / "a.json")
    assert p == tmp_path / "a.png"
    line_plot(p, {"m": ([512, 1024], [1.0, 2.1])}, xlabel="x", ylabel="y", logx=True, logy=True)
    scatter_plot(tmp_path / "b.png", {"g": ([1, 2], [0.5, 0.9])}, xlabel="x", ylabel="y", hline=0.85)
    heatmap(tmp_path / "c.png", [[0, 1], [2, 3]], xlabel="x", ylabel="y")
    for name in ("a", "b", "c"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_every_committed_results_file_validates():
    from ctxrelay.paths import repo_root

    files = sorted((repo_root() / "benchmarks" / "results").glob("*.json"))
    assert files
    for path in files:
        doc = R.read_results(path)
        assert doc["command"] and doc["machine"]["torch_threads"] >= 1, path.name
        R.validate_rows(doc["rows"])
