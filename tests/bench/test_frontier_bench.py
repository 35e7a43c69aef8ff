"""`ctxrelay bench heterofold-frontier` end to end on tiny models: rows, the f = 1 check, resume."""

import json
from contextlib import contextmanager

import pytest
import torch

from conftest import zero_artifact
from ctxrelay.errors import UsageError
from ctxrelay.models.tiny import tiny_tokenizer
from ctxrelay_bench.heterofold_frontier import bench as hf


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def tiny_world(tiny_by_family, tmp_path, monkeypatch):
    from ctxrelay import zoo
    from ctxrelay.transports.heterofold.calibration import job as calib_data

    s, r = tiny_by_family["llama"], tiny_by_family["qwen2"]
    models = {"S": s, "R": r}
    art = zero_artifact(s, r).save(tmp_path / "art.safetensors")
    monkeypatch.setattr(zoo, "load", lambda name, **kw: models[name])
    monkeypatch.setattr(calib_data, "find_artifact", lambda sender, receiver: art)
    monkeypatch.setattr(hf, "ref_tokenizer", lambda name: tiny_tokenizer("bytelevel"))
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path / "results"))
    return s, r


def test_frontier_rows_exactness_and_resume(tiny_world, tmp_path, capsys, monkeypatch):
    opts = {"needles": 2, "sharegpt": 1, "rules": "recency,lexical", "fractions": "0.5", "continuation": 17,
            "answer_tokens": 4}  # fmt: skip
    path = hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, options=opts, command="pytest")
    doc = json.loads(path.read_text())
    rows = [x for x in doc["rows"] if x.get("kind") != "timing"]
    points = {(x["selection"], x["f"]) for x in rows}
    assert points == {("none", 0.0), ("recency", 0.5), ("lexical", 0.5), ("recency", 1.0)}
    assert len(rows) == 3 * 3 + 1  # 3 cases x 3 points + the f = 1 check on the first needle case
    exact = next(x for x in rows if x["f"] == 1.0)
    assert exact["top1_agreement"] == 1.0 and exact["kl"] < 1e-6 and exact["needle_acc"] == exact["native_needle_acc"]
    timed = [x for x in doc["rows"] if x.get("kind") == "timing"]
    assert {(x["selection"], x["f"]) for x in timed} == {("none", 0.0), ("recency", 0.5), ("lexical", 0.5)}
    assert all(len(x["native_times_s"]) == 2 for x in timed)  # before + after
    # the components are stopwatches inside the relay's wall time: they never add up to more than it (no time
    # counted twice); how much of it they leave out is timing noise on tiny relays, reported, not asserted
    assert all(sum(x["timings"].values()) <= max(x["relay_times_s"]) * (1 + 1e-6) for x in timed)
    assert all(0 <= x["timing_gap_max"] < 1 for x in timed)
    assert doc["complete"] and {x["selection"] for x in doc["summary"]} == {"none", "recency", "lexical"}
    assert all("speedup" in x for x in doc["summary"] if x["f"] < 1)
    # the zero artifact has no recompute table: the gate's replay keeps every request on native prefill
    (gate,) = doc["gate"]
    assert gate["requests"] == 3 and gate["points"] == {"native": 3} and gate["needle_cases"] == 2
    assert path.with_suffix(".png").exists()
    # the report phase measures nothing: it prints the run's three tables and redraws the plot
    assert capsys.readouterr().out.count("\n|---") == 4  # the measuring run printed its tables too
    path.with_suffix(".png").unlink()
    assert hf.bench(sender="S", receiver="R", options={"phase": "report"}) == path.with_suffix(".png")
    report = capsys.readouterr().out
    assert "| S -> R | 160 | lexical | 0.50 |" in report and "| S -> R | 160 | 3 | native x3 | " in report
    assert report.count("\n|---") == 4 and path.with_suffix(".png").exists()
    # the report keeps the facts of the machine that measured the rows (a resume is matched on them)
    stamped = json.loads(path.read_text())
    machine = dict(stamped["machine"])
    stamped["machine"]["cpu_model"] = "the measuring machine"
    path.write_text(json.dumps(stamped))
    hf.bench(sender="S", receiver="R", options={"phase": "report"})
    stamped = json.loads(path.read_text())
    assert stamped["machine"]["cpu_model"] == "the measuring machine"
    path.write_text(json.dumps({**stamped, "machine": machine}))
    # a direction whose artifact is not installed here keeps its gate replay and estimate check as written
    from ctxrelay.transports.heterofold.calibration import job as calib_data

    with monkeypatch.context() as m:
        m.setattr(calib_data, "find_artifact", lambda sender, receiver: tmp_path / "missing.safetensors")
        hf.bench(sender="S", receiver="R", options={"phase": "report"})
    assert "no artifact for S -> R here" in capsys.readouterr().out
    assert json.loads(path.read_text())["gate"] == stamped["gate"]
    # a rerun with the same cases and options measures nothing again
    again = hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, options=opts, command="pytest")
    assert json.loads(again.read_text())["rows"] == doc["rows"]
    # a quality-only run of more points keeps every row measured before
    more = hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, command="pytest",
                    options={**opts, "rules": "recency,lexical,mix", "phase": "quality"})  # fmt: skip
    rows3 = json.loads(more.read_text())["rows"]
    assert len(rows3) == len(doc["rows"]) + 3 and {x["selection"] for x in rows3} >= {"mix"}
    # redo a changed rule on one dataset: only those rows are measured again, the rest kept as they were
    redo = hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, command="pytest",
                    options={**opts, "rules": "recency,lexical,mix", "phase": "quality", "redo": "mix",
                             "redo_datasets": "sharegpt"})  # fmt: skip
    rows4 = json.loads(redo.read_text())["rows"]
    redone = [x for x in rows4 if x not in rows3]
    assert len(rows4) == len(rows3) and [(x["selection"], x["dataset"]) for x in redone] == [("mix", "sharegpt")]
    with pytest.raises(UsageError, match="redo_datasets"):
        hf.bench(sender="S", receiver="R", lengths=[160], options={"redo": "mix", "redo_datasets": "essays"})
    # a run that cannot extend the file (other threads, other cases) is refused, and the file is left whole
    with pytest.raises(UsageError, match=r"torch_threads \(\d+ then, 3 now\).*resume=false"), torch_threads(3):
        hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, options={**opts, "phase": "quality"})
    with pytest.raises(UsageError, match="differs in options, cases"):
        hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, options={**opts, "needles": 3})
    assert json.loads(redo.read_text())["rows"] == rows4
    fresh = hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, command="pytest",
                     options={**opts, "phase": "quality", "resume": False})  # fmt: skip
    assert len(json.loads(fresh.read_text())["rows"]) == 3 * 3 + 1


