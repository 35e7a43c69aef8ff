"""Issue 11's bar on a gate-replay entry: what holds, what is missed and by how much."""

from ctxrelay.bench.faithful_bar import checks, verdict
from ctxrelay.bench.frontier_report import GATE_HEADS, gate_row


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
    from ctxrelay.bench.faithful_bar import newest

    old = {"written": "2026-12-05T10:00:00+0000", "gate": [entry(), entry(length=2048, speedup=2.5)]}
    new = {"written": "2026-12-06T10:00:00+0000", "gate": [entry(needle_acc=0.5)]}
    picked = newest([("new", new), ("old", old)])
    assert [(x["length"], name) for x, name in picked] == [(2048, "old"), (4096, "new")]
    assert verdict(picked[1][0]).startswith("misses needles 4/8")
    assert [name for _, name in newest([("new", new), ("old", old)], every=True)] == ["old", "new", "old"]


def _run(written: str, seed: int, *entries: dict) -> dict:
    cases = [{"key": f"{kind}-{x['length']}-{i}", "context_sha": f"{seed}-{kind}-{x['length']}-{i}"}
             for x in entries for kind in ("needle", "sharegpt") for i in range(4)]  # fmt: skip
    return {"written": written, "gate": list(entries), "cases": cases}


def test_pooled_runs_weigh_each_request_once():
    from ctxrelay.bench.faithful_bar import pooled

    a = entry(requests=18, points={"f=0.10 mix": 18}, needle_cases=12, needle_acc=11 / 12, native_needle_acc=11 / 12,
              sharegpt_top1=0.895, sharegpt_ppl128_ratio=1.14, speedup=5.3)  # fmt: skip
    b = entry(requests=16, points={"f=0.10 mix": 16}, needle_cases=12, needle_acc=9 / 12, native_needle_acc=10 / 12,
              sharegpt_top1=0.83, sharegpt_ppl128_ratio=1.62, speedup=5.2)  # fmt: skip
    native = entry(points={"native": 16}, length=2048)
    doc = pooled(
        [("a", _run("2026-12-05T10:00:00+0000", 200, a)), ("b", _run("2026-12-06T10:00:00+0000", 500, b, native))]
    )
    assert doc["written"].startswith("2026-12-06")
    y, x = doc["gate"]  # by length: the 2048 entry only one run measured stays as it was
    assert y == native
    assert x["requests"] == 34 and x["needle_cases"] == 24 and x["points"] == {"f=0.10 mix": 34} and x["runs"] == 2
    assert round(x["needle_acc"] * 24) == 20 and round(x["native_needle_acc"] * 24) == 21
    # ShareGPT: 6 conversations of a, 4 of b; perplexity ratios and speedups as weighted geometric means
    assert abs(x["sharegpt_top1"] - (6 * 0.895 + 4 * 0.83) / 10) < 1e-12
    assert abs(x["sharegpt_ppl128_ratio"] - (1.14**6 * 1.62**4) ** 0.1) < 1e-12
    assert abs(x["speedup"] - (5.3**18 * 5.2**16) ** (1 / 34)) < 1e-12
    assert verdict(b).startswith("misses ShareGPT top-1") and verdict(x) == "holds"


def test_runs_of_other_points_or_the_same_requests_are_not_pooled():
    import pytest

    from ctxrelay.bench.faithful_bar import pooled
    from ctxrelay.errors import UsageError

    relayed, native = entry(), entry(points={"native": 10}, speedup=None)
    with pytest.raises(UsageError, match="served other points"):
        pooled(
            [("a", _run("2026-12-05T10:00:00+0000", 1, native)), ("b", _run("2026-12-06T10:00:00+0000", 2, relayed))]
        )
    with pytest.raises(UsageError, match="not another sample"):
        pooled(
            [("a", _run("2026-12-05T10:00:00+0000", 1, relayed)), ("b", _run("2026-12-06T10:00:00+0000", 1, relayed))]
        )
