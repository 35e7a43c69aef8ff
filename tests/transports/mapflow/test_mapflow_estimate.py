"""The sampled-row map capture: a valid pattern beside fused SDPA, equal to the exact one when every row is sampled."""

import pytest
import torch

from conftest import SAMPLE_TEXT
from ctxrelay.models import runner
from ctxrelay.models.attention import AttnCall, positions_mask
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.transports import mapflow
from ctxrelay.transports.mapflow import guided, reuse
from ctxrelay.transports.mapflow.mixing import identity_w
from ctxrelay.transports.mapflow.sampled_capture import SampledMapCapture, sample_rows, sampled_block_mass
from ctxrelay.transports.mapflow.sparse import MapsError, maps_from_tensors

BLOCK = 16


def _maps(m, text=SAMPLE_TEXT, capture="sampled", top_p=1.0, rows=4):
    plan = mapflow.map_capture_plan(m, top_p, BLOCK, capture=capture, sample_rows=rows)
    state = capture_state(m, text, "t1", [plan], kv=False)
    meta = state.parts_meta[mapflow.PART]
    return maps_from_tensors(state.parts[mapflow.PART], meta), meta, state


def test_sample_rows_end_on_each_blocks_last_row():
    assert sample_rows(16, 4).tolist() == [3, 7, 11, 15]
    assert sample_rows(16, 1).tolist() == [15]
    assert sample_rows(16, 16).tolist() == list(range(16))
    assert sample_rows(3, 16).tolist() == [0, 1, 2]  # a short last block: each of its rows once


