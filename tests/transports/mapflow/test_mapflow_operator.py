"""The mix-and-apply and guided operators against dense references, and their memory at 8K tokens."""

import gc
import os
from pathlib import Path

import pytest
import torch

from ctxrelay.models.attention import AttnCall, native_attention
from ctxrelay.transports.mapflow import apply, guided
from ctxrelay.transports.mapflow.sparse import BlockMaps, reselect
from ctxrelay.transports.mapflow.synthetic import random_maps, simplex_w


def _w(hs, hr, seed=0):
    return simplex_w(hs, hr, seed)


@pytest.mark.parametrize("tokens,block", [(200, 16), (256, 32), (77, 8)])
def test_replace_operator_matches_dense_mixture(tokens, block):
    hs, hr, hkv, d = 6, 8, 2, 16
    bm = random_maps(tokens, hs, block, extra=2)
    w = _w(hs, hr)
    v = torch.randn(1, hkv, tokens, d)
    ref = apply.replace_attention_dense(bm.to_dense(), w, v)
    fast = apply.replace_attention(apply.prepare_replace(bm), w, v)
    padded = apply.replace_attention_padded(apply.prepare_padded(bm), w, v)
    assert fast.shape == ref.shape == (1, hr, tokens, d)
    assert (fast - ref).abs().max() < 1e-4
    assert (padded - ref).abs().max() < 1e-4


def test_replace_operator_is_differentiable_in_w_and_v():
    bm = random_maps(96, 4, 16, extra=1)
    w = _w(4, 6).requires_grad_()
    v = torch.randn(1, 2, 96, 8, requires_grad=True)
    apply.replace_attention_padded(apply.prepare_padded(bm), w, v).square().sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    assert v.grad is not None and v.grad.abs().sum() > 0


def _call(t, hr, hkv, d, window=None, softcap=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, t, d, generator=g) for h in (hr, hkv, hkv))
    return AttnCall(0, q, k, v, 0, d**-0.5, window, softcap)


