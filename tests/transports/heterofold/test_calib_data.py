"""heterofold's calibration data and job: chunks, splits, option checks (no model runs)."""

import pytest

from ctxrelay.errors import UsageError
from ctxrelay.transports.heterofold.calibration import job as calib_data


def test_chunks_cut_at_boundaries_and_cover_the_text():
    text = " ".join(f"Sentence number {i} ends here." + ("\n\n" if i % 5 == 4 else "") for i in range(200))
    pieces = calib_data.chunk(text, 500)
    assert all(250 <= len(p) <= 500 for p in pieces)
    assert all(p.endswith(".") for p in pieces)  # paragraph or sentence ends, never mid-word
    assert sum(len(p) for p in pieces) > 0.9 * len(text) - 500


def test_calibration_texts_are_split_by_the_datasets_splits():
    train, held = calib_data.calibration_texts(
        {"chunk_chars": 1500, "essay_chunks": 6, "conversations": 3, "heldout_essays": 2, "heldout_convs": 2}
    )
    assert len(train) == 9 and len(held) == 4
    assert not set(train) & set(held)
    assert all(len(t) > 700 for t in train + held)


def test_calibrate_refuses_unknown_methods_before_loading_anything():
    with pytest.raises(UsageError, match="unknown heterofold method"):
        calib_data.calibrate_job("smollm2-135m", "gemma3-270m", options={"method": "ridge+ta,ridge"})


def test_refit_stage_refits_the_estimate_from_the_stored_rows(tiny_by_family, tmp_path):
    from conftest import zero_artifact
    from ctxrelay.artifact import Artifact

    art = zero_artifact(tiny_by_family["llama"], tiny_by_family["qwen2"])
    rows = [{"f": f, "top1_agreement": 0.8 + 0.01 * i + f / 10, "tail_confidence": 0.3 + 0.02 * i, "kv_change": 0.5}
            for f in (0.1, 0.2) for i in range(6)]  # fmt: skip
    art.params["recompute_stage"] = {"rows": rows, "rule": "mix"}
    path = art.save(tmp_path / "a.safetensors")
    calib_data.calibrate_job("a", "b", out=str(path), options={"stage": "refit"}, command="test")
    est = Artifact.load(path).quality["estimate"]
    assert est["signal"] == "tail_confidence" and est["spearman"] == 1.0 and est["rule"] == "mix"
    assert set(est["centres"]) == {"0.1", "0.2"} and abs(est["slope"] - 0.5) < 1e-9
    with pytest.raises(UsageError, match="no recompute stage"):
        calib_data.calibrate_job(
            "a",
            "b",
            out=str(zero_artifact(tiny_by_family["llama"], tiny_by_family["qwen2"]).save(tmp_path / "b.safetensors")),
            options={"stage": "refit"},
        )


