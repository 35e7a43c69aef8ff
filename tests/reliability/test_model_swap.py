"""A cached zoo model's weights replaced by another checkpoint: the loader hashes what it loads, so
the artifact calibrated for the original is refused by name and requests prefill natively."""

import json
import logging
import os

from ctxrelay import zoo
from ctxrelay.models.spec import hash_state_dict
from ctxrelay.models.tiny import tiny_model
from ctxrelay_bench.reliability import interfaces as doors


def test_a_swapped_checkpoint_is_refused_by_name(tiny_by_family, tmp_path, monkeypatch):
    logging.getLogger("ctxrelay").setLevel(logging.ERROR)
    c = doors.model_swap(tiny_by_family["llama"], tiny_model("llama", seed=1), tiny_by_family["qwen2"], tmp_path)
    assert c.clean, c.failures
    assert "not the checkpoint the cache's manifest records" in c.details["note"]
    assert any("different checkpoint" in s for s in c.details["skipped"])


def test_the_hash_is_recorded_once_and_redone_when_the_files_change(tiny_by_family, own_cache, monkeypatch):
    llama = tiny_by_family["llama"]
    name = next(iter(zoo.ZOO))
    d = zoo.model_dir(name)
    llama.hf.save_pretrained(d)
    llama.tokenizer.save_pretrained(d)
    (d / "ctxrelay.json").write_text(json.dumps({"weights_hash": hash_state_dict(llama.hf), "conversion_version": 1}))
    hashed = []
    real = zoo.hash_state_dict
    monkeypatch.setattr(zoo, "hash_state_dict", lambda m: hashed.append(1) or real(m))
    first = zoo.load(name, pull_missing=False)
    second = zoo.load(name, pull_missing=False)
    assert len(hashed) == 1 and first.spec.weights_hash == second.spec.weights_hash == llama.spec.weights_hash
    weights = next(d.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))  # touched: hashed again
    zoo.load(name, pull_missing=False)
    assert len(hashed) == 2
    record = json.loads((d / zoo.VERIFIED).read_text())
    record["weights_hash"] = "f" * 64  # an edited record is not believed
    (d / zoo.VERIFIED).write_text(json.dumps(record))
    assert zoo.load(name, pull_missing=False).spec.weights_hash == llama.spec.weights_hash
    assert len(hashed) == 3