def test_a_sharegpt_only_run_is_timed_on_its_first_conversation(tiny_world):
    opts = {"needles": 0, "sharegpt": 1, "rules": "recency", "fractions": "0.5", "continuation": 17,
            "answer_tokens": 4, "exact_check": False}  # fmt: skip
    doc = json.loads(hf.bench(sender="S", receiver="R", lengths=[160], repeats=1, options=opts).read_text())
    timed = [x for x in doc["rows"] if x.get("kind") == "timing"]
    assert {(x["selection"], x["f"]) for x in timed} == {("none", 0.0), ("recency", 0.5)}
    assert all("speedup" in x for x in doc["summary"])


def test_frontier_refuses_bad_options():
    with pytest.raises(UsageError, match="unknown recompute rule"):
        hf.points({"rules": "magic", "fractions": "0.1"})
    with pytest.raises(UsageError, match=r"\(0, 1\)"):
        hf.points({"rules": "recency", "fractions": "1.0"})
    with pytest.raises(UsageError, match="unknown heterofold-frontier option"):
        hf.bench(sender="S", receiver="R", options={"bogus": 1})


def test_gate_replay_takes_the_cheapest_point_whose_estimate_passes_else_native():
    from ctxrelay_bench.heterofold_frontier.report import gate_replay

    def q(case, rule, f, est, needle, top1=0.9):
        info = {"tail_confidence": est}
        return {"sender": "s", "receiver": "r", "length": 4096, "case_key": case, "selection": rule, "f": f,
                "dataset": "needle", "needle_acc": needle, "native_needle_acc": 1, "top1_agreement": top1,
                "ppl": {"128": 11.0}, "native_ppl": {"128": 10.0}, "question_info": info,
                "continuation_info": info}  # fmt: skip

    def t(rule, f, relay_s):
        return {"kind": "timing", "sender": "s", "receiver": "r", "length": 4096, "selection": rule, "f": f,
                "relay_ttft_s": relay_s, "native_ttft_s": 10.0}  # fmt: skip

    rows = [t("none", 0.0, 0.5), t("mix", 0.1, 1.0), t("mix", 0.2, 2.0), t("mix", 0.3, 9.5)]
    for case, (e1, e2) in {"a": (0.9, 0.9), "b": (0.5, 0.9), "c": (0.5, 0.5)}.items():
        rows += [q(case, "none", 0.0, None, 0), q(case, "mix", 0.1, e1, 1), q(case, "mix", 0.2, e2, 1),
                 q(case, "mix", 0.3, 0.99, 1)]  # fmt: skip
    table = [{"f": f, "selection": "mix", "top1_agreement": a} for f, a in ((0.1, 0.86), (0.2, 0.9), (0.3, 0.95))]
    est = {"signal": "tail_confidence", "slope": 1.0, "centres": {"0.1": [0.0, 0.0]},
           "spearman": 0.6, "cv_spearman": 0.6}  # fmt: skip
    (g,) = gate_replay(rows, {("s", "r"): ({}, {"recompute": table, "estimate": est})}, 0.85, 1.1)
    # a: accepted at f=0.1 (1 s); b: 0.1 fails, 0.2 passes (1 + 2 s); c: both fail, f=0.3 is not 1.1x
    # faster than native so it is no candidate: native after paying 3 s (13 s)
    assert g["points"] == {"f=0.10 mix": 1, "f=0.20 mix": 1, "native": 1}
    assert g["needle_acc"] == 1.0 and g["native_needle_acc"] == 1.0
    assert abs(g["speedup"] - 10.0 / ((1.0 + 3.0 + 13.0) / 3)) < 1e-9
    # an empty answer is refused like a failed estimate (the gate's first-token end-of-text check)
    next(x for x in rows if x.get("case_key") == "a" and x["f"] == 0.1)["answer"] = " "
    (g,) = gate_replay(rows, {("s", "r"): ({}, {"recompute": table, "estimate": est})}, 0.85, 1.1)
    assert g["points"] == {"f=0.20 mix": 2, "native": 1}
    # an estimate that ranked its calibration texts weakly is not acted on: the cheapest point serves
    weak = {**est, "spearman": 0.3, "cv_spearman": 0.3}
    (g,) = gate_replay(rows, {("s", "r"): ({}, {"recompute": table, "estimate": weak})}, 0.85, 1.1)
    assert g["points"] == {"f=0.10 mix": 2, "f=0.20 mix": 1}
    # what a refused relay cost is paid either way: b's f=0.1 is refused (1 s), then f=0.2 alone (9.05 s)
    # still beats native (10 s), so it serves (10.05 s in all) instead of native after the refusal (11 s)
    del next(x for x in rows if x.get("case_key") == "a" and x["f"] == 0.1)["answer"]
    slow = [{**x, "relay_ttft_s": 9.05} if x.get("kind") == "timing" and x["f"] == 0.2 else x for x in rows]
    (g,) = gate_replay(slow, {("s", "r"): ({}, {"recompute": table, "estimate": est})}, 0.85, 1.1)
    assert g["points"] == {"f=0.10 mix": 1, "f=0.20 mix": 1, "native": 1}
    # a point the stage measured with hide_translated replays only rows measured with it: none here
    hidden = [{**x, "hide_translated": 12} for x in table]
    (g,) = gate_replay(rows, {("s", "r"): ({}, {"recompute": hidden, "estimate": est})}, 0.85, 1.1)
    assert g["points"] == {"native": 3}
    marked = [{**x, "hide_translated": 12} if x["f"] > 0 else x for x in rows]
    (g,) = gate_replay(marked, {("s", "r"): ({}, {"recompute": hidden, "estimate": est})}, 0.85, 1.1)
    assert g["points"] == {"f=0.10 mix hide12": 1, "f=0.20 mix hide12": 1, "native": 1}  # labelled as served
    # in the gate's order (expected TTFT): the better point is the cheaper one here, so it goes first;
    # where its estimate refuses (c), the worse point is skipped (the relay layer's rule): native after 1 s
    swapped = [{**x, "relay_ttft_s": {0.1: 2.0, 0.2: 1.0}.get(x["f"], x["relay_ttft_s"])}
               if x.get("kind") == "timing" else x for x in rows]  # fmt: skip
    (g,) = gate_replay(swapped, {("s", "r"): ({}, {"recompute": table, "estimate": est})}, 0.85, 1.1)
    assert g["points"] == {"f=0.20 mix": 2, "native": 1}
    assert abs(g["speedup"] - 10.0 / ((1.0 + 1.0 + 11.0) / 3)) < 1e-9


