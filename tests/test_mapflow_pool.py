"""Paged map pool: round trip, page accounting, LRU eviction, pinning."""

import pytest
import torch

from ctxrelay.mapflow.pool import MapPool, PoolFull
from test_mapflow_operator import random_maps


def _maps(seed, tokens=256, layers=3):
    return {i: random_maps(tokens, 4, 16, extra=2, seed=seed * 10 + i) for i in range(layers)}


def _pool(pages):
    return MapPool(capacity_bytes=pages * 4 * 16 * 16 * 2, block=16, page_tiles=4)


def test_round_trip_and_accounting():
    pool = _pool(400)
    maps = _maps(0)
    pool.put("a", maps)
    got = pool.get("a")
    for i, bm in maps.items():
        assert torch.equal(got[i].tiles, bm.tiles) and torch.equal(got[i].col, bm.col)
        assert torch.equal(got[i].row_mass, bm.row_mass)
    s = pool.stats()
    need = sum(-(-bm.nnz // 4) for bm in maps.values())
    assert s["pages_used"] == need and s["tiles"] == sum(bm.nnz for bm in maps.values())
    assert 0 <= s["internal_waste_bytes"] < len(maps) * pool.page_bytes
    assert "MapPool" in str(pool) and s["hits"] == 1
    pool.free("a")
    assert pool.stats()["pages_used"] == 0 and pool.get("a") is None


def test_lru_eviction_and_pinning():
    one = sum(-(-bm.nnz // 4) for bm in _maps(0).values())
    pool = _pool(int(one * 2.5))  # room for two contexts
    pool.put("a", _maps(0))
    pool.put("b", _maps(1))
    pool.get("a")  # a is now more recent than b
    pool.put("c", _maps(2))
    assert "b" not in pool and "a" in pool and "c" in pool
    assert pool.stats()["evictions"] == 1
    with pool.use("a") as maps_a:
        assert maps_a is not None
        with pool.use("c"), pytest.raises(PoolFull):
            pool.put("d", _maps(3))  # both residents are pinned
        with pytest.raises(RuntimeError, match="in use"):
            pool.free("a")
    pool.put("d", _maps(3))  # unpinned now: the LRU one goes
    assert "d" in pool


def test_too_big_or_wrong_block_is_a_clear_error():
    with pytest.raises(ValueError, match="below one page"):
        MapPool(capacity_bytes=10, block=16, page_tiles=4)
    with pytest.raises(PoolFull, match="raise its capacity"):
        _pool(3).put("a", _maps(0))
    with pytest.raises(ValueError, match="block"):
        MapPool(capacity_bytes=1 << 20, block=32).put("a", _maps(0))
