import json
import statistics

import pytest
import torch

from ctxrelay.data.datasets import essay_haystack
from ctxrelay.errors import UsageError
from ctxrelay.metrics import perplexity_at
from ctxrelay.models import runner
from ctxrelay_bench.native import bench as native_jobs


def test_bench_writes_results_for_tiny_models(tiny_by_family, tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    models = [tiny_by_family["llama"], tiny_by_family["gemma3"]]
    path = native_jobs.bench(lengths=[64, 32], repeats=2, out="tiny_native", command="pytest", models=models)
    assert path == tmp_path / "tiny_native.json"
    assert (tmp_path / "tiny_native.png").exists()
    doc = json.loads(path.read_text())
    assert doc["command"] == "pytest" and doc["complete"] is True
    assert doc["machine"]["torch_threads"] == torch.get_num_threads()
    got = [(r["receiver"], r["context_tokens"]) for r in doc["rows"]]
    assert got == [(m.name, n) for m in models for n in (32, 64)]
    for r in doc["rows"]:
        assert r["transport"] == "native" and r["method"] == "prefill"
        assert len(r["times_s"]) == r["repeats"] == 2 and len(r["warmup_s"]) == 1
        assert r["native_ttft_s"] == statistics.median(r["times_s"])
        assert r["tokens_per_s"] == pytest.approx(r["context_tokens"] / r["native_ttft_s"])
        # a diagnostic only: tiny prefills are mostly single-threaded Python, so no bound on it here
        assert len(r["cpu_share"]) == 2 and all(c > 0 for c in r["cpu_share"])
        assert r["attempts"] == 1 and "discarded_times_s" not in r


def test_timed_call_is_native_prefill(tiny_by_family):
    m = tiny_by_family["qwen2"]
    ids = native_jobs.essay_ids(m, 48)
    assert ids.shape == (48,)
    ref = m.hf(ids[None]).logits[0, -1]
    assert native_jobs.native_ttft(m, ids) == int(ref.argmax())


def test_slow_points_use_fewer_repeats(tiny_by_family):
    row = native_jobs.measure_point(
        tiny_by_family["llama"], 32, repeats=3, opts={**native_jobs.DEFAULTS, "slow_s": 1e-9, "slow_repeats": 1}
    )
    assert row["repeats"] == 1 and len(row["times_s"]) == 1


def test_contended_points_are_retried(tiny_by_family):
    # a share no run can reach forces every retry; the row keeps one attempt and shows the others
    opts = {**native_jobs.DEFAULTS, "retry_share": 10.0, "retries": 2}
    row = native_jobs.measure_point(tiny_by_family["llama"], 32, repeats=2, opts=opts)
    assert row["attempts"] == 3 and len(row["discarded_times_s"]) == 2
    assert all(len(t) == 2 for t in row["discarded_times_s"]) and len(row["times_s"]) == 2


def test_bad_input_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    with pytest.raises(UsageError, match="--model"):
        native_jobs.bench(model="", lengths=[8])
    with pytest.raises(UsageError, match="not --sender"):
        native_jobs.bench(model="x", sender="a", lengths=[8])
    with pytest.raises(UsageError, match="unknown native bench option"):
        native_jobs.bench(model="x", lengths=[8], options={"bogus": 1})
    assert native_jobs.model_names("all") == list(native_jobs.ZOO_ORDER)


@pytest.mark.real
@pytest.mark.parametrize("name", native_jobs.ZOO_ORDER)
def test_zoo_model_scores_heldout_essay(name):
    """A trained model predicts held-out prose well and uses its context.

    The bound is loose on purpose: a coder model reads essays at ppl ~40, while a broken load or
    runner (wrong RoPE, norms, dequantisation) lands in the hundreds or thousands. Shuffling the
    same tokens must hurt a lot, or the model is not reading its context.
    """
    from ctxrelay import zoo

    m = zoo.load(name)
    text = essay_haystack(m.tokenizer, 256, split="heldout", seed=0)
    ids = torch.tensor(m.tokenizer(text)["input_ids"])
    logits = runner.forward(m, ids, logits="all").logits
    ppl = perplexity_at(logits[:-1], ids[1:], horizons=(255,))["255"]
    shuffled = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))]
    logits_sh = runner.forward(m, shuffled, logits="all").logits
    ppl_sh = perplexity_at(logits_sh[:-1], shuffled[1:], horizons=(255,))["255"]
    print(f"\n{name}: held-out essay ppl over 255 tokens = {ppl:.2f} (same tokens shuffled: {ppl_sh:.0f})")
    assert ppl < 60, f"{name} scores held-out prose at ppl {ppl:.1f}: not what a trained model gives"
    assert ppl_sh > 4 * ppl, f"{name}: shuffled text ppl {ppl_sh:.1f} vs {ppl:.1f}: context barely matters"
