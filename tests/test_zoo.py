"""Zoo table and loading; the `real` tests load each zoo model and check trained-model behaviour."""

import pytest
import torch

from ctxrelay import zoo
from ctxrelay.models import runner
from ctxrelay.models.attention import probs_attention
from ctxrelay.models.tokens import tokenize_context


def test_zoo_lists_the_four_models():
    assert set(zoo.ZOO) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for e in zoo.ZOO.values():
        assert len(e.sha256) == 64 and e.size > 0
        assert all("==" in p for p in e.packages)


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(zoo.ZooError, match="not a zoo name"):
        zoo.load("no-such-model")
    with pytest.raises(zoo.ZooError, match="unknown zoo model"):
        zoo.pull("no-such-model")


def test_missing_package_names_the_package(monkeypatch):
    entry = zoo.ZooEntry("fake", "llama", ("not-a-real-pkg==1.0",), (("not-a-real-pkg", "x.gguf"),), "0" * 64, 1, "")
    assert zoo.missing_packages(entry) == ["not-a-real-pkg==1.0"]
    with pytest.raises(zoo.ZooError, match=r"not-a-real-pkg==1\.0"):
        zoo.part_paths(entry)


def test_load_local_directory(tmp_path, tiny_by_family):
    m = tiny_by_family["qwen2"]
    m.hf.save_pretrained(tmp_path)
    m.tokenizer.save_pretrained(tmp_path)
    back = zoo.load(tmp_path)
    assert back.spec.weights_hash == m.spec.weights_hash
    # transformers may rebuild a tokenizer by its class on load, so compare two loads of the same files
    assert zoo.load(tmp_path).spec.tokenizer_hash == back.spec.tokenizer_hash


ESSAY = (
    "I've noticed a startling pattern in the companies that do well. The founders are relentlessly "
    "resourceful: they figure out how to get what they want, even when the world does not cooperate. "
    "When we first started Y Combinator we thought the most important quality in a founder was "
    "intelligence. That's the myth in the Valley. What we've learned since is that determination matters "
    "more, and that a founder who keeps going after setbacks is worth more than a brilliant one who quits."
)


@pytest.mark.real
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_real_model_loads_scores_and_is_exact(name):
    m = zoo.load(name)
    ids, _ = tokenize_context(m, ESSAY)
    out = runner.forward(m, ids, logits="all").logits
    ref = m.hf(ids.view(1, -1)).logits[0]
    assert (out - ref).abs().max() < 1e-3  # our runner == transformers on trained weights
    nll = torch.nn.functional.cross_entropy(out[:-1].float(), ids[1:])
    ppl = float(nll.exp())
    print(f"{name}: essay paragraph perplexity {ppl:.2f} over {ids.shape[0]} tokens")
    # an untrained model sits near the vocabulary size (50K-260K); trained ones score 20-55 here
    assert ppl < 100, f"{name} perplexity {ppl:.1f} is not what a trained model gives"

    # exactness of capture -> inject on a trained model: own maps and own KV reproduce native logits
    maps: dict[int, list] = {}
    cap = runner.Capture(keys_pre_rope=True, values=True, on_probs=lambda i, r0, p: maps.setdefault(i, []).append(p))
    captured = runner.forward(m, ids, capture=cap, logits="all").logits
    probs = {i: torch.cat(c, dim=1) for i, c in maps.items()}
    injected = runner.forward(m, ids, attention=dict.fromkeys(probs, probs_attention(probs)), logits="all").logits
    assert (captured - out).abs().max() < 1e-3
    assert (injected - out).abs().max() < 1e-3
    split = 40
    cache = runner.cache_from_pre_rope(m, torch.stack(cap.keys)[:, :split], torch.stack(cap.vals)[:, :split])
    tail = runner.forward(m, ids[split:], cache, logits="all").logits
    assert (tail - out[split:]).abs().max() < 1e-3
