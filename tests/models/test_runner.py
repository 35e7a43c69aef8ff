"""Exactness of the runner against transformers, and of capture -> inject on every family."""

import torch

from conftest import SAMPLE_TEXT
from ctxrelay.models import runner
from ctxrelay.models.attention import probs_attention
from ctxrelay.models.tokens import tokenize_context

TOL = 1e-4


def _ids(m, text=SAMPLE_TEXT):
    return tokenize_context(m, text)[0]


def test_runner_matches_transformers(tiny):
    ids = _ids(tiny)
    ref = tiny.hf(ids.view(1, -1)).logits[0]
    out = runner.forward(tiny, ids, logits="all").logits
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < TOL


def test_incremental_prefill_matches_one_shot(tiny):
    ids = _ids(tiny)
    whole = runner.forward(tiny, ids, logits="all").logits
    a = runner.forward(tiny, ids[:17], logits="all")
    b = runner.forward(tiny, ids[17:40], a.cache, logits="all")
    c = runner.forward(tiny, ids[40:], b.cache, logits="all")
    assert (torch.cat([a.logits, b.logits, c.logits]) - whole).abs().max() < TOL


def test_long_context_beyond_sliding_window(tiny):
    # gemma3's tiny model has window 8: the sequence is many windows long
    ids = _ids(tiny, SAMPLE_TEXT * 3)[:200]
    ref = tiny.hf(ids.view(1, -1)).logits[0]
    out = runner.forward(tiny, ids, logits="all").logits
    assert (out - ref).abs().max() < TOL


def test_capture_own_maps_then_inject_reproduces_native(tiny):
    ids = _ids(tiny)
    native = runner.forward(tiny, ids, logits="all").logits
    maps: dict[int, list] = {}
    cap = runner.Capture(on_probs=lambda layer, r0, p: maps.setdefault(layer, []).append(p.clone()), prob_chunk=16)
    captured = runner.forward(tiny, ids, capture=cap, logits="all").logits
    assert (captured - native).abs().max() < TOL
    probs = {layer: torch.cat(chunks, dim=1) for layer, chunks in maps.items()}
    t = ids.shape[0]
    assert probs[0].shape == (tiny.spec.num_heads, t, t)
    assert torch.allclose(probs[0].sum(-1), torch.ones(tiny.spec.num_heads, t), atol=1e-5)
    injected = runner.forward(tiny, ids, attention=dict.fromkeys(probs, probs_attention(probs)), logits="all")
    assert (injected.logits - native).abs().max() < TOL


def test_inject_kv_from_pre_rope_capture_then_decode(tiny):
    ids = _ids(tiny)
    ctx, tail = ids[:50], ids[50:]
    native = runner.forward(tiny, ids, logits="all").logits[50:]
    cap = runner.Capture(keys_pre_rope=True, values=True)
    runner.forward(tiny, ctx, capture=cap, logits="none")
    cache = runner.cache_from_pre_rope(tiny, torch.stack(cap.keys), torch.stack(cap.vals))
    assert cache.length == 50
    relayed = runner.forward(tiny, tail, cache, logits="all").logits
    assert (relayed - native).abs().max() < TOL


def test_generate_greedy_is_deterministic(tiny):
    ids = _ids(tiny)[:30]
    g1 = runner.generate(tiny, ids, max_new_tokens=5, stop_at_eos=False)
    g2 = runner.generate(tiny, ids, max_new_tokens=5, stop_at_eos=False)
    assert g1.tokens == g2.tokens and len(g1.tokens) == 5
    ref = tiny.hf.generate(ids.view(1, -1), max_new_tokens=5, do_sample=False, min_new_tokens=5)[0, 30:]
    assert g1.tokens == ref.tolist()
    assert 0 < g1.ttft_s <= g1.total_s


def test_cache_shape_mismatch_is_a_clear_error(tiny):
    bad = torch.zeros(tiny.spec.num_layers + 1, 4, tiny.spec.num_kv_heads, tiny.spec.head_dim)
    try:
        runner.cache_from_pre_rope(tiny, bad, bad)
    except ValueError as e:
        assert "expected [layers=" in str(e)
    else:
        raise AssertionError("mismatched cache shape was accepted")