@pytest.mark.parametrize(
    ("t", "heads", "kv_heads", "window", "softcap", "rows"),
    [(300, 4, 2, None, None, 16), (300, 4, 1, 100, None, 5), (257, 6, 3, 40, 30.0, 16), (130, 2, 1, 1000, None, 7)],
)
def test_block_mass_is_the_sampled_rows_softmax_summed_per_key_block(t, heads, kv_heads, window, softcap, rows):
    """Against the plain definition: each sampled row's softmax over the keys it can see (causal, the
    window), summed per key block, averaged over the block's rows; partial last blocks included."""
    g = torch.Generator().manual_seed(t)
    q, k = torch.randn(1, heads, t, 8, generator=g) * 2, torch.randn(1, kv_heads, t, 8, generator=g) * 2
    c = AttnCall(0, q, k, torch.zeros_like(k), 0, 8**-0.5, window, softcap)
    got = sampled_block_mass(c, BLOCK, rows)
    nb = -(-t // BLOCK)
    kx = k.repeat_interleave(heads // kv_heads, dim=1)[0]
    for b in range(nb):
        idx = b * BLOCK + sample_rows(min(BLOCK, t - b * BLOCK), rows)
        s = (q[0, :, idx] @ kx.transpose(1, 2)) * c.scale
        s = torch.tanh(s / softcap) * softcap if softcap else s
        p = torch.softmax(s.masked_fill(~positions_mask(idx, t, window), float("-inf")), -1)
        p = torch.nn.functional.pad(p, (0, nb * BLOCK - t)).view(heads, idx.numel(), nb, BLOCK).sum(-1).mean(1)
        assert torch.allclose(got[:, b], p, atol=1e-6)


def test_sampled_capture_keeps_fused_attention(tiny, monkeypatch):
    def no_eager(*args, **kwargs):
        raise AssertionError("the sampled capture must not run eager attention")

    monkeypatch.setattr(runner, "eager_attention", no_eager)  # the runner's capture-forced eager path
    _, meta, _ = _maps(tiny)
    assert meta["source"] == "sampled" and meta["sample_rows"] == 4


def test_sampled_maps_are_a_valid_causal_pattern(tiny):
    ids = tokenize_context(tiny, SAMPLE_TEXT)[0]
    maps, meta, _ = _maps(tiny, top_p=0.8)
    assert meta["layers"] == list(range(tiny.spec.num_layers)) and meta["tokens"] == ids.shape[0]
    for bm in maps.values():
        assert not bm.has_tiles and bm.row_mass.shape == (bm.heads, ids.shape[0])
        qb, kb, _ = bm.coords()
        assert (kb <= qb).all() and (bm.mass > 0).all()  # causal, every kept block holds mass
        assert ((bm.crow[1:] - bm.crow[:-1]) > 0).all()  # every query block keeps something
        for i in range(bm.num_row_blocks):  # cols ascending within a row, as the exact capture stores them
            c = bm.col[bm.crow[i] : bm.crow[i + 1]]
            assert (c[1:] > c[:-1]).all()
        assert (bm.row_mass <= 1 + 1e-5).all() and (bm.row_mass >= 0.8 - 1e-4).all()
        w = torch.rand(bm.heads, tiny.spec.num_heads)
        pat = guided.guided_pattern(bm, w / w.sum(0), 0.5, tiny.spec.num_kv_heads, "group", local=1)
        keep = pat.to_mask()
        n = bm.num_row_blocks
        idx = torch.arange(n)
        assert keep[:, idx, idx].all() and keep[:, idx[1:], idx[:-1]].all() and keep[:, :, 0].all()


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_every_row_sampled_equals_the_exact_capture(tiny, top_p):
    exact, exact_meta, _ = _maps(tiny, capture="exact", top_p=top_p)
    sampled, _, _ = _maps(tiny, top_p=top_p, rows=BLOCK)
    assert exact_meta["source"] == "exact"
    for layer, e in exact.items():
        s = sampled[layer]
        assert torch.equal(s.crow, e.crow) and torch.equal(s.col, e.col)
        assert torch.allclose(s.mass, e.mass, atol=1e-5)


def test_guided_relay_from_every_row_sampled_equals_exact(tiny):
    ids = tokenize_context(tiny, SAMPLE_TEXT)[0]
    s = tiny.spec
    cfg = reuse.ReuseConfig(
        modes=["guided"] * s.num_layers,
        mapping=list(range(s.num_layers)),
        w={j: identity_w(s.num_heads) for j in range(s.num_layers)},
        top_p=0.9,
        guided_p=0.9,
        unit="head",
        block=BLOCK,
    )
    outs = []
    for capture, rows in (("exact", 4), ("sampled", BLOCK)):
        maps, _, _ = _maps(tiny, capture=capture, top_p=0.95, rows=rows)
        with torch.inference_mode():
            outs.append(runner.head(tiny, reuse.context_pass(tiny, ids, maps, cfg)[1], "all"))
    assert (outs[0] - outs[1]).abs().max() < 1e-4


def test_replace_mode_refuses_a_pattern_only_map(tiny):
    maps, meta, _ = _maps(tiny)
    s = tiny.spec
    cfg = reuse.ReuseConfig(
        modes=["replace"] * s.num_layers,
        mapping=list(range(s.num_layers)),
        w={j: identity_w(s.num_heads) for j in range(s.num_layers)},
        top_p=0.9,
        block=BLOCK,
    )
    with pytest.raises(MapsError, match="capture='exact'"):
        reuse.select_maps(maps, cfg, meta["top_p"])


def test_transport_plan_is_sampled_for_guided_edges_and_exact_for_replace(tiny):
    n = tiny.spec.num_layers
    guided_edge = {"modes": ["native"] + ["guided"] * (n - 1), "mapping": [-1] + list(range(1, n)), "block": BLOCK}
    replace_edge = dict(guided_edge, modes=["native"] + ["replace"] * (n - 1))
    assert mapflow.edge_capture(guided_edge) == "sampled" and mapflow.edge_capture(replace_edge) == "exact"
    assert mapflow.edge_capture(dict(guided_edge, capture="exact")) == "exact"
    with pytest.raises(ValueError, match="needs capture='exact'"):
        mapflow.edge_capture(dict(replace_edge, capture="sampled"))
    plan = mapflow.transport.capture_plan(tiny, [guided_edge])
    assert plan.on_qk is not None and plan.on_probs is None and plan.qk_layers == set(range(1, n))
    plan = mapflow.transport.capture_plan(tiny, [guided_edge, replace_edge])
    assert plan.on_probs is not None and plan.on_qk is None


def test_bad_capture_options_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="unknown mapflow capture"):
        mapflow.map_capture_plan(tiny, capture="pooled")
    with pytest.raises(MapsError, match="sampled rows per query block"):
        SampledMapCapture(2, 2, block=16, rows=17)
