"""Calibration on tiny models (end to end, resumable), diagnosis decisions, relay_prefill contract."""

import pytest
import torch

from conftest import SAMPLE_TEXT
from ctxrelay.artifact import Artifact
from ctxrelay.errors import BindingError, UsageError
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tiny import tiny_model
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.state import ContextState
from ctxrelay.transports import mapflow
from ctxrelay.transports.mapflow.calibration import diagnose
from ctxrelay.transports.mapflow.calibration.fit import CalibOptions, Refused
from ctxrelay.transports.mapflow.sparse import MapsError

OPTS = dict(
    block=16,
    ctx_tokens=96,
    eval_tokens=112,
    cost_tokens=128,
    suffix_tokens=16,
    train_texts=3,
    select_texts=2,
    heldout_texts=2,
    diag_texts=2,
    diag_rows=16,
    train_steps=4,
    tv_max=0.9,
    min_top1=0.5,
    top_p=0.9,
)


def _texts(n, seed):
    words = SAMPLE_TEXT.split()
    g = torch.Generator().manual_seed(seed)
    return [" ".join(words[i] for i in torch.randint(0, len(words), (90,), generator=g).tolist()) for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    return tiny_model("qwen2", layers=6, seed=1), tiny_model("qwen2", layers=4, seed=0)


@pytest.fixture(scope="module")
def artifact(pair, tmp_path_factory):
    sender, receiver = pair
    out = tmp_path_factory.mktemp("mf") / "tiny.safetensors"
    opts = dict(OPTS, cache_dir=str(out.parent / "cache"))
    art = mapflow.calibrate(sender, receiver, _texts(3, 0), _texts(2, 1), opts, "test", out, True)
    return art, out


def _state(m, text, top_p=0.95, block=16, capture="exact"):
    return capture_state(m, text, "t1", [mapflow.map_capture_plan(m, top_p, block, capture=capture)], kv=False)


def test_calibration_writes_a_bound_artifact_with_quality(artifact, pair):
    art, out = artifact
    sender, receiver = pair
    loaded = Artifact.load(out, transport=mapflow.TRANSPORT, version=mapflow.ARTIFACT_VERSION)
    loaded.check(sender, receiver)
    q = loaded.quality
    assert 0.0 <= q["top1_agreement"] <= 1.0 and q["kl"] >= 0.0 and q["heldout_contexts"] == 2
    assert q["training"]["history"] and q["diagnosis"]["mapping"] in ("best", "suffix")
    p = loaded.params
    assert len(p["modes"]) == receiver.spec.num_layers and p["top_p"] == 0.9 and p["block"] == 16
    assert out.with_suffix(".diagnosis.png").exists()
    for j, mode in enumerate(p["modes"]):
        if mode in ("replace", "guided"):
            w = loaded.tensors[f"w.{j}"]
            assert w.shape == (sender.spec.num_heads, receiver.spec.num_heads)
            assert torch.allclose(w.sum(0), torch.ones(w.shape[1]), atol=1e-4) and (w >= 0).all()


def test_calibration_resumes_from_its_checkpoint(pair, artifact, tmp_path):
    sender, receiver = pair
    _, out = artifact
    logs = []
    opts = dict(OPTS, cache_dir=str(out.parent / "cache"), train_steps=6)
    mapflow.calibrate(sender, receiver, _texts(3, 0), _texts(2, 1), opts, "test", None, True, log=logs.append)
    assert any("resuming W training at step 4" in m for m in logs)


def test_relay_prefill_contract(artifact, pair):
    art, _ = artifact
    sender, receiver = pair
    st = _state(sender, SAMPLE_TEXT)
    suffix = tokenize_context(receiver, " Question: what?")[0]
    out = mapflow.relay_prefill(receiver, st, art, suffix)
    assert out.logits.shape == (1, receiver.spec.vocab_size)
    assert out.cache.length == st.num_tokens + suffix.shape[0]
    assert set(out.timings) <= {"copy_s", "assemble_s", "first_token_s"} and out.components_s > 0
    assert out.info["state_top_p"] == 0.95 and out.info["top_p"] == 0.9
    # an empty suffix gives the logits of the last context token
    empty = mapflow.relay_prefill(receiver, st, art, torch.zeros(0, dtype=torch.long))
    assert empty.cache.length == st.num_tokens and torch.isfinite(empty.logits).all()


def test_relay_prefill_refuses_mismatches(artifact, pair):
    art, _ = artifact
    sender, receiver = pair
    st = _state(sender, SAMPLE_TEXT)
    other = tiny_model("qwen2", layers=4, seed=7)
    with pytest.raises(BindingError):  # artifact's receiver is a different model
        mapflow.relay_prefill(other, st, art, torch.zeros(0, dtype=torch.long))
    with pytest.raises(BindingError, match="made by"):  # state from a model that is not the artifact's sender
        mapflow.relay_prefill(receiver, _state(receiver, SAMPLE_TEXT), art, torch.zeros(0, dtype=torch.long))
    bare = ContextState(text=st.text, tokens=st.tokens, offsets=st.offsets, binding=st.binding)
    with pytest.raises(MapsError, match="no attention maps"):
        mapflow.relay_prefill(receiver, bare, art, torch.zeros(0, dtype=torch.long))
    with pytest.raises(Refused, match="tokenizer"):  # gemma's tiny tokenizer differs from qwen2's
        mapflow.calibrate(sender, tiny_model("gemma3", layers=4), [], [], OPTS, "", None)


def test_state_with_maps_round_trips_through_bytes(pair):
    sender, _ = pair
    st = _state(sender, SAMPLE_TEXT)
    back = ContextState.from_bytes(st.to_bytes())
    assert back.parts_meta == st.parts_meta and set(back.parts["maps"]) == set(st.parts["maps"])
    assert all(torch.equal(back.parts["maps"][k], st.parts["maps"][k]) for k in st.parts["maps"])


def test_diagnosis_picks_r_mapping_and_refuses():
    lr, ls = 4, 6
    tv = torch.full((lr, ls), 0.8)
    tv[2:, 3] = 0.2  # receiver layers 2, 3 fit sender layer 3 well
    cov = torch.ones(lr, ls)
    w = torch.zeros(lr, ls, 2, 2)
    d = diagnose.decide(tv, cov, w, tv_max=0.5, mapping="auto")
    assert d.mapping_name == "best" and d.mapping[2:] == [3, 3] and d.r == 2 and not d.refused
    assert diagnose.suffix_alignment(ls, lr) == [2, 3, 4, 5]
    bad = diagnose.decide(torch.full((lr, ls), 0.9), cov, w, tv_max=0.5)
    assert bad.refused and "no reliable reuse region" in bad.reason


def test_unknown_option_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown mapflow calibration option"):
        CalibOptions.from_dict({"topp": 0.9})


def test_bench_variants_all_run_through_relay_prefill(artifact, pair):
    from ctxrelay_bench.mapflow import bench as mapflow_bench

    art, _ = artifact
    sender, receiver = pair
    opts = mapflow_bench._options({"p_list": "0.8,0.9", "r_list": "2"})
    vs = mapflow_bench.variants(art, receiver, opts)
    kinds = {(t, m) for t, m, _ in vs}
    assert ("iam", "replace-50%") in kinds and ("flexprefill", "receiver-top-p") in kinds
    assert any(t == "mapflow" for t, _ in kinds)
    st = _state(sender, SAMPLE_TEXT)
    suffix = tokenize_context(receiver, " Answer:")[0]
    for _, _, cfg in vs:
        out = mapflow.relay_prefill(receiver, st, mapflow_bench.as_artifact(art, cfg), suffix)
        assert torch.isfinite(out.logits).all() and out.cache.length == st.num_tokens + suffix.shape[0]


def test_operator_times_cover_every_operator(artifact, pair):
    from ctxrelay_bench.mapflow import bench as mapflow_bench

    art, _ = artifact
    sender, receiver = pair
    ops = mapflow_bench.operator_times(_state(sender, SAMPLE_TEXT), art, receiver, [0.9], repeats=1)
    assert ops["sdpa_ms"] > 0
    row = ops["p=0.9"]
    assert row["replace_ms"] > 0 and row["guided_group_ms"] > 0 and 0 < row["guided_head_density"] <= 1
    # a sampled (pattern-only) capture has no tiles: the guided operators are timed, replace is left out
    ops = mapflow_bench.operator_times(_state(sender, SAMPLE_TEXT, capture="sampled"), art, receiver, [0.9], 1)
    assert ops["p=0.9"]["guided_group_ms"] > 0 and "replace_ms" not in ops["p=0.9"]


def test_mode_choice_upgrades_then_replaces_greedily():
    from ctxrelay.transports.mapflow.calibration.modes import choose_modes

    cost = {"replace": 0.06, "guided": 0.03, "hybrid": 0.01, "native": 0.0}  # top-1 lost per layer in each mode

    def fake_eval(layer_modes):
        return {"top1_agreement": 1.0 - sum(cost[m] for m in layer_modes), "kl": 0.0}

    start = ["native"] + ["guided"] * 5  # 1 - 5 * 0.03 = 0.85: below the 0.9 target
    chosen, log = choose_modes(
        fake_eval, start, replace_order=[5, 4, 3, 2, 1], upgrade_order=[1, 2, 3, 4, 5], min_top1=0.9, log=lambda m: None
    )
    # layers 1..3 become hybrid (0.85 -> 0.87 -> 0.89 -> 0.91), then no replace fits the remaining margin
    assert chosen == ["native", "hybrid", "hybrid", "hybrid", "guided", "guided"]
    assert log["final_top1"] >= 0.9 and len(log["steps"]) == 1 + 3 + 2


def test_bench_end_to_end_on_tiny_models(artifact, pair, tmp_path, monkeypatch):
    import json

    from ctxrelay import zoo
    from ctxrelay_bench.mapflow import bench as mapflow_bench

    art, path = artifact
    sender, receiver = pair
    monkeypatch.setattr(zoo, "load", lambda name, **kw: {"S": sender, "R": receiver}[name])
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path / "results"))
    opts = {"artifact": str(path), "contexts": 2, "continuation": 17, "answer_tokens": 3, "p_list": "0.9"}
    out = mapflow_bench.bench("", "S", "R", [160], 1, "mf", opts, "ctxrelay bench mapflow (test)")
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert rows[0]["transport"] == "native" and {r["transport"] for r in rows} >= {"mapflow", "iam", "flexprefill"}
    for row in rows[1:]:
        assert row["relay_ttft_s"] > 0 and 0 <= row["top1_agreement"] <= 1 and set(row["ppl"]) == {"1", "16"}
        assert row["timing_gap_max"] < 0.5 and row["contexts"] == 2
    assert "operators_ms" in doc["lengths"]["160"] and out.with_suffix(".png").exists()
    assert doc["lengths"]["160"]["sender_capture"] == "exact"  # the iam rows replace: they read the map's tiles
    timing = doc["lengths"]["160"]["sender_timing"]  # interleaved pairs after a warm-up, not one cold run
    assert timing["capture"] == "exact" and len(timing["native_times_s"]) == len(timing["capture_times_s"]) == 3
    assert timing["hook_s"] is None and timing["hook_share"] is None  # eager attention has no hook to time
    assert all(r["end_to_end_speedup"] > 0 for r in rows if r["transport"] == "mapflow")
    assert all(0 < r["flex_density"] <= 1 for r in rows if r["transport"] == "flexprefill")  # mean over contexts


