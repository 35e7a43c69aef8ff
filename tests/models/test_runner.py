"""Exactness of the runner against transformers, and of capture -> inject on every family."""

import pytest
import torch

from conftest import SAMPLE_TEXT
from ctxrelay.models import attention, runner
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


def test_mlp_in_chunks_of_rows_matches_the_whole_prefill_at_once(tiny, monkeypatch):
    ids = torch.randint(3, tiny.spec.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    whole = runner.forward(tiny, ids, logits="all").logits
    inter = runner.layers(tiny)[0].mlp.gate_proj.out_features
    monkeypatch.setattr(runner, "MLP_CHUNK_ELEMS", 64 * inter)  # chunks of 64 rows: 5 per layer
    calls = []
    down = runner.layers(tiny)[0].mlp.down_proj
    monkeypatch.setattr(down, "forward", lambda x, f=down.forward: calls.append(x.shape[1]) or f(x))
    chunked = runner.forward(tiny, ids, logits="all").logits
    assert calls == [64, 64, 64, 64, 44]
    assert (chunked - whole).abs().max() < 1e-5


def test_tail_logits_are_the_last_rows_of_every_rows_logits(tiny):
    ids = _ids(tiny)
    whole = runner.forward(tiny, ids, logits="all").logits
    for n in (1, 5, ids.numel()):
        assert (runner.tail_logits(tiny, ids, n) - whole[-n:]).abs().max() < TOL


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


# ---- the preallocated cache and explicit positions --------------------------------------------------


def test_decoding_writes_into_preallocated_storage_not_a_new_copy_per_token(tiny):
    ids = _ids(tiny)[:40]
    out = runner.forward(tiny, ids)
    cache = out.cache
    cache.reserve(cache.length + 64)
    ptr, grown = cache._k[0].data_ptr(), cache.reallocations
    nxt = int(out.logits[-1].argmax())
    for _ in range(64):
        step = runner.forward(tiny, torch.tensor([nxt]), cache)
        nxt = int(step.logits[-1].argmax())
    assert cache.length == 40 + 64
    assert cache.reallocations == grown and cache._k[0].data_ptr() == ptr  # storage never reallocated
    # growing without a reservation copies the cache a few times, not once per token
    c = runner.KVCache.empty(tiny)
    for t in range(600):
        runner.forward(tiny, _ids(tiny)[t % 20 : t % 20 + 1], c, logits="none")
    assert c.length == 600 and c.reallocations <= 6


def test_decode_reserves_once_for_the_whole_generation(tiny):
    ids = _ids(tiny)[:30]
    out = runner.forward(tiny, ids)
    before = out.cache.reallocations
    gen = runner.decode(tiny, out.cache, out.logits[-1], 0.0, max_new_tokens=40, stop_at_eos=False)
    assert len(gen.tokens) == 40 and out.cache.reallocations <= before + 1


def test_recomputing_every_position_over_a_wrong_cache_reproduces_native(tiny):
    """The selective-recompute mechanism at f = 1: every token recomputed at its own position, over a
    cache full of wrong K/V, gives native prefill exactly (each query sees only recomputed entries)."""
    ids = _ids(tiny, SAMPLE_TEXT * 2)[:120]
    native = runner.forward(tiny, ids, logits="all")
    s = tiny.spec
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(1, s.num_kv_heads, len(ids), s.head_dim, generator=g) for _ in range(s.num_layers)]
    wrong = runner.KVCache([n.clone() for n in noise], [n.clone() for n in noise])
    out = runner.forward(tiny, ids, wrong, positions=torch.arange(len(ids)), logits="all")
    assert (out.logits - native.logits).abs().max() < TOL
    for i in range(s.num_layers):
        assert (out.cache.keys[i] - native.cache.keys[i]).abs().max() < TOL


