"""The faithful relay's targets on a gate-replay entry: what holds, what is missed and by how much."""

from ctxrelay_bench.heterofold_frontier.report import GATE_HEADS, gate_row
from ctxrelay_bench.heterofold_frontier.targets import checks, verdict


def entry(**kw) -> dict:
    base = {"sender": "s", "receiver": "r", "length": 4096, "requests": 10, "points": {"f=0.10 mix": 10},
            "needle_cases": 8, "needle_acc": 7 / 8, "native_needle_acc": 1.0, "essays_top1": 0.86,
            "essays_ppl128_ratio": 1.05, "sharegpt_top1": 0.9, "sharegpt_ppl128_ratio": 1.2,
            "speedup": 4.2}  # fmt: skip
    return {**base, **kw}


def test_one_needle_under_native_at_four_x_holds():
    assert verdict(entry()) == "holds"  # 7/8 against 8/8 - 0.125: on the bar, not under it
    assert {c["name"] for c in checks(entry())} == {"speedup", "needles", "essays top-1", "ShareGPT top-1",
                                                    "essays ppl x", "ShareGPT ppl x"}  # fmt: skip


def test_each_miss_is_named_with_its_value_and_target():
    v = verdict(entry(speedup=2.38, essays_top1=0.798, needle_acc=6 / 8, sharegpt_ppl128_ratio=1.6))
    assert v.startswith("misses ")
    assert "speedup 2.38 (bar 4)" in v and "essays top-1 0.798 (bar 0.85)" in v
    assert "needles 6/8 (bar 7/8)" in v and "ShareGPT ppl x 1.600 (bar 1.5)" in v
    # a miss by 0.004 must not read as 0.85 against 0.85
    assert "essays top-1 0.846 (bar 0.85)" in verdict(entry(essays_top1=0.8457))


def test_native_prefill_everywhere_is_one_x_and_other_lengths_have_no_speed_target():
    native = entry(points={"native": 10}, speedup=None, essays_top1=1.0, needle_acc=1.0)
    assert verdict(native) == "misses speedup 1.00 (bar 4)"
    assert verdict({**native, "length": 2048}) == "misses speedup 1.00 (bar 2)"
    assert verdict({**native, "length": 1024}) == "holds"  # the bar names speeds at 2048 and 4096 only
    # a replay without timing rows is judged on quality alone
    assert "speedup" not in {c["name"] for c in checks(entry(speedup=None))}


def test_the_gate_table_row_ends_with_the_verdict():
    row = gate_row(entry(speedup=3.0))
    assert len(row) == len(GATE_HEADS) and row[-1] == "misses speedup 3.00 (bar 4)"


def test_the_newest_run_speaks_for_each_direction_and_length():
    from ctxrelay_bench.heterofold_frontier.targets import newest

    old = {"written": "2026-12-05T10:00:00+0000", "gate": [entry(), entry(length=2048, speedup=2.5)]}
    new = {"written": "2026-12-06T10:00:00+0000", "gate": [entry(needle_acc=0.5)]}
    picked = newest([("new", new), ("old", old)])
    assert [(x["length"], name) for x, name in picked] == [(2048, "old"), (4096, "new")]
    assert verdict(picked[1][0]).startswith("misses needles 4/8")
    assert [name for _, name in newest([("new", new), ("old", old)], every=True)] == ["old", "new", "old"]