def test_a_quality_only_run_still_plots(tmp_path):
    from ctxrelay_bench.heterofold_frontier.report import plot

    row = {"sender": "s", "receiver": "r", "length": 512, "case_key": "needle-512-0", "dataset": "needle",
           "top1_agreement": 0.8, "kl": 0.1, "ppl": {"128": 2.0}, "native_ppl": {"128": 1.9},
           "needle_acc": 1, "native_needle_acc": 1, "recompute_fraction": 0.0}  # fmt: skip
    rows = [{**row, "selection": "none", "f": 0.0}, {**row, "selection": "mix", "f": 0.2, "recompute_fraction": 0.2}]
    assert plot(rows, tmp_path / "x.json").exists()


def test_seeds_forty_apart_repeat_the_needle_requests_and_the_bench_says_so(tmp_path, monkeypatch):
    from ctxrelay.results import write_results
    from ctxrelay.transports.heterofold.calibration.text_cache import text_key
    from ctxrelay_bench.heterofold_frontier.report import measured_before

    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    tok = tiny_tokenizer("bytelevel")

    def cases(seed: int) -> list[dict]:
        opts = {**hf.OPTIONS, "seed": seed, "needles": 4, "sharegpt": 0}
        return [{"key": c.key, "context_sha": text_key(c.context)} for c in hf.build_cases(tok, [256], opts)]

    assert cases(500) == cases(540)  # 10 held-out essays, 8 facts: a cycle of 40 seeds
    assert not {c["context_sha"] for c in cases(500)} & {c["context_sha"] for c in cases(510)}
    write_results(
        "heterofold-frontier-old",
        [{"transport": "heterofold", "sender": "s", "receiver": "r"}],
        "old",
        {"cases": cases(500)},
    )
    write_results(
        "heterofold-frontier-other",
        [{"transport": "heterofold", "sender": "x", "receiver": "r"}],
        "other",
        {"cases": cases(500)},
    )
    [line] = measured_before("heterofold-frontier-new", cases(540), [("s", "r")])
    assert line.startswith("4 of these 4 requests (needle-256-0, needle-256-1, needle-256-2, ...) were measured")
    assert line.endswith("for s -> r before (in heterofold-frontier-old): not a fresh sample there")
    assert measured_before("heterofold-frontier-new", cases(510), [("s", "r")]) == []


