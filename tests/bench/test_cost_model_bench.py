"""The cost-model check on tiny models, and a profile extended to longer lengths (merge)."""

import pytest

from ctxrelay.artifact import Artifact
from ctxrelay.demo import text_for
from ctxrelay.models.capture import capture_state
from ctxrelay.relay.gate import decide
from ctxrelay.relay.graph import Profile
from ctxrelay.relay.profile import profile_pool, refit_profile
from ctxrelay_bench.cost_model import bench as cost_model
from ctxrelay_bench.harness import relay_pool


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


def test_only_missing_measures_the_points_a_profile_lacks_and_keeps_the_rest(pool):
    """`ctxrelay profile --only-missing`: a new artifact's operating points get measured, nothing else."""
    pool.refresh(Profile())
    profile_pool(pool, text_for, [64, 128], repeats=1)
    kept = dict(pool.profile.edges)
    native = {h: list(cm.samples) for h, cm in pool.profile.native.items()}
    dropped = next(iter(kept))
    del pool.profile.edges[dropped]  # as if the artifact had gained this point since
    profile_pool(pool, text_for, [64, 128], repeats=1, only_missing=True)
    assert set(pool.profile.edges) == set(kept)
    assert all(pool.profile.edges[k] is kept[k] for k in kept if k != dropped)  # not measured again
    assert len(pool.profile.edges[dropped].samples) == 2
    assert {h: list(cm.samples) for h, cm in pool.profile.native.items()} == native


def test_a_swapped_artifact_is_not_judged_by_the_cost_its_predecessor_measured(pool, tmp_path):
    """A recalibrated or upgraded artifact may relay at another cost: the gate does not use the old one's
    cost model, says why, and `--only-missing` measures the new one (and nothing else)."""
    pool.refresh(Profile())
    profile_pool(pool, text_for, [64, 128], repeats=1)
    (edge,) = pool.graph.calibrated
    assert edge.artifact_digest and all(p.cost.artifact == edge.artifact_digest for p in edge.points)
    pool.profile.save(tmp_path / "profile.json")  # the digest survives the stored profile
    stored = Profile.load(tmp_path / "profile.json").edges
    assert {k: cm.artifact for k, cm in stored.items()} == {k: cm.artifact for k, cm in pool.profile.edges.items()}
    art = Artifact.load(edge.artifact_path)
    art.tensors = {k: v + 0.01 for k, v in art.tensors.items()}  # recalibrated: other tensors, same edge
    art.save(edge.artifact_path)
    pool.refresh()
    (edge2,) = pool.graph.calibrated
    assert edge2.artifact_digest != edge.artifact_digest
    assert all(p.cost is None and p.stale_cost for p in edge2.points)
    s, r = pool.models.values()
    d = decide(pool.graph, capture_state(s, text_for(s, 64), "t"), r.spec.weights_hash, 64, quality_threshold=0.0)
    assert d.transport == "native" and "measured with another artifact" in d.reason
    native = {h: list(cm.samples) for h, cm in pool.profile.native.items()}
    profile_pool(pool, text_for, [64, 128], repeats=1, only_missing=True)
    (edge3,) = pool.graph.calibrated
    assert all(p.cost is not None and p.cost.artifact == edge2.artifact_digest for p in edge3.points)
    assert {h: list(cm.samples) for h, cm in pool.profile.native.items()} == native  # not measured again


def test_a_cost_recorded_before_digests_is_used_and_measured_again_by_only_missing(pool):
    """Profiles written before costs recorded their artifact: the gate still uses them (nothing to tell it
    otherwise), and `--only-missing` measures them again, tied to the installed artifact."""
    pool.refresh(Profile())
    profile_pool(pool, text_for, [64, 128], repeats=1)
    for cm in pool.profile.edges.values():
        cm.artifact = ""  # as a profile from an earlier version stored it
    pool.refresh(pool.profile)
    (edge,) = pool.graph.calibrated
    assert all(p.cost is not None and not p.stale_cost for p in edge.points)
    old = {k: list(cm.samples) for k, cm in pool.profile.edges.items()}
    profile_pool(pool, text_for, [64, 128], repeats=1, only_missing=True)
    assert all(cm.artifact == edge.artifact_digest for cm in pool.profile.edges.values())
    assert set(pool.profile.edges) == set(old)


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


def test_refit_and_judging_earlier_measurements_again(pool, tmp_path):
    """`ctxrelay profile --refit` fits the stored samples again (nothing measured); the bench's
    `measured=` option judges an earlier run's measurements with the profile as it is now."""
    from ctxrelay.errors import UsageError

    profile_pool(pool, text_for, [64, 128, 256], repeats=1)
    path = tmp_path / "profile.json"
    r = pool.models[list(pool.models)[1]].spec.weights_hash
    pool.profile.native[r].coeffs["prefill_s"] = [5.0, 0.0, 0.0]  # a fit gone stale
    pool.profile.save(path)
    assert refit_profile(path) == path
    refitted = Profile.load(path).native[r]
    assert refitted.samples == pool.profile.native[r].samples
    assert refitted.total(128) < 1.0  # the tiny model's prefill, not the stale 5 s
    with pytest.raises(UsageError, match="run `ctxrelay profile` first"):
        refit_profile(tmp_path / "none.json")
    rows = cost_model.measure(pool, [96], repeats=1, tol=0.15)
    again = cost_model.predicted_again(pool, rows, 0.15)
    assert [(a["transport"], a["model"], a["point"], a["measured_s"]) for a in again] == [
        (b["transport"], b["model"], b["point"], b["measured_s"]) for b in rows
    ]
    assert [a["predicted_s"] for a in again] == pytest.approx([b["predicted_s"] for b in rows])
    unknown = cost_model.predicted_again(pool, [{**rows[0], "model": "not-in-the-pool"}], 0.15)
    assert "predicted_s" not in unknown[0]  # kept, unjudged
    with pytest.raises(UsageError, match="not the rows of a `bench cost-model` run"):
        cost_model.predicted_again(pool, [{"method": "guided", "speedup": 1.2}], 0.15)


def test_validation_text_stays_inside_the_window(tiny_by_family):
    m = tiny_by_family["gemma3"]
    window = m.spec.context_window
    if window is None:
        pytest.skip("no window on the tiny gemma3")
    text = cost_model.validation_text(m, window * 2)
    assert len(m.tokenizer(text)["input_ids"]) <= window
