"""The agents workflow on tiny models: native and relayed rounds, agreement with the all-native run."""

import pytest

from ctxrelay.errors import UsageError
from ctxrelay_bench.agents import bench as agents
from ctxrelay_bench.harness import relay_pool


@pytest.fixture
def pool(tiny_by_family, tmp_path):
    return relay_pool(tiny_by_family["llama"], tiny_by_family["qwen2"], tmp_path / "artifacts")


def _opts(pool) -> dict:
    planner, other = list(pool.models)
    return {**agents.OPTIONS, "planner": planner, "executor": other, "checkers": f"{other},{planner}",
            "plan_tokens": 4, "answer_tokens": 3, "check_tokens": 3}  # fmt: skip


@pytest.mark.parametrize("native_first", [True, False])
def test_workflow_rounds_relay_where_the_gate_passes_and_refuse_above_it(pool, native_first):
    planner, other = list(pool.models)
    task = agents.build_task(pool.model(planner).tokenizer, 160, case=1)
    assert task.gold and task.gold.lower() not in task.question.lower()
    rows = agents.run_workflow(pool, task, _opts(pool), [0.0, 0.95], native_first=native_first)
    modes = {r["mode"] for r in rows}
    assert modes == {"native", "relay@0", "relay@0.95"}
    by = {(r["mode"], r["agent"]): r for r in rows}
    agents_seen = ["planner", "executor", f"checker:{other}", f"checker:{planner}"]
    assert all((m, a) in by for m in modes for a in agents_seen)
    assert all(by[("native", a)]["transport"] == "native" and by[("native", a)]["same_as_native"] for a in agents_seen)
    # the planner continues from its own K/V: exact, so the same tokens as its native prefill
    for m in ("relay@0", "relay@0.95"):
        assert by[(m, "planner")]["transport"] != "native" and by[(m, "planner")]["same_as_native"]
        planned = by[(m, "planner")]
        assert planned["capture_s"] > 0 and planned["latency_s"] >= planned["capture_s"]
        assert by[(m, f"checker:{planner}")]["transport"] != "native"  # its own state again
    assert by[("relay@0", "executor")]["transport"] == "heterofold"  # the zero-map edge passes at threshold 0
    assert by[("relay@0.95", "executor")]["transport"] == "native"  # its calibrated 0.9 is below 0.95
    assert "0.95" in by[("relay@0.95", "executor")]["reason"]


def test_summary_and_plot(pool, tmp_path):
    planner = list(pool.models)[0]
    rows = []
    for case in range(2):
        task = agents.build_task(pool.model(planner).tokenizer, 128, case)
        rows += agents.run_workflow(pool, task, _opts(pool), [0.0], native_first=case == 0)
    summ = agents.summary(rows)
    assert {(s["length"], s["mode"]) for s in summ} == {(128, "native"), (128, "relay@0")}
    native = next(s for s in summ if s["mode"] == "native")
    assert native["cases"] == 2 and native["speedup_end_to_end"] == 1.0
    assert native["rounds"]["executor"]["same_as_native"] == 2
    relay = next(s for s in summ if s["mode"] == "relay@0")
    totals = [sum(r["latency_s"] for r in rows if r["mode"] == "relay@0" and r["case"] == c) for c in range(2)]
    assert relay["end_to_end_s"] == pytest.approx(sum(totals) / 2)
    assert agents.plot(summ, tmp_path / "agents.png").stat().st_size > 0


def test_bench_refuses_models_as_flags_and_repeats():
    with pytest.raises(UsageError, match="--set planner"):
        agents.bench(model="x")
    with pytest.raises(UsageError, match="cases per length"):
        agents.bench(repeats=0)