def test_scattered_positions_attend_by_position(tiny):
    """Recomputing a scattered subset over the native cache gives back the native K/V and logits there
    (each query sees exactly what precedes it, within the sliding window where the layer has one)."""
    ids = _ids(tiny, SAMPLE_TEXT * 2)[:150]
    native = runner.forward(tiny, ids, logits="all")
    pos = torch.tensor([0, 3, 17, 18, 19, 64, 101, 149])
    cache = native.cache.clone()
    out = runner.forward(tiny, ids[pos], cache, positions=pos, logits="all")
    assert (out.logits - native.logits[pos]).abs().max() < TOL
    assert cache.length == len(ids)
    for i in range(tiny.spec.num_layers):
        assert (cache.keys[i] - native.cache.keys[i]).abs().max() < TOL
        assert (cache.values[i] - native.cache.values[i]).abs().max() < TOL


def test_positions_must_fill_the_cache_without_gaps(tiny):
    ids = _ids(tiny)[:10]
    cache = runner.forward(tiny, ids, logits="none").cache
    for bad, why in (([12], "without a gap"), ([3, 3], "distinct"), ([-1], ">= 0"), ([1, 2, 3], "positions")):
        n = len(bad) if why != "positions" else 2
        try:
            runner.forward(tiny, ids[:n], cache, positions=torch.tensor(bad), logits="none")
        except ValueError as e:
            assert why in str(e)
        else:
            raise AssertionError(f"positions {bad} were accepted")
    out = runner.forward(tiny, ids[:3], cache, positions=torch.tensor([2, 10, 11]), logits="none")  # overwrite + append
    assert out.cache.length == 12


def _full_mask_attention(c):
    """The reference: SDPA over the whole cache with the full visibility mask."""
    gqa = c.q.shape[1] != c.k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        c.q, c.k, c.v, attn_mask=attention.call_mask(c), scale=c.scale, enable_gqa=gqa
    )


def test_native_attention_gives_each_query_only_the_keys_it_can_see(monkeypatch):
    """Sliding-window layers run SDPA per chunk of query rows on the keys inside their windows (and
    no layer reads keys past its last query); the output equals SDPA over the whole masked cache:
    a prefill, an appended chunk, scattered positions with a key mask, one decode step."""
    monkeypatch.setattr(attention, "WINDOW_CHUNK", 5)
    g = torch.Generator().manual_seed(0)
    s, h, hkv, d = 61, 4, 2, 8
    k, v = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)
    hide = torch.rand(s, generator=g) > 0.3
    scattered = torch.tensor([0, 2, 3, 9, 30, 31, 32, 33, 40, 58])
    hide[scattered] = True  # a query always sees itself
    calls = ((0, s, None, None), (20, 41, None, None), (0, 10, scattered, hide), (60, 1, None, None))
    for window in (None, 7):
        for q_start, t, pos, key_mask in calls:
            q = torch.randn(1, h, t, d, generator=g)
            c = attention.AttnCall(0, q, k, v, q_start, d**-0.5, window, None, pos, key_mask)
            assert (attention.native_attention(c) - _full_mask_attention(c)).abs().max() < 1e-5


def test_queries_at_the_end_of_the_cache_take_the_unmasked_kernel_with_the_same_output(monkeypatch):
    """Selective recompute's last tokens (and a suffix after a cache) sit at the cache's last positions:
    causal_tail computes them as two unmasked flash calls merged by log-sum-exp; the rows before them
    (scattered sentences) keep the masked call, and the output equals SDPA over the whole masked cache."""
    monkeypatch.setattr(attention, "SPLIT_MIN_ROWS", 3)
    taken, tail_attention = [], attention.causal_tail
    monkeypatch.setattr(attention, "causal_tail", lambda c, run: taken.append(run) or tail_attention(c, run))
    g = torch.Generator().manual_seed(1)
    s, h, hkv, d = 70, 6, 2, 8
    k, v = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)
    tail = torch.arange(50, s)
    cases = ((torch.cat([torch.tensor([0, 7, 8, 30]), tail]), 20), (tail, 20), (torch.arange(s), s), (None, 20))
    for pos, run in cases:
        t = s - 50 if pos is None else pos.numel()
        q = torch.randn(1, h, t, d, generator=g)
        c = attention.AttnCall(0, q, k, v, s - t if pos is None else 0, d**-0.5, None, None, pos)
        assert (attention.native_attention(c) - _full_mask_attention(c)).abs().max() < 1e-5
        assert taken.pop() == run
    assert attention.final_run(torch.tensor([3, 4, 8, 9]), 10) == 2 and attention.final_run(tail, s + 1) == 0


