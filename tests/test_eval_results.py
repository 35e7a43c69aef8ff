import json
import math
import time

import pytest
import torch

from ctxrelay.eval import EvalError
from ctxrelay.eval import results as R
from ctxrelay.eval.plots import heatmap, line_plot, plot_path, scatter_plot


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
    with pytest.raises(EvalError, match="transport"):
        R.write_results("x", [{"method": "m"}], "cmd")
    with pytest.raises(EvalError, match="non-finite"):
        R.write_results("x", [{"transport": "native", "kl": math.nan}], "cmd")
    with pytest.raises(EvalError, match="context_tokens"):
        R.write_results("x", [{"transport": "native", "context_tokens": 0}], "cmd")
    with pytest.raises(EvalError, match="command"):
        R.write_results("x", [], "")
    with pytest.raises(EvalError, match="override"):
        R.write_results("x", [], "cmd", {"rows": []})
    with pytest.raises(EvalError, match="plain file stem"):
        R.write_results("../x", [], "cmd")
    assert not list(tmp_path.iterdir())


def test_repo_root_default():
    root = R.repo_root()
    assert (root / "pyproject.toml").exists() and (root / "src" / "ctxrelay").is_dir()


def test_median_time_counts_calls():
    calls = []
    med, times = R.median_time(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and len(times) == 5 and min(times) <= med <= max(times)
    with pytest.raises(EvalError):
        R.median_time(lambda: None, repeats=0)


def test_machine_busy_share():
    busy = R.machine_busy(sample_s=0.2)
    assert busy is None or 0.0 <= busy <= 1.0
    # a threshold every share meets returns after one sample, however long it may wait
    t0 = time.monotonic()
    busy = R.wait_until_quiet(threshold=1.0, max_wait_s=60, poll_s=0.1)
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
