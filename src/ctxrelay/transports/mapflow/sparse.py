"""Block top-p compression of attention maps, streamed during the sender's prefill.

The causal T x T map of one layer is cut into B x B tiles. For each query-block row and sender
head we keep the fewest key blocks whose attention mass (averaged over the block's rows) reaches
top-p. Kept tiles are stored raw (not renormalised) in block-sparse rows (BSR):

    crow [nqb + 1]     kept tiles of query-block row i are col[crow[i]:crow[i+1]]
    col  [nnz]         key_block * heads + head, ascending: heads of one key block are contiguous
    tiles [nnz, B, B]  the kept probabilities (float16 by default; padded rows/cols are zero)
    mass [nnz]         each tile's mean row mass (what top-p ranked; guided mode reuses it)
    row_mass [H, T]    kept mass per query row: dividing by it renormalises the kept map

Keeping tiles raw lets a map captured at p be re-selected at any lower p exactly (`reselect`),
and lets the operator renormalise after the product instead of rewriting tiles.

A pattern-only map (sampled_capture.py: block masses estimated from sampled query rows beside fused
SDPA) has the same crow / col / mass / row_mass but no tiles ([0, B, B]); meta "source" says which
(SOURCES). Guided and hybrid modes read only the pattern and masses; replace mode needs tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxrelay.errors import CtxrelayError

FORMAT = 1
SOURCES = ("exact", "sampled")  # where a map's masses come from: every row's probabilities, or sampled rows


class MapsError(CtxrelayError, ValueError):
    """Compressed maps that are missing, malformed or do not fit the model or context."""


@dataclass
class BlockMaps:
    """One layer's compressed map (see module docstring for the layout)."""

    crow: torch.Tensor
    col: torch.Tensor
    tiles: torch.Tensor
    mass: torch.Tensor
    row_mass: torch.Tensor
    heads: int
    block: int

    @property
    def tokens(self) -> int:
        return int(self.row_mass.shape[1])

    @property
    def num_row_blocks(self) -> int:
        return int(self.crow.shape[0]) - 1

    @property
    def nnz(self) -> int:
        return int(self.col.shape[0])

    def causal_tiles(self) -> int:
        n = self.num_row_blocks
        return self.heads * n * (n + 1) // 2

    def density(self) -> float:
        """Kept tiles / causal tiles."""
        return self.nnz / max(1, self.causal_tiles())

    @property
    def has_tiles(self) -> bool:
        """False for a pattern-only map (masses without probabilities: replace mode cannot read it)."""
        return int(self.tiles.shape[0]) == self.nnz

    def nbytes(self) -> int:
        ts = (self.crow, self.col, self.tiles, self.mass, self.row_mass)
        return sum(t.numel() * t.element_size() for t in ts)

    def row_of_tile(self) -> torch.Tensor:
        """Query-block row index of every kept tile [nnz]."""
        counts = self.crow[1:] - self.crow[:-1]
        return torch.repeat_interleave(torch.arange(self.num_row_blocks), counts.long())

    def coords(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query block, key block, head) of every kept tile."""
        col = self.col.long()
        return self.row_of_tile(), col // self.heads, col % self.heads

    def to_dense(self, dtype: torch.dtype = torch.float32, renormalise: bool = True) -> torch.Tensor:
        """[H, T, T] dense map (tests and diagnosis on short contexts only)."""
        t, b, h = self.tokens, self.block, self.heads
        nb = self.num_row_blocks
        dense = torch.zeros(h, nb, b, nb, b, dtype=dtype)
        qb, kb, hd = self.coords()
        dense[hd, qb, :, kb, :] = self.tiles.to(dtype)
        dense = dense.view(h, nb * b, nb * b)[:, :t, :t]
        if renormalise:
            dense = dense / self.row_mass.to(dtype).clamp_min(1e-30)[:, :, None]
        return dense


def select_blocks(mass: torch.Tensor, top_p: float, total: float | None = None) -> torch.Tensor:
    """Boolean keep-mask [..., nkb]: the fewest blocks whose mass reaches top_p of the row's mass.

    `total` fixes the row mass (1.0 for a softmax row) so re-selecting an already compressed map,
    whose kept mass is below 1, gives exactly what compressing the full map at that p gives.
    """
    if top_p >= 1.0:
        return mass > 0
    order = mass.argsort(dim=-1, descending=True)
    sorted_mass = mass.gather(-1, order)
    before = sorted_mass.cumsum(-1) - sorted_mass
    total = mass.sum(-1, keepdim=True) if total is None else total
    keep_sorted = (before < top_p * total) & (sorted_mass > 0)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


class LayerCompressor:
    """Accumulates one layer's kept tiles, one query-block row at a time."""

    def __init__(self, heads: int, block: int, top_p: float, dtype: torch.dtype):
        self.heads, self.block, self.top_p, self.dtype = heads, block, top_p, dtype
        self.counts: list[int] = []
        self.cols: list[torch.Tensor] = []
        self.tiles: list[torch.Tensor] = []
        self.masses: list[torch.Tensor] = []
        self.row_mass: list[torch.Tensor] = []

    def add_block_row(self, i: int, probs: torch.Tensor) -> None:
        """probs [H, rows, S]: query rows i*B .. i*B+rows-1 of a prefill starting at position 0."""
        h, rows, s = probs.shape
        b = self.block
        nkb = i + 1  # causal: only key blocks 0..i can hold mass
        width = min(s, nkb * b)
        p = probs[:, :, :width].float()
        if width < nkb * b:
            p = torch.nn.functional.pad(p, (0, nkb * b - width))
        blocks = p.view(h, rows, nkb, b)
        mass = blocks.sum(dim=(1, 3)) / rows  # [H, nkb], mean row mass of each tile
        keep = select_blocks(mass, self.top_p)
        kb, hd = keep.t().nonzero(as_tuple=True)  # (key block, head) ascending = col ascending
        tiles = blocks.permute(2, 0, 1, 3)[kb, hd].to(self.dtype)  # [n, rows, B]
        if rows < b:
            tiles = torch.nn.functional.pad(tiles, (0, 0, 0, b - rows))
        kept = tiles.float().sum(-1)[:, :rows]  # mass of the stored (rounded) values, per row
        self.counts.append(int(kb.numel()))
        self.cols.append((kb * h + hd).to(torch.int32))
        self.tiles.append(tiles)
        self.masses.append(mass[hd, kb].float())
        self.row_mass.append(torch.zeros(h, rows).index_add_(0, hd, kept))

    def finish(self) -> BlockMaps:
        crow = torch.zeros(len(self.counts) + 1, dtype=torch.int32)
        crow[1:] = torch.tensor(self.counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        b = self.block
        return BlockMaps(
            crow=crow,
            col=torch.cat(self.cols) if self.cols else torch.zeros(0, dtype=torch.int32),
            tiles=torch.cat(self.tiles) if self.tiles else torch.zeros(0, b, b, dtype=self.dtype),
            mass=torch.cat(self.masses) if self.masses else torch.zeros(0),
            row_mass=torch.cat(self.row_mass, dim=1) if self.row_mass else torch.zeros(self.heads, 0),
            heads=self.heads,
            block=b,
        )


class MapCapture:
    """Plug `on_probs` into runner.Capture(on_probs=..., prob_chunk=block) during the sender's prefill.

    Each chunk of query rows is compressed as it arrives, so no layer's dense map is ever whole.
    """

    def __init__(
        self,
        heads: int,
        num_layers: int,
        *,
        top_p: float = 0.9,
        block: int = 64,
        layers: list[int] | None = None,
        dtype: torch.dtype = torch.float16,
        sender: str = "",
    ):
        if not 0.0 < top_p <= 1.0:
            raise MapsError(f"top_p must be in (0, 1], got {top_p}")
        if block < 1:
            raise MapsError(f"block size must be >= 1, got {block}")
        self.heads, self.block, self.top_p, self.dtype = heads, block, top_p, dtype
        self.num_layers = num_layers
        self.layers = sorted(set(range(num_layers) if layers is None else layers))
        self.sender = sender
        self._layers = {i: LayerCompressor(heads, block, top_p, dtype) for i in self.layers}
        self._next_row = dict.fromkeys(self.layers, 0)

    def on_probs(self, layer: int, row0: int, probs: torch.Tensor) -> None:
        comp = self._layers.get(layer)
        if comp is None:
            return
        if row0 != self._next_row[layer] or row0 % self.block:
            raise MapsError(
                f"layer {layer}: probability rows arrived at {row0}, expected {self._next_row[layer]}; "
                f"capture a fresh prefill with runner.Capture(prob_chunk=a multiple of {self.block})"
            )
        rows = probs.shape[1]
        for r in range(0, rows, self.block):
            chunk = probs[:, r : r + self.block]
            comp.add_block_row((row0 + r) // self.block, chunk)
        self._next_row[layer] = row0 + rows

    def result(self) -> tuple[dict[str, torch.Tensor], dict]:
        maps = {i: c.finish() for i, c in self._layers.items()}
        return maps_to_tensors(maps), maps_meta(maps, self.top_p, self.sender, self.num_layers, source="exact")


# ---- plain-tensor form (ContextState.maps / maps_meta) -------------------------------------------

_FIELDS = ("crow", "col", "tiles", "mass", "row_mass")


def maps_to_tensors(maps: dict[int, BlockMaps]) -> dict[str, torch.Tensor]:
    return {f"{layer}.{f}": getattr(bm, f) for layer, bm in maps.items() for f in _FIELDS}


def maps_meta(
    maps: dict[int, BlockMaps], top_p: float, sender: str, num_layers: int, source: str = "exact", **extra
) -> dict:
    """The state part's meta; `source` (SOURCES) tells a receiver whether the maps hold tiles."""
    if source not in SOURCES:
        raise MapsError(f"unknown map source {source!r}: use one of {', '.join(SOURCES)}")
    any_map = next(iter(maps.values()), None)
    kept = sum(bm.nnz for bm in maps.values())
    causal = sum(bm.causal_tiles() for bm in maps.values())
    return {
        "transport": "mapflow",
        "format": FORMAT,
        "block": any_map.block if any_map else 0,
        "top_p": top_p,
        "heads": any_map.heads if any_map else 0,
        "sender_layers": num_layers,
        "layers": sorted(maps),
        "tokens": any_map.tokens if any_map else 0,
        "dtype": str(any_map.tiles.dtype).removeprefix("torch.") if any_map else "",
        "sender": sender,
        "kept_tiles": kept,
        "density": kept / max(1, causal),
        "nbytes": sum(bm.nbytes() for bm in maps.values()),
        "source": source,
        **extra,
    }


def maps_from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict[int, BlockMaps]:
    if meta.get("transport") != "mapflow" or meta.get("format") != FORMAT:
        raise MapsError(
            f"state maps are not mapflow format {FORMAT} (meta says transport={meta.get('transport')!r}, "
            f"format={meta.get('format')!r}); capture them with ctxrelay.transports.mapflow.make_map_capture"
        )
    out = {}
    for layer in meta["layers"]:
        try:
            parts = {f: tensors[f"{layer}.{f}"] for f in _FIELDS}
        except KeyError as e:
            raise MapsError(f"state maps lack {e.args[0]!r}; the state is incomplete, capture it again") from None
        out[int(layer)] = BlockMaps(**parts, heads=int(meta["heads"]), block=int(meta["block"]))
    return out


# ---- re-selection at a lower p -------------------------------------------------------------------


def reselect(bm: BlockMaps, top_p: float) -> BlockMaps:
    """The map as if it had been captured at `top_p` (<= its own p): same rule, on the kept tiles.

    Exact when the map was captured at a higher p: top-p keeps a prefix of the mass-sorted blocks,
    and the prefix for a lower p is a prefix of that prefix.
    """
    if top_p >= 1.0 or bm.nnz == 0:
        return bm
    qb, kb, hd = bm.coords()
    nb, h = bm.num_row_blocks, bm.heads
    dense_mass = torch.zeros(nb, h, nb)
    dense_mass[qb, hd, kb] = bm.mass
    keep = select_blocks(dense_mass, top_p, total=1.0)[qb, hd, kb]  # rows of the full map sum to 1
    idx = keep.nonzero(as_tuple=True)[0]
    counts = torch.bincount(qb[idx], minlength=nb)
    crow = torch.zeros(nb + 1, dtype=torch.int32)
    crow[1:] = counts.cumsum(0).to(torch.int32)
    tiles = bm.tiles[idx]
    row_mass = torch.zeros(h, nb, bm.block)
    row_mass.index_put_((hd[idx], qb[idx]), tiles.float().sum(-1), accumulate=True)
    return BlockMaps(
        crow=crow,
        col=bm.col[idx],
        tiles=tiles,
        mass=bm.mass[idx],
        row_mass=row_mass.view(h, -1)[:, : bm.tokens],
        heads=h,
        block=bm.block,
    )
