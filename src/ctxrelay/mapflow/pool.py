"""Paged block pool: stores the compressed maps of many contexts in fixed-size pages.

Kept tiles per layer vary with the layer and the context (top-p keeps what the map needs), so the
pool hands out pages of `page_tiles` B x B tiles from one preallocated buffer, like vLLM's paged
KV cache: a context's layer occupies ceil(nnz / page_tiles) pages anywhere in the buffer, freeing
returns them, and when the pool is full the least recently used unpinned context is evicted.
The small per-layer index tensors (crow, col, mass, row_mass) live beside the pages.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ctxrelay.mapflow.sparse import BlockMaps


class PoolFull(MemoryError):
    """The maps of one context do not fit even after evicting every unpinned context."""


@dataclass
class _Layer:
    pages: torch.Tensor  # page ids holding this layer's tiles, in order
    nnz: int
    crow: torch.Tensor
    col: torch.Tensor
    mass: torch.Tensor
    row_mass: torch.Tensor
    heads: int


@dataclass
class _Entry:
    layers: dict[int, _Layer]
    pages: int
    index_bytes: int
    pins: int = 0


class MapPool:
    def __init__(self, capacity_bytes: int, block: int = 64, page_tiles: int = 16, dtype=torch.float16):
        tile_bytes = block * block * torch.empty(0, dtype=dtype).element_size()
        self.page_bytes = page_tiles * tile_bytes
        n_pages = int(capacity_bytes // self.page_bytes)
        if n_pages < 1:
            raise ValueError(
                f"pool capacity {capacity_bytes} B is below one page ({self.page_bytes} B = {page_tiles} tiles "
                f"of {block}x{block}); give it more bytes or smaller pages"
            )
        self.block, self.page_tiles, self.dtype = block, page_tiles, dtype
        self.storage = torch.zeros(n_pages, page_tiles, block, block, dtype=dtype)
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: low page ids are handed out first
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    # ---- accounting ---------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return int(self.storage.shape[0])

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def stats(self) -> dict:
        used_pages = self.num_pages - len(self._free)
        tiles = sum(lay.nnz for e in self._entries.values() for lay in e.layers.values())
        tile_bytes = self.page_bytes // self.page_tiles
        return {
            "contexts": len(self._entries),
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": used_pages * self.page_bytes,
            "free_bytes": len(self._free) * self.page_bytes,
            "pages_used": used_pages,
            "pages_total": self.num_pages,
            "tiles": tiles,
            "internal_waste_bytes": used_pages * self.page_bytes - tiles * tile_bytes,
            "index_bytes": sum(e.index_bytes for e in self._entries.values()),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }

    def __str__(self) -> str:
        s = self.stats()
        mib = 2**20
        lines = [
            f"MapPool {s['used_bytes'] / mib:.1f} / {s['capacity_bytes'] / mib:.1f} MiB used "
            f"({s['pages_used']}/{s['pages_total']} pages of {self.page_tiles} tiles), {s['contexts']} context(s)",
            f"  tiles {s['tiles']}, page waste {s['internal_waste_bytes'] / mib:.2f} MiB, "
            f"index {s['index_bytes'] / mib:.2f} MiB, hits {s['hits']} misses {s['misses']} evictions {s['evictions']}",
        ]
        for key, e in self._entries.items():
            lines.append(f"  {key[:40]:40s} {e.pages:6d} pages {len(e.layers):3d} layers pins {e.pins}")
        return "\n".join(lines)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    # ---- storing and reading --------------------------------------------------------------------

    def put(self, key: str, maps: dict[int, BlockMaps]) -> None:
        """Store one context's maps (replacing any previous maps under `key`)."""
        if key in self._entries:
            self.free(key)
        for bm in maps.values():
            if bm.block != self.block:
                raise ValueError(f"maps use block {bm.block} but this pool holds {self.block}x{self.block} tiles")
        need = sum(-(-bm.nnz // self.page_tiles) for bm in maps.values())
        if need > self.num_pages:
            raise PoolFull(f"maps need {need} pages but the pool has {self.num_pages}: raise its capacity")
        self._make_room(need)
        layers, index_bytes = {}, 0
        for layer, bm in maps.items():
            n_pages = -(-bm.nnz // self.page_tiles)
            pages = torch.tensor([self._free.pop() for _ in range(n_pages)], dtype=torch.long)
            if n_pages:
                self._tiles_view()[self._slots(pages)[: bm.nnz]] = bm.tiles.to(self.dtype)
            idx = (bm.crow, bm.col, bm.mass, bm.row_mass)
            layers[layer] = _Layer(pages, bm.nnz, *idx, heads=bm.heads)
            index_bytes += sum(t.numel() * t.element_size() for t in idx)
        self._entries[key] = _Entry(layers, need, index_bytes)

    def get(self, key: str, layers: list[int] | None = None) -> dict[int, BlockMaps] | None:
        """The maps of `key` (tiles gathered out of their pages), or None if absent or evicted."""
        e = self._entries.get(key)
        if e is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        out = {}
        for layer, lay in e.layers.items():
            if layers is not None and layer not in layers:
                continue
            tiles = self._tiles_view()[self._slots(lay.pages)[: lay.nnz]]
            out[layer] = BlockMaps(lay.crow, lay.col, tiles, lay.mass, lay.row_mass, lay.heads, self.block)
        return out

    def free(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        if e.pins:
            self._entries[key] = e
            raise RuntimeError(f"context {key!r} is in use ({e.pins} pin(s)); unpin it before freeing")
        for lay in e.layers.values():
            self._free.extend(lay.pages.tolist()[::-1])

    @contextmanager
    def use(self, key: str):
        """Pin `key` while a receiver reads it, so eviction cannot take it away mid-request."""
        e = self._entries.get(key)
        if e is None:
            raise KeyError(f"context {key!r} is not in the pool")
        e.pins += 1
        try:
            yield self.get(key)
        finally:
            e.pins -= 1

    def _tiles_view(self) -> torch.Tensor:
        return self.storage.view(-1, self.block, self.block)

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_tiles + torch.arange(self.page_tiles)[None, :]).reshape(-1)

    def _make_room(self, need: int) -> None:
        while len(self._free) < need:
            victim = next((k for k, e in self._entries.items() if e.pins == 0), None)
            if victim is None:
                raise PoolFull(f"need {need} free pages, have {len(self._free)}, and every stored context is pinned")
            self.free(victim)
            self.evictions += 1