def test_bench_capture_is_the_one_every_variant_can_read(artifact, pair):
    from ctxrelay_bench.mapflow import bench as mapflow_bench

    art, _ = artifact
    vs = mapflow_bench.variants(art, pair[1], mapflow_bench._options({"p_list": "0.9", "methods": "flex"}))
    guided_only = [cfg for _, _, cfg in vs]
    with_replace = guided_only + [
        cfg for _, _, cfg in mapflow_bench.variants(art, pair[1], mapflow_bench._options({"methods": "iam"}))
    ]
    assert mapflow_bench.bench_capture("auto", guided_only) == "sampled"
    assert mapflow_bench.bench_capture("auto", with_replace) == "exact"
    with pytest.raises(UsageError, match="replace layers needs capture='exact'"):
        mapflow_bench.bench_capture("sampled", with_replace)


def test_mode_choice_follows_measured_costs():
    from ctxrelay.transports.mapflow.calibration.modes import choose_modes

    loss = {"replace": 0.0, "guided": 0.03, "hybrid": 0.01, "native": 0.0}

    def fake_eval(layer_modes):
        return {"top1_agreement": 1.0 - sum(loss[m] for m in layer_modes), "kl": 0.0}

    # layer 1: hybrid costs as much as native (skipped); layer 3: replace is dearer than guided (never tried)
    cost = {j: {"native": 10.0, "hybrid": 6.0, "guided": 4.0, "replace": 3.0} for j in (1, 2, 3)}
    cost[1]["hybrid"] = 10.0
    cost[3]["replace"] = 5.0
    chosen, log = choose_modes(
        fake_eval,
        ["native", "guided", "guided", "guided"],
        replace_order=[1, 2, 3],
        upgrade_order=[1, 2, 3],
        min_top1=0.925,
        cost=cost,
        log=lambda m: None,
    )
    assert chosen == ["native", "replace", "hybrid", "guided"]
    assert [s["step"] for s in log["steps"]][1:] == ["layer 2 -> hybrid", "layer 1 -> replace"]


