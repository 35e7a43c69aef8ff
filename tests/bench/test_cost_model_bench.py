"""The cost-model check on tiny models, and a profile extended to longer lengths (merge)."""

import pytest

from ctxrelay.bench import cost_model
from ctxrelay.bench.demo import text_for
from ctxrelay.relay.graph import Profile
from ctxrelay.relay.profile import profile_pool
from ctxrelay.serve.testing import relay_pool


@pytest.fixture
def pool(tiny_by_family, tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path / "cache"))  # profile states stay in the test's folder
    return relay_pool(tiny_by_family["llama"], tiny_by_family["qwen2"], tmp_path / "artifacts")


def test_profile_merge_keeps_other_lengths_and_refits(pool):
    pool.refresh(Profile())
    profile_pool(pool, text_for, [64, 128], repeats=1)
    r = pool.models[list(pool.models)[1]].spec.weights_hash
    short = [n for n, _ in pool.profile.native[r].samples]
    profile_pool(pool, text_for, [256], repeats=1, merge=True)
    merged = [n for n, _ in pool.profile.native[r].samples]
    assert len(merged) == 3 and merged[:2] == short and merged[2] > 200
    edge = next(iter(pool.profile.edges.values()))
    assert len(edge.samples) == 3
    profile_pool(pool, text_for, [256], repeats=1)  # without merge: only what was measured now
    assert len(pool.profile.native[r].samples) == 1


def test_predicted_vs_measured_rows_and_plot(pool, tmp_path):
    profile_pool(pool, text_for, [64, 128, 256], repeats=1)
    rows = cost_model.measure(pool, [96, 192], repeats=1, tol=0.15)
    kinds = {r["transport"] for r in rows}
    assert kinds == {"native", "heterofold"}
    assert len(rows) == 2 * (len(pool.models) + 1)
    for r in rows:
        assert r["measured_s"] == pytest.approx(sum(r["components"].values())) and r["measured_s"] > 0
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["within_tolerance"] == (abs(r["error"]) <= 0.15)
    assert all(r["sender"] == list(pool.models)[0] for r in rows if r["transport"] == "heterofold")
    assert cost_model.plot(rows, 0.15, tmp_path / "cm.png").stat().st_size > 0


def test_validation_text_stays_inside_the_window(tiny_by_family):
    m = tiny_by_family["gemma3"]
    window = m.spec.context_window
    if window is None:
        pytest.skip("no window on the tiny gemma3")
    text = cost_model.validation_text(m, window * 2)
    assert len(m.tokenizer(text)["input_ids"]) <= window