def test_window_row_chunks_keep_scattered_positions_apart(monkeypatch):
    """Selective recompute's scattered positions (the sink, a sentence, the last tokens): each SDPA
    call of a sliding-window layer covers rows within WINDOW_CHUNK positions of each other, so its
    key range stays rows + window instead of spanning the cache; every row is covered once."""
    monkeypatch.setattr(attention, "WINDOW_CHUNK", 4)
    qpos = torch.tensor([0, 1, 50, 51, 52, 53, 54, 55, 200, 300, 301])
    chunks = attention._row_chunks(qpos, window=8)
    assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(qpos.numel()))
    for c in chunks:
        assert c.stop - c.start <= 4 and int(qpos[c].max() - qpos[c].min()) < 4
    assert attention._row_chunks(qpos, window=None) == [slice(0, qpos.numel())]


@pytest.mark.parametrize("named", [False, True])
def test_hidden_entries_are_invisible_in_early_layers_to_every_later_token(tiny, named):
    """KVCache.hide: the appended tokens and decoded ones skip the hidden entries in the first k layers,
    or in the layers named (the same as a per-layer key mask), see them in the rest, and a clone keeps
    the hiding."""
    import dataclasses

    ids = _ids(tiny)
    ctx, suffix = ids[:-6], ids[-6:]
    k = max(1, tiny.spec.num_layers // 2)
    layers = {tiny.spec.num_layers - 1} if named else set(range(k))  # named: the last layer alone
    hidden = torch.zeros(ctx.numel(), dtype=torch.bool)
    hidden[3:-2] = True  # up to the last entries: inside every sliding window too

    def masked(c):
        vis = torch.ones(c.k.shape[2], dtype=torch.bool)
        vis[: hidden.numel()] = ~hidden
        return attention.native_attention(dataclasses.replace(c, key_mask=vis))

    by_layer = dict.fromkeys(layers, masked)
    ref_cache = runner.forward(tiny, ctx, logits="none").cache
    ref = runner.forward(tiny, suffix, ref_cache, attention=by_layer, logits="all").logits
    ref_next = runner.forward(tiny, ids[:1], ref_cache, attention=by_layer).logits
    cache = runner.forward(tiny, ctx, logits="none").cache
    cache.hide(hidden, layers if named else k)
    plain = runner.forward(tiny, suffix, cache.clone(), logits="all").logits
    assert (plain - ref).abs().max() < TOL
    out = runner.forward(tiny, suffix, cache, logits="all").logits
    after = cache.clone()  # cloned past the mask (the question appended): a decode from the copy hides too
    nxt = runner.forward(tiny, ids[:1], cache).logits  # a decoded token: hidden from it too
    assert (out - ref).abs().max() < TOL and (nxt - ref_next).abs().max() < TOL
    assert (runner.forward(tiny, ids[:1], after).logits - ref_next).abs().max() < TOL
    seen = runner.forward(tiny, suffix, runner.forward(tiny, ctx, logits="none").cache, logits="all").logits
    assert (seen - ref).abs().max() > 1e-3  # the hidden entries did matter
    cache.hide(hidden, 0)
    assert cache.visible(cache.length) is None and cache.hidden_in == frozenset()