def _stage_setup(tiny_by_family, monkeypatch, texts: int):
    """llama -> gemma3 tiny models, an artifact, and `texts` recompute texts of 64 and 128 tokens."""
    from conftest import SAMPLE_TEXT, zero_artifact

    words = SAMPLE_TEXT.split()
    by_n = {n: [" ".join(words[i:] + words[:i]) * (n // 64) for i in range(0, 5 * texts, 5)] for n in (64, 128)}
    monkeypatch.setattr(calib_data, "recompute_texts", lambda tok, opts: by_n[int(opts["recompute_tokens"])])
    s, r = tiny_by_family["llama"], tiny_by_family["gemma3"]
    return s, r, zero_artifact(s, r), {**calib_data.RECOMPUTE_DEFAULTS, "fractions": "0.2"}


def test_recompute_stage_at_a_second_length_keeps_the_first(tiny_by_family, monkeypatch):
    """`--set recompute_tokens=N` adds N's rows, table and command beside the other lengths' and
    replaces only N's: the gate then reads each request's length."""
    from ctxrelay.transports.heterofold import transport

    s, r, art, opts = _stage_setup(tiny_by_family, monkeypatch, texts=5)
    for n, cmd in ((64, "first"), (128, "second"), (64, "again")):
        calib_data._add_recompute_stage(s, r, art, {**opts, "recompute_tokens": n}, cmd)
    stage = art.params["recompute_stage"]
    assert sorted({(x["tokens"], x["f"]) for x in stage["rows"]}) == [(64, 0.2), (128, 0.2)]
    assert len(stage["rows"]) == 10  # 5 texts per length; the second run at 64 replaced the first's rows
    assert [(q["tokens"], q["f"]) for q in art.quality["recompute"]] == [(64, 0.2), (128, 0.2)]
    assert {k: v["command"] for k, v in stage["lengths"].items()} == {"64": "again", "128": "second"}
    point = transport.operating_points(art.params, art.quality)[1]["quality"]
    assert [x["tokens"] for x in point["by_tokens"]] == [64, 128]
    other = {**opts, "recompute_tokens": 128, "rule": "recency"}  # another rule: the other lengths are dropped
    calib_data._add_recompute_stage(s, r, art, other, "recency")
    assert {x["tokens"] for x in art.params["recompute_stage"]["rows"]} == {128}
    hidden = {**opts, "recompute_tokens": 64, "rule": "recency", "hide_layers": 1}  # another setting: kept beside
    calib_data._add_recompute_stage(s, r, art, hidden, "hidden")
    stage = art.params["recompute_stage"]
    assert sorted((x["tokens"], x.get("hide_translated", 0)) for x in stage["rows"]) == [(64, 1)] * 5 + [(128, 0)] * 5
    assert stage["hide_layers"] == 1 and {k: v["command"] for k, v in stage["lengths"].items()} == {
        "128": "recency",
        "64+hide1": "hidden",
    }


def test_points_measured_with_other_hiding_at_other_lengths_serve_their_own_lengths(tiny_by_family, monkeypatch):
    """A point that hides only at the long length and one that does not hide at the short length are two
    operating points; each serves the requests nearest the length it was measured at, with its own
    fact recall, and the gate refuses it elsewhere with a reason."""
    from ctxrelay.relay.gate import quality_at, quality_refusal
    from ctxrelay.transports.heterofold import transport

    s, r, art, opts = _stage_setup(tiny_by_family, monkeypatch, texts=3)
    calib_data._add_recompute_stage(s, r, art, {**opts, "recompute_tokens": 64}, "plain at 64")
    calib_data._add_recompute_stage(s, r, art, {**opts, "recompute_tokens": 128, "hide_layers": 1}, "hiding at 128")
    fact = {"selection": "mix", "cases": 8, "native_right": 8}
    art.quality["facts"] = [
        {"f": 0.0, "tokens": 64, **fact, "kept": 0, "fact_recall": 0.0},
        {"f": 0.2, "tokens": 64, **fact, "kept": 8, "fact_recall": 1.0},
        {"f": 0.2, "tokens": 128, "hide_translated": 1, **fact, "kept": 6, "fact_recall": 0.75},
    ]
    for q in art.quality["recompute"]:
        q["top1_agreement"] = 0.9  # both pass top-1; fact recall and length decide
    points = {p["label"]: p for p in transport.operating_points(art.params, art.quality)}
    plain, hiding = points["f=0.20 mix"], points["f=0.20 mix hide1"]
    assert hiding["options"] == {"recompute": 0.2, "selection": "mix", "hide_translated": 1}
    assert plain["quality"]["serves_tokens"] == [None, 91] and hiding["quality"]["serves_tokens"] == [91, None]
    assert quality_refusal(quality_at(plain["quality"], 64), 0.85) is None
    assert "measured at 64 tokens, it serves requests of under 91" in quality_refusal(
        quality_at(plain["quality"], 100), 0.85
    )
    assert "requests of 91+ tokens" in quality_refusal(quality_at(hiding["quality"], 90), 0.85)
    assert "fact recall 0.75 (6/8 facts)" in quality_refusal(quality_at(hiding["quality"], 128), 0.85)
    art.quality["facts"] = art.quality["facts"][:2]  # the fact stage never measured the hiding point
    points = {p["label"]: p for p in transport.operating_points(art.params, art.quality)}
    assert "did not measure this point" in quality_refusal(quality_at(points["f=0.20 mix hide1"]["quality"], 128), 0.85)


def test_facts_stage_at_another_length_and_hiding_keeps_the_others(tiny_by_family, own_cache):
    from conftest import zero_artifact

    s, r = tiny_by_family["llama"], tiny_by_family["gemma3"]
    art = zero_artifact(s, r)
    opts = {**calib_data.FACTS_DEFAULTS, "rule": "mix", "fractions": "1.0", "facts_cases": 2, "facts_new_tokens": 4}
    calib_data._add_facts_stage(s, r, art, {**opts, "facts_tokens": 160}, "plain at 160", hide=0)
    calib_data._add_facts_stage(s, r, art, {**opts, "facts_tokens": 256}, "hiding at 256", hide=1)
    calib_data._add_facts_stage(s, r, art, {**opts, "facts_tokens": 160, "facts_cases": 3}, "plain again", hide=0)
    settings = [(e["f"], e["tokens"], e.get("hide_translated", 0), e["cases"]) for e in art.quality["facts"]]
    assert settings == [(0.0, 160, 0, 3), (1.0, 160, 0, 3), (0.0, 256, 0, 2), (1.0, 256, 1, 2)]  # by hiding, length
    stage = art.params["facts_stage"]
    assert len(stage["rows"]) == 2 * 2 + 3 * 2  # the first run's rows were replaced by the third's
    assert [run["command"] for run in stage["runs"]] == ["hiding at 256", "plain again"]
    assert all(r["answer"] == r["native_answer"] for r in stage["rows"] if r["f"] == 1.0)  # f = 1 is native


def test_keep_stage_drops_the_other_fractions_everywhere_the_gate_reads(tiny_by_family, tmp_path):
    from conftest import zero_artifact
    from ctxrelay.artifact import Artifact
    from ctxrelay.transports.heterofold import transport

    art = zero_artifact(tiny_by_family["llama"], tiny_by_family["qwen2"])
    fracs = (0.1, 0.15, 0.2)
    rows = [{"f": f, "top1_agreement": 0.8 + 0.01 * i + f / 10, "tail_confidence": 0.3 + 0.02 * i, "kv_change": 0.5}
            for f in fracs for i in range(6)]  # fmt: skip
    art.params["recompute_stage"] = {"rows": rows, "rule": "mix"}
    art.quality["recompute"] = [{"f": f, "selection": "mix", "top1_agreement": 0.8 + f} for f in fracs]
    art.quality["facts"] = [{"f": f, "fact_recall": 0.9, "kept": 9, "native_right": 10} for f in (0.0, *fracs)]
    art.params["facts_stage"] = {"rows": [{"f": f, "case": 0} for f in (0.0, *fracs)]}
    path = art.save(tmp_path / "a.safetensors")
    calib_data.calibrate_job("a", "b", out=str(path), options={"stage": "keep", "fractions": "0.15,0.2"}, command="k")
    kept = Artifact.load(path)
    assert [q["f"] for q in kept.quality["recompute"]] == [0.15, 0.2]
    assert [q["f"] for q in kept.quality["facts"]] == [0.0, 0.15, 0.2]  # plain translation's recall stays
    assert {x["f"] for x in kept.params["recompute_stage"]["rows"]} == {0.15, 0.2}
    assert [x["f"] for x in kept.params["facts_stage"]["rows"]] == [0.0, 0.15, 0.2]
    assert set(kept.quality["estimate"]["centres"]) == {"0.15", "0.2"}
    assert kept.params["recompute_stage"]["keep_command"] == "k"
    labels = [p["options"].get("recompute") for p in transport.operating_points(kept.params, kept.quality)]
    assert 0.1 not in labels and 0.15 in labels
    with pytest.raises(UsageError, match=r"it has \[0.15, 0.2\]"):  # a fraction never measured is refused
        calib_data.calibrate_job("a", "b", out=str(path), options={"stage": "keep", "fractions": "0.1"})
    with pytest.raises(UsageError, match="needs --set fractions"):  # never the defaults by accident
        calib_data.calibrate_job("a", "b", out=str(path), options={"stage": "keep"})


def test_drop_stage_drops_the_points_of_one_setting_and_keeps_the_others(tiny_by_family, tmp_path):
    """stage=drop --set drop=4096: the unhidden points at 4096 go (table, rows, runs, facts); the same
    fractions hiding the full-attention layers at 4096 and the unhidden ones at 2048 stay."""
    from conftest import zero_artifact
    from ctxrelay.artifact import Artifact
    from ctxrelay.transports.heterofold import transport

    art = zero_artifact(tiny_by_family["llama"], tiny_by_family["gemma3"])
    settings = [(2048, 0), (4096, 0), (4096, "global")]
    rows = [{"f": 0.15, "tokens": n, "hide_translated": h, "text": i, "top1_agreement": 0.85 + 0.01 * i,
             "tail_confidence": 0.3 + 0.02 * i} for n, h in settings for i in range(6)]  # fmt: skip
    runs = {"2048": {"command": "a"}, "4096": {"command": "b"}, "4096+hideglobal": {"command": "c"}}
    art.params["recompute_stage"] = {"rows": rows, "rule": "mix", "lengths": runs}
    art.quality["recompute"] = [{"f": 0.15, "selection": "mix", "tokens": n, "hide_translated": h,
                                 "top1_agreement": 0.9} for n, h in settings]  # fmt: skip
    art.quality["facts"] = [{"f": f, "tokens": n, "hide_translated": h if f else 0, "fact_recall": 0.9, "kept": 9,
                             "native_right": 10} for n, h in settings for f in (0.0, 0.15)]  # fmt: skip
    art.params["facts_stage"] = {
        "rows": [{**e, "case": 0} for e in art.quality["facts"]],
        "runs": [
            {"command": c, "facts_tokens": n, "hide_layers": h} for c, (n, h) in zip("abc", settings, strict=True)
        ],
    }
    path = art.save(tmp_path / "a.safetensors")
    calib_data.calibrate_job("a", "b", out=str(path), options={"stage": "drop", "drop": "4096"}, command="d")
    kept = Artifact.load(path)
    left = [(q["tokens"], q["hide_translated"]) for q in kept.quality["recompute"]]
    assert left == [(2048, 0), (4096, "global")]
    assert {(x["tokens"], x["hide_translated"]) for x in kept.params["recompute_stage"]["rows"]} == set(left)
    assert set(kept.params["recompute_stage"]["lengths"]) == {"2048", "4096+hideglobal"}
    facts = [(e["f"], e["tokens"], e["hide_translated"]) for e in kept.quality["facts"]]
    assert (0.15, 4096, 0) not in facts and (0.0, 4096, 0) in facts and (0.15, 4096, "global") in facts
    assert [r["command"] for r in kept.params["facts_stage"]["runs"]] == ["a", "c"]
    assert kept.params["recompute_stage"]["drop_command"] == "d"
    labels = [p["label"] for p in transport.operating_points(kept.params, kept.quality)]
    assert labels == ["", "f=0.15 mix", "f=0.15 mix hideglobal"]
    with pytest.raises(UsageError, match=r"it has 2048, 4096\+hideglobal"):  # a setting never measured
        calib_data.calibrate_job("a", "b", out=str(path), options={"stage": "drop", "drop": "4096"})
    with pytest.raises(UsageError, match="needs --set drop"):
        calib_data.calibrate_job("a", "b", out=str(path), options={"stage": "drop"})
