"""bench mapflow-capture's phases and the GPU check's CPU path on tiny models (what they record, not how fast)."""

import json
from types import SimpleNamespace

import torch

from conftest import SAMPLE_TEXT
from ctxrelay.models.capture import capture_state
from ctxrelay.transports import mapflow
from ctxrelay.transports.mapflow.mixing import identity_w
from ctxrelay.transports.mapflow.reuse import ReuseConfig
from ctxrelay_bench.mapflow_capture import bench as mapflow_capture
from ctxrelay_bench.mapflow_capture.operators import guided_operator_times
from ctxrelay_bench.mapflow_gpu import bench as mapflow_gpu

BLOCK = 16


def _guided_params(m) -> dict:
    n = m.spec.num_layers
    return {"modes": ["native"] + ["guided"] * (n - 1), "mapping": [-1] + list(range(1, n)), "block": BLOCK}


def test_overhead_pairs_native_with_the_edges_default_capture(tiny_by_family):
    m = tiny_by_family["qwen2"]
    art = SimpleNamespace(params=dict(_guided_params(m), capture_p=0.95))
    opts = dict(mapflow_capture.DEFAULTS, warmup=0, exact_repeats=1)
    res = mapflow_capture.overhead(m, art, SAMPLE_TEXT, 3, opts)
    assert res["capture"] == "sampled" and res["sample_rows"] == mapflow.SAMPLE_ROWS
    assert len(res["native_times_s"]) == len(res["capture_times_s"]) == 3 and len(res["exact_times_s"]) == 1
    assert res["hook_s"] > 0 and res["native_s"] > 0


def test_guided_operator_times_report_the_ideal(tiny_by_family):
    m = tiny_by_family["qwen2"]
    s = m.spec
    plan = mapflow.map_capture_plan(m, 0.95, BLOCK, capture="sampled")
    state = capture_state(m, SAMPLE_TEXT, "t1", [plan], kv=False)
    w = {j: identity_w(s.num_heads) for j in range(1, s.num_layers)}
    cfg = ReuseConfig(["native"] + ["guided"] * (s.num_layers - 1), [-1] + list(range(1, s.num_layers)), w, block=BLOCK)
    res = guided_operator_times(state, cfg, m, repeats=1)
    assert res["guided_layers"] == s.num_layers - 1 and len(res["layers"]) == s.num_layers - 1
    assert res["ideal_ms_total"] == round(sum(x["density"] * res["sdpa_ms"] for x in res["layers"]), 2)
    assert set(res["parts_ms"]) == {"gather", "attend", "scatter"}


def test_gpu_check_skips_cleanly_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mapflow_gpu.main(["256", "1"]) == 0
    doc = json.loads((tmp_path / "mapflow-gpu.json").read_text())
    assert doc["rows"][0]["skipped"] in ("no CUDA device", "triton is not installed")


def test_runs_add_to_one_results_file(tmp_path, monkeypatch):
    from ctxrelay.results import write_results

    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    first = [
        {"transport": "mapflow", "phase": "overhead", "context_tokens": 64, "capture": "sampled", "sample_rows": 4},
        {"transport": "mapflow", "phase": "quality", "context_tokens": 64, "source": "exact", "top1_agreement": 0.5},
    ]
    write_results("cap", first, "run 1", extra={"phase_commands": {"overhead": "run 1", "quality": ["run 1"]}})
    again = [dict(first[1], top1_agreement=0.6)]
    rows, commands = mapflow_capture._merged("cap", again, ["quality"], "run 2")
    assert [r.get("top1_agreement") for r in rows] == [None, 0.6]  # the same source replaced, the others kept
    assert commands == {"overhead": "run 1", "quality": ["run 1", "run 2"]}