@pytest.mark.parametrize("unit", ["head", "group"])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 30.0)])
def test_guided_operator_matches_dense_masked_softmax(unit, window, softcap):
    t, hs, hr, hkv, d, b = 150, 6, 8, 2, 16, 16
    c = _call(t, hr, hkv, d, window, softcap)
    bm = random_maps(t, hs, b, extra=2, seed=1)
    pat = guided.guided_pattern(bm, _w(hs, hr, 2), 0.8, hkv, unit)
    assert 0 < pat.density() <= 1
    ref = guided.pattern_attention_dense(c, pat)
    out = guided.guided_attention(c, pat, max_elems=5000)  # small slabs: exercises the row split
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("p", [0.5, 0.8, 0.95])
def test_global_guided_selection_keeps_p_of_each_units_mass_in_the_fewest_tiles(p):
    """select="global": per unit, the heaviest tiles until p of the unit's whole (mixed) mass; per-row
    top-p must reach p in every row instead (fewer raw tiles for global, though the always-kept diagonal and
    sink blocks added to both can in principle tip the final count)."""
    t, hs, hr, hkv, b = 160, 6, 8, 2, 16
    bm, w = random_maps(t, hs, b, extra=3, seed=4), _w(hs, hr, 5)
    mixed = torch.einsum("kh,kqn->hqn", w, guided.sender_block_mass(bm)).view(hkv, hr // hkv, 10, 10).mean(1)
    glob = guided.guided_pattern(bm, w, p, hkv, "group", select="global").to_mask()
    row = guided.guided_pattern(bm, w, p, hkv, "group", select="row").to_mask()
    for u in range(hkv):
        flat = mixed[u].flatten()
        need = int((flat.sort(descending=True).values.cumsum(0) < p * flat.sum()).sum()) + 1  # fewest tiles
        picked = glob[u].flatten() & (flat > 0)
        assert (mixed[u] * glob[u]).sum() >= p * flat.sum() - 1e-6
        assert ((mixed[u] * row[u]).sum(-1) >= p * mixed[u].sum(-1) - 1e-6).all()
        assert picked.sum() <= need + glob[u].diagonal().sum() + glob[u][:, 0].sum()  # + the always-kept blocks
    assert glob.sum() < row.sum()  # these maps: per-row keeps more (it need not in general: see the docstring)
    with pytest.raises(ValueError, match="guided selection"):
        guided.guided_pattern(bm, w, p, hkv, "group", select="column")


def test_guided_operator_matches_dense_on_a_global_pattern():
    t, hs, hr, hkv, d, b = 150, 6, 8, 2, 16, 16
    c = _call(t, hr, hkv, d)
    pat = guided.guided_pattern(random_maps(t, hs, b, extra=2, seed=1), _w(hs, hr, 2), 0.8, hkv, select="global")
    out = guided.guided_attention(c, pat, max_elems=5000)
    assert (out - guided.pattern_attention_dense(c, pat)).abs().max() < 1e-5


def test_guided_full_pattern_is_native_attention():
    c = _call(130, 8, 2, 16)
    out = guided.guided_attention(c, guided.full_pattern(130, 8, 16))
    assert (out - native_attention(c)).abs().max() < 1e-5


def test_guided_pattern_p1_is_union_of_mixed_heads():
    bm = random_maps(128, 4, 16, extra=1, seed=3)
    w = torch.zeros(4, 2)
    w[0, 0] = w[1, 0] = 0.5  # receiver head 0 mixes sender heads 0 and 1
    w[3, 1] = 1.0
    pat = guided.guided_pattern(bm, w, 1.0, kv_heads=2, unit="head")
    qb, kb, hd = bm.coords()
    nb = bm.num_row_blocks
    want0 = {(int(i), int(j)) for i, j, h in zip(qb, kb, hd, strict=True) if h in (0, 1)}
    rows = torch.repeat_interleave(torch.arange(2 * nb), pat.counts())
    got0 = {(int(r), int(j)) for r, j in zip(rows, pat.kb, strict=True) if r < nb}
    assert got0 == want0 | {(i, i) for i in range(nb)} | {(i, 0) for i in range(nb)}


def test_local_blocks_and_union():
    keep = torch.zeros(2, 6, 6, dtype=torch.bool)
    keep[0, 5, 2] = True
    pat = guided.pattern_from_mask(keep, 1, 16, local=1)
    mask = pat.to_mask()
    assert mask[0, 5, 2] and mask[0, 5, 4] and mask[0, 5, 5] and mask[0, 5, 0] and not mask[0, 5, 3]
    assert mask[1].sum() == 1 + 2 + 4 * 3  # row 0: one block; row 1: two; rows 2..5: sink, previous, diagonal
    other = guided.pattern_from_mask(torch.ones(2, 6, 6, dtype=torch.bool), 1, 16)
    assert torch.equal(pat.union(other).to_mask(), other.to_mask())


def test_flex_pattern_keeps_blocks_of_last_query_block():
    c = _call(128, 4, 2, 8)
    pat = guided.flex_pattern(c, 16, 0.5, unit="group")
    assert pat.units == 2 and pat.heads_per_unit == 2
    full = guided.full_pattern(128, 4, 16)
    assert pat.nnz < full.nnz / 2 + 1  # two units x fewer blocks than four heads x all blocks


def test_reselect_keeps_a_prefix_of_mass():
    bm = random_maps(256, 4, 16, extra=4)
    low = reselect(bm, 0.5)
    assert 0 < low.nnz < bm.nnz
    assert (low.row_mass <= bm.row_mass + 1e-4).all()


# ---- memory at 8K tokens ------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> bool:
    try:
        Path(f"/proc/{os.getpid()}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to read peak memory")
@pytest.mark.parametrize("mode", ["replace", "guided"])
def test_operator_peak_memory_at_8k_far_below_dense_map(mode):
    t, hs, hr, hkv, d, b = 8192, 12, 14, 2, 64, 64
    bm = random_maps(t, hs, b, extra=4)
    w = _w(hs, hr)
    c = _call(t, hr, hkv, d)
    dense_bytes = hr * t * t * 4  # one fp32 receiver map over all heads: 3.8 GB
    gc.collect()
    if not _reset_peak():
        pytest.skip("cannot reset the peak-RSS counter (/proc/self/clear_refs)")
    before = _rss_kib("VmRSS")
    if mode == "replace":
        out = apply.replace_attention(apply.prepare_replace(bm), w, c.v)
    else:
        out = guided.guided_attention(c, guided.guided_pattern(bm, w, 0.9, hkv, "group"))
    extra = (_rss_kib("VmHWM") - before) * 1024
    assert out.shape == (1, hr, t, d) and torch.isfinite(out).all()
    assert extra < dense_bytes / 8, f"{mode} operator used {extra / 2**20:.0f} MiB at 8K tokens"
    # spot check one query block row against a dense computation of just that row
    i = 100
    rows = slice(i * b, (i + 1) * b)
    if mode == "replace":
        ref = apply.replace_attention_dense(_dense_rows(bm, i), w, c.v)  # [1, Hr, B, d]
        assert (out[:, :, rows] - ref).abs().max() < 1e-4


def _dense_rows(bm: BlockMaps, i: int) -> torch.Tensor:
    """Rows of query block i of the renormalised map [H, B, T], built from that row's tiles only."""
    b, t = bm.block, bm.tokens
    out = torch.zeros(bm.heads, b, bm.num_row_blocks * b)
    lo, hi = int(bm.crow[i]), int(bm.crow[i + 1])
    for n in range(lo, hi):
        kb, h = divmod(int(bm.col[n]), bm.heads)
        out[h, :, kb * b : (kb + 1) * b] = bm.tiles[n].float()
    return out[:, :, :t] / bm.row_mass[:, i * b : (i + 1) * b, None]