def test_a_work_artifact_is_measured_in_its_direction_and_named_in_the_file(tiny_world, tmp_path, monkeypatch):
    from ctxrelay import zoo
    from ctxrelay.artifact import Artifact

    s, r = tiny_world
    names = {s.spec.name: s, r.spec.name: r}
    monkeypatch.setattr(zoo, "load", lambda name, **kw: names[name])
    work = Artifact.load(zero_artifact(s, r).save(tmp_path / "work.safetensors"))
    opts = {"needles": 1, "sharegpt": 0, "rules": "recency", "fractions": "0.5", "continuation": 17,
            "answer_tokens": 4, "exact_check": False, "phase": "quality",
            "artifact": str(tmp_path / "work.safetensors")}  # fmt: skip
    path = hf.bench(sender=s.spec.name, receiver=r.spec.name, lengths=[160], repeats=1, options=opts, out="work")
    doc = json.loads(path.read_text())
    assert doc["artifact"] == str((tmp_path / "work.safetensors").resolve())
    assert doc["options"]["artifact"] == work.digest and work.digest  # a resume with another artifact is refused
    assert {(x["selection"], x["f"]) for x in doc["rows"]} == {("none", 0.0), ("recency", 0.5)}
    hf.bench(options={"phase": "report"}, out="work")  # derived with the work artifact again
    assert json.loads(path.read_text())["artifact"] == doc["artifact"]
    with pytest.raises(UsageError, match="one direction"):
        hf.bench(sender=f"{s.spec.name},{r.spec.name}", receiver=f"{r.spec.name},{s.spec.name}", options=opts)
    with pytest.raises(UsageError, match="is the artifact of"):
        hf.bench(sender=r.spec.name, receiver=s.spec.name, options=opts)
    with pytest.raises(UsageError, match="no artifact file"):
        hf.bench(sender=s.spec.name, receiver=r.spec.name, options={**opts, "artifact": str(tmp_path / "none")})
