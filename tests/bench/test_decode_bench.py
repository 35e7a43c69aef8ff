"""`ctxrelay bench decode` on tiny models: both caches decode the same tokens; only the old one copies."""

import json

import torch

from ctxrelay.models import runner
from ctxrelay_bench.decode import bench as decode


def test_bench_decode_rows_and_same_tokens(tiny_by_family, tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    models = [tiny_by_family["llama"], tiny_by_family["gemma3"]]
    path = decode.bench(lengths=[48], repeats=2, options={"new_tokens": 8}, command="pytest", models=models)
    doc = json.loads(path.read_text())
    assert [r["method"] for r in doc["rows"]] == ["decode-concat", "decode-preallocated"] * 2
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 and len(r["times_s"]) == 2 for r in doc["rows"])
    assert path.with_suffix(".png").exists()


def test_the_concatenating_baseline_copies_every_layer_per_token(tiny):
    ids = torch.arange(3, 30)
    pre = runner.forward(tiny, ids)
    old = decode.ConcatCache([k.clone() for k in pre.cache.keys], [v.clone() for v in pre.cache.values])
    held = []  # keep each step's layer-0 keys alive so no new tensor can reuse a freed address
    for t in range(5):
        runner.forward(tiny, torch.tensor([t + 3]), old, logits="none")
        held.append(old._k[0])
    assert len({k.data_ptr() for k in held}) == 5 and old.length == len(ids) + 5
