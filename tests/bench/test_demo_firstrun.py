"""The demo's first run on tiny models: it measures only the cost points its request needs (the receivers'
native prefill and the sender -> receiver points the gate would judge on cost), once, and writes the
first-run record `make demo` asks for."""

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

import ctxrelay.relay.profile as profile_module
from ctxrelay.demo import DemoConfig, FirstRun, run_demo, text_for
from ctxrelay.models.capture import capture_state
from ctxrelay.relay import ModelPool
from ctxrelay.relay.gate import decide
from ctxrelay.relay.graph import Profile
from ctxrelay.relay.profile import REACH, profile_pool, profiled_points
from ctxrelay_bench.harness import zero_artifact

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pool(tiny_by_family, tmp_path, monkeypatch):
    """llama sends to qwen2 (an artifact that passes the quality threshold) and gemma3 (one that does not);
    qwen2 -> gemma3 and gemma3 -> llama have artifacts too: edges the demo's request does not use."""
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path / "cache"))  # profile states and the fresh-cache check
    llama, qwen2, gemma3 = (tiny_by_family[f] for f in ("llama", "qwen2", "gemma3"))
    for i, (s, r, top1) in enumerate(((llama, qwen2, 0.9), (llama, gemma3, 0.5), (qwen2, gemma3, 0.9),
                                      (gemma3, llama, 0.9))):  # fmt: skip
        art = zero_artifact(s, r)
        art.quality = {"top1_agreement": top1}
        art.save(tmp_path / "artifacts" / f"heterofold-{i}.safetensors")
    p = ModelPool([llama, qwen2, gemma3], artifact_dirs=[tmp_path / "artifacts"], profile=Profile())
    p.profile_path = tmp_path / "profile.json"
    return p


def _cfg(pool) -> DemoConfig:
    s, *rs = pool.models
    return DemoConfig(sender=s, receivers=tuple(rs), tokens=160, max_new_tokens=4)


def _run(pool, tmp_path, **firstrun):
    console = Console(record=True, width=400)  # the progress lines unwrapped
    record = FirstRun(tmp_path / "results" / "demo-firstrun.json", **firstrun)
    rows = run_demo(_cfg(pool), console, None, "pytest", pool=pool, firstrun=record)
    return rows, console.export_text(), json.loads(record.path.read_text())


def test_the_demo_measures_only_what_its_request_needs_and_only_once(pool, tmp_path, monkeypatch):
    llama, qwen2, gemma3 = (m.spec.weights_hash for m in pool.models.values())
    (used,) = pool.graph.edges_between(llama, qwen2)
    # before: the gate answers natively for a point it has no cost for, and says so
    d = decide(pool.graph, capture_state(next(iter(pool.models.values())), "a plain context " * 4, "t"), qwen2, 64)
    assert d.transport == "native" and "no native cost profile" in d.reason

    rows, out, doc = _run(pool, tmp_path)
    # qwen2's native prefill and the llama -> qwen2 point; not llama's (the sender's) or gemma3's native (no
    # point into it passes the quality threshold), not the refused llama -> gemma3 point, not the edges
    # between receivers or from a receiver
    assert set(pool.profile.native) == {qwen2}
    assert set(pool.profile.edges) == {used.point_key(p) for p in used.points}
    lengths = doc["profile_points"]["lengths"]
    assert len(lengths) == 2 and lengths[0] == lengths[1] // 2
    n_request = rows[0]["context_tokens"]
    for cm in (pool.profile.native[qwen2], *pool.profile.edges.values()):  # the samples bracket the request
        ns = [n for n, _ in cm.samples]
        assert len(ns) == 2 and min(ns) <= n_request <= max(ns) * REACH
    assert "cost model: this request needs 2 points" in out and "2 points measured" in out
    assert "`ctxrelay profile --only-missing` measures them" in out
    assert doc["profile_points"]["needed"] == 2 and len(doc["profile_points"]["measured"]) == 2
    assert doc["fresh_cache"] is True and (tmp_path / "profile.json").exists()
    assert [r["receiver"] for r in rows] == list(pool.models)[1:]
    assert "below the threshold" in rows[1]["reason"]  # gemma3: refused on quality, no cost read

    # a second run measures nothing: every point it needs is in the profile
    saved = (tmp_path / "profile.json").read_text()

    def boom(*a, **k):
        raise AssertionError("measured again")

    for name in ("measure_native", "measure_point", "cached_sender_state"):
        monkeypatch.setattr(profile_module, name, boom)
    _, out2, doc2 = _run(pool, tmp_path)
    assert "all of them are in the profile" in out2 and "nothing to measure" in out2
    assert doc2["profile_points"]["measured"] == [] and doc2["fresh_cache"] is False
    assert (tmp_path / "profile.json").read_text() == saved


def test_a_point_the_profile_holds_at_other_lengths_is_measured_again_at_the_requests(pool, tmp_path):
    """A cost sampled far below the request would extrapolate: the demo extends it (merge keeps the rest)."""
    profile_pool(pool, text_for, [16, 24], repeats=1)
    before = {k: len(cm.samples) for k, cm in pool.profile.edges.items()}
    _, out, doc = _run(pool, tmp_path)
    assert "2 points measured" in out
    llama, qwen2, _ = (m.spec.weights_hash for m in pool.models.values())
    (used,) = pool.graph.edges_between(llama, qwen2)
    for key in before:
        grew = key in {used.point_key(p) for p in used.points}
        assert len(pool.profile.edges[key].samples) == before[key] + (2 if grew else 0)
    assert len(pool.profile.native[qwen2].samples) == 4  # the other models' natives are left as they were
    assert all(len(pool.profile.native[h].samples) == 2 for h in pool.profile.native if h != qwen2)
    assert len(profiled_points(pool)) == 4  # one point per artifact


def test_the_firstrun_record(pool, tmp_path):
    started = time.time() - 5.0
    rows, _, doc = _run(pool, tmp_path, started_at=started, installed_at=started + 2.0)
    for key in ("command", "machine", "rows", "wall_s", "install_s", "zoo_s", "profile_s", "cpu_model", "isa",
                "fresh_cache"):  # fmt: skip
        assert key in doc, key
    assert doc["rows"] == rows and all(isinstance(r["transport"], str) for r in rows)
    assert doc["install_s"] == pytest.approx(2.0) and doc["zoo_s"] == 0.0  # a given pool pulls nothing
    assert doc["wall_s"] >= 5.0 and doc["wall_s"] >= doc["install_s"] + doc["zoo_s"] + doc["profile_s"]
    assert 0.0 < doc["profile_s"] < doc["wall_s"] and doc["started_at"] == started
    assert doc["cpu_model"] == doc["machine"]["cpu_model"] and doc["isa"] in ("amx", "avx512", "avx2", "other")
    assert isinstance(doc["fresh_cache"], bool)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_passes_its_start_install_end_and_the_record_path():
    out = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if "ctxrelay demo" in x)
    assert "--firstrun benchmarks/results/demo-firstrun.json" in line and "--installed-at $(date +%s.%N)" in line
    started = float(line.split("--started-at ")[1].split()[0])
    assert abs(started - time.time()) < 60  # taken as make read the Makefile, before `setup` ran
    assert out.index("pip install -q -e .") < out.index(line)  # setup, then the demo
