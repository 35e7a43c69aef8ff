"""`ctxrelay bench load`: the percentiles and the per-level summary, and (real) a served zoo model under
concurrent official-openai clients with no failed request."""

import json

import pytest

from ctxrelay_bench.load import bench as load


def test_percentile_interpolates_between_order_statistics():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert load.percentile(xs, 0) == 1.0 and load.percentile(xs, 100) == 4.0
    assert load.percentile(xs, 50) == pytest.approx(2.5)
    assert load.percentile([7.0], 99) == 7.0 and load.percentile([], 50) is None


def test_summary_counts_429_apart_from_failures():
    res = [
        {"status": "ok", "ttft_s": 0.5, "latency_s": 1.0, "chunks": 4},
        {"status": "ok", "ttft_s": 1.5, "latency_s": 2.0, "chunks": 4},
        {"status": "429", "latency_s": 0.01},
        {"status": "dropped", "latency_s": 0.2},
    ]
    row = load.summarize(res, unfinished=1, wall=4.0, concurrency=4)
    assert row["requests"] == 5 and row["ok"] == 2 and row["rejected_429"] == 1
    assert row["failed"] == 2 and row["unfinished"] == 1  # the dropped one and the unfinished one
    assert row["requests_per_s"] == 0.5 and row["chunks_per_s"] == 2.0
    assert row["ttft_p50_s"] == pytest.approx(1.0)


def test_server_counts_must_equal_the_tool_counts():
    before = {"200": 5, "429": 1}
    assert load.counts_match({"ok": 3, "429": 2}, before, {"200": 8, "429": 3})
    assert not load.counts_match({"ok": 3}, before, {"200": 8, "429": 2})  # a 429 the tool never saw
    assert not load.counts_match({"ok": 3, "dropped": 1}, before, {"200": 8, "429": 1})


def test_unknown_option_is_refused():
    with pytest.raises(Exception, match="unknown load bench option"):
        load.bench(options={"bogus": 1}, command="pytest")


@pytest.mark.real
def test_served_model_under_concurrent_clients(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    opts = {"concurrency": "1,3", "requests": 3, "max_tokens": 3, "warmup": 1, "port": 8397, "max_s": 120.0}
    path = load.bench(model="smollm2-135m", lengths=[64], options=opts, command="pytest")
    doc = json.loads(path.read_text())
    assert [r["concurrency"] for r in doc["rows"]] == [1, 3]
    for r in doc["rows"]:
        assert r["ok"] == 3 and r["failed"] == 0 and r["ttft_p50_s"] <= r["latency_p50_s"]
        assert r["server_counts_match"] and r["server_counts"] == {"200": 3}
    assert path.with_suffix(".png").exists()
