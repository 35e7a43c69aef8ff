"""heterofold's fact-recall stage: relayed answers at f = 1 are the native answers in both layouts (the
question inside the sender's context, or appended by the receiver), and the table counts what it says."""

from conftest import zero_artifact
from ctxrelay.data.needle import CALIBRATION_NEEDLES, NEEDLES
from ctxrelay.transports.heterofold.calibration.facts import calibrate_facts, fact_table
from ctxrelay.transports.heterofold.points import facts_at


def test_full_recompute_answers_as_native_in_both_layouts(tiny_by_family, tmp_path):
    sender, receiver = tiny_by_family["llama"], tiny_by_family["gemma3"]
    art = zero_artifact(sender, receiver)  # wrong everywhere: only f = 1 can reproduce native
    res = calibrate_facts(sender, receiver, art, [0.0, 1.0], "mix", cases=2, tokens=160, new_tokens=6, root=tmp_path)
    full = [r for r in res["rows"] if r["f"] == 1.0]
    assert {r["question_inside"] for r in full} == {True, False}
    assert all(r["answer"] == r["native_answer"] for r in full)
    assert [e["f"] for e in res["facts"]] == [0.0, 1.0] and all(e["cases"] == 2 for e in res["facts"])
    assert any(tmp_path.rglob("send-*.safetensors"))  # sender states cached for the next direction


def test_fact_table_counts_kept_facts_among_native_right_ones():
    rows = [
        {"f": 0.2, "native_right": 1, "relay_right": 1},
        {"f": 0.2, "native_right": 1, "relay_right": 0},
        {"f": 0.2, "native_right": 0, "relay_right": 1},  # a relayed lucky guess is not a kept fact
        {"f": 0.0, "native_right": 0, "relay_right": 0},
    ]
    table = fact_table(rows, "mix")
    assert table[0] == {"f": 0.0, "selection": "mix", "tokens": 2048, "hide_translated": 0, "cases": 1,
                        "native_right": 0, "kept": 0, "fact_recall": None}  # fmt: skip
    assert table[1]["native_right"] == 2 and table[1]["kept"] == 1 and table[1]["fact_recall"] == 0.5
    assert facts_at({"facts": table}, 0.2) == {"fact_recall": 0.5, "native_right": 2, "kept": 1, "cases": 3}
    assert facts_at({}, 0.2) == {}


def test_facts_at_reads_the_points_own_hiding_at_the_nearest_measured_length():
    def entry(f, tokens, hide, kept):
        return {"f": f, "tokens": tokens, **({"hide_translated": hide} if hide else {}), "kept": kept}

    q = {"facts": [entry(0.0, 2048, 0, 0), entry(0.2, 2048, 0, 13), entry(0.2, 2048, 12, 11), entry(0.2, 4096, 12, 14)]}
    assert facts_at(q, 0.2, ("kept",)) == {"kept": 13}  # not hiding: the one measured without
    assert facts_at(q, 0.2, ("kept",), tokens=4096, hide=12) == {"kept": 14}
    assert facts_at(q, 0.2, ("kept",), tokens=2800, hide=12) == {"kept": 11}  # nearer 2048 in log-length
    assert facts_at(q, 0.2, ("kept",), hide=12) == {"kept": 11}  # no length: the shortest
    assert facts_at(q, 0.2, ("kept",), tokens=4096) == {"kept": 13}  # the nearest of its own hiding
    assert facts_at(q, 0.0, ("kept",), hide=12) == {"kept": 0}  # plain translation never hides
    assert facts_at(q, 0.2, ("kept",), hide=6) == {}


def test_the_gate_reads_fact_recall_at_the_requests_length_where_top1_has_one_length():
    """qwen-1.5b -> qwen-0.5b: top-1 measured at 2048 only, facts at 2048 and 4096. A 4096-token request
    is judged on the 4096 facts (before, on the 2048 entry its top-1 length pointed at)."""
    from ctxrelay.relay.gate import quality_at, quality_refusal
    from ctxrelay.transports.heterofold import transport

    def fact(tokens, kept):
        return {"f": 0.3, "selection": "mix", "tokens": tokens, "hide_translated": 12, "cases": 8,
                "native_right": 8, "kept": kept, "fact_recall": kept / 8}  # fmt: skip

    quality = {"top1_agreement": 0.8,
               "recompute": [{"f": 0.3, "selection": "mix", "tokens": 2048, "hide_translated": 12,
                              "top1_agreement": 0.9}],
               "facts": [fact(2048, 8), fact(4096, 5)]}  # fmt: skip
    point = transport.operating_points({"recompute_stage": {"hide_layers": 12}}, quality)[1]["quality"]
    assert [x["tokens"] for x in point["facts_by_tokens"]] == [2048, 4096]
    assert quality_refusal(quality_at(point, 2048), 0.85) is None
    assert "fact recall 0.62 (5/8 facts at 4096 tokens)" in quality_refusal(quality_at(point, 4096), 0.85)
    assert quality_at(point, 2800)["kept"] == 8  # nearer 2048 in log-length


def test_calibration_facts_are_never_the_benchmark_facts():
    asked = {n.fact for n in NEEDLES} | {n.answer for n in NEEDLES}
    assert not asked & ({n.fact for n in CALIBRATION_NEEDLES} | {n.answer for n in CALIBRATION_NEEDLES})