def test_bench_makes_a_guided_artifacts_native_layers_sparse_too(artifact, pair):
    from ctxrelay.artifact import Artifact
    from ctxrelay_bench.mapflow import bench as mapflow_bench

    art, _ = artifact
    r0 = int(art.params.get("reuse_from", 0))
    modes = ["native"] * r0 + ["guided"] * (len(art.params["modes"]) - r0)
    modes[-1] = "native"  # as calibration leaves a layer native where guided measured no cheaper
    dm = [int(x) for x in art.params["diagnosis_mapping"]]
    params = dict(art.params, modes=modes, mapping=[dm[j] if m != "native" else -1 for j, m in enumerate(modes)])
    ws = {f"w.{j}": art.tensors[f"w_fit.{j}"] for j, m in enumerate(modes) if m != "native"}
    tensors = {k: v for k, v in art.tensors.items() if not k.startswith("w.")} | ws
    guided_art = Artifact(art.transport, art.version, art.sender, art.receiver, tensors, params)
    opts = mapflow_bench._options({"methods": "guided", "gp_list": "0.95"})
    rows = [(m, cfg) for t, m, cfg in mapflow_bench.variants(guided_art, pair[1], opts) if m == "guided-all"]
    assert sorted(cfg.guided_p for _, cfg in rows) == sorted({float(art.params["guided_p"]), 0.95})
    assert all(cfg.modes == ["native"] * r0 + ["guided"] * (len(modes) - r0) for _, cfg in rows)
