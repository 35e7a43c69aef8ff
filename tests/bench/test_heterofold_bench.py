"""heterofold bench glue: directions, options, cases, resumed rows, summary (no model runs)."""

import pytest

from ctxrelay.errors import UsageError
from ctxrelay.models.tiny import tiny_tokenizer
from ctxrelay_bench.heterofold import bench as jobs


def test_directions_and_options():
    assert len(jobs._directions("", "")) == 8
    assert jobs._directions("smollm2-135m", "gemma3-270m,smollm2-135m") == [("smollm2-135m", "gemma3-270m")]
    with pytest.raises(UsageError, match="different"):
        jobs._directions("smollm2-135m", "smollm2-135m")
    with pytest.raises(UsageError, match="unknown heterofold bench option"):
        jobs._bench_options({"lenghts": 3})
    with pytest.raises(UsageError, match="method"):
        jobs._bench_options({"methods": "ridge"})


def test_bench_cases_cut_contexts_at_token_counts():
    tok = tiny_tokenizer("bytelevel")
    cases = jobs.bench_cases(tok, [64, 128], ["essays", "sharegpt"], continuation=40, seed=0)
    assert [(c.length, c.dataset) for c in cases] == [
        (64, "essays"),
        (64, "sharegpt"),
        (128, "essays"),
        (128, "sharegpt"),
    ]
    for c in cases:
        assert c.answer and c.question.startswith("\n\nQuestion:")
        n_ctx = len(tok(c.context, add_special_tokens=False)["input_ids"])
        assert c.length < n_ctx <= c.length + 80  # the needle fact adds one sentence
        assert len(tok(c.continuation, add_special_tokens=False)["input_ids"]) >= 40


def _bench_doc(dirs, methods, cases, sha):
    rows = []
    for r in dict.fromkeys(r for _, r in dirs):
        for length, ds in cases:
            rows.append({"transport": "native", "method": "text-relay", "receiver": r, "length": length, "dataset": ds})
            for s, r2 in dirs:
                if r2 == r:
                    rows += [
                        {
                            "transport": "heterofold",
                            "method": m,
                            "sender": s,
                            "receiver": r,
                            "length": length,
                            "dataset": ds,
                            "artifact_sha": sha[(s, r, m)],
                        }  # fmt: skip
                        for m in methods
                    ]
    return rows


def test_bench_resumes_only_receivers_a_run_finished_with_the_same_artifacts(tmp_path, monkeypatch):
    from ctxrelay.results import write_results
    from ctxrelay_bench.heterofold.report import reusable_rows

    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    dirs = [("a", "b"), ("c", "b"), ("a", "c")]
    methods = ["ridge+ta", "heterofold"]
    cases = [(64, "essays"), (64, "sharegpt")]
    sha = {(s, r, m): f"{s}{r}{m}" for s, r in dirs for m in methods}
    extra = {"options": {"x": 1}, "lengths": [64], "repeats": 3, "directions": [list(d) for d in dirs]}
    extra["cases"] = [{"dataset": ds, "length": n, "context_sha": f"{n}{ds}"} for n, ds in cases]
    rows = _bench_doc(dirs, methods, cases, sha)
    rows = [x for x in rows if not (x["receiver"] == "c" and x["dataset"] == "sharegpt")]  # c stopped midway
    write_results("hb", rows, "ctxrelay bench heterofold", extra)

    found = reusable_rows("hb", extra, dirs, methods, sha)
    assert set(found) == {"b"}  # c is incomplete: measured again
    assert len(found["b"][0]) == 2 * (1 + 2 * 2) and found["b"][1]["command"] == "ctxrelay bench heterofold"
    # a recalibrated artifact (other content) invalidates that receiver's rows
    assert reusable_rows("hb", extra, dirs, methods, {**sha, ("c", "b", "heterofold"): "new"}) == {}
    # other cases, options or repeats: nothing is reused
    assert reusable_rows("hb", {**extra, "repeats": 5}, dirs, methods, sha) == {}
    assert reusable_rows("hb", {**extra, "cases": extra["cases"][:1]}, dirs, methods, sha) == {}
    # a missing or different file: nothing to resume
    assert reusable_rows("other", extra, dirs, methods, sha) == {}


def test_summary_pools_lengths_per_direction_method_and_dataset():
    from ctxrelay_bench.heterofold.report import summarize

    def row(length, ppl, native, speedup=None):
        r = {"transport": "heterofold", "sender": "a", "receiver": "b", "method": "heterofold", "dataset": "essays",
             "length": length, "ppl": {"128": ppl}, "native_ppl": {"128": native}, "top1_agreement": 0.5,
             "kl": 0.1, "needle_acc": 0.0, "native_needle_acc": 1.0}  # fmt: skip
        return {**r, "speedup": speedup} if speedup else r

    native_row = {**row(512, 1.0, 1.0), "transport": "native"}
    (s,) = summarize([row(512, 4.0, 2.0, speedup=3.0), row(1024, 1.0, 2.0), native_row])
    assert s["lengths"] == [512, 1024]
    assert s["ppl128_ratio"] == pytest.approx(1.25)  # (2 + 0.5) / 2
    assert s["ppl128_ratio_geomean"] == pytest.approx(1.0)  # a 2x loss and a 2x gain cancel
    assert s["speedup_by_length"] == {"512": 3.0}
