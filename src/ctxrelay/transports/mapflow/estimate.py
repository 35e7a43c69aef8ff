"""Sampled-row map capture: the block pattern of the sender's attention at a fraction of its cost.

Guided (and hybrid) layers read only which key blocks each query block and head keeps, and the
mean row mass of each kept block (sparse.py). The exact capture gets those from every row's
probabilities, which forces eager attention on the sender. This capture leaves the sender on
fused SDPA and, from the same post-RoPE q and k (the runner's `on_qk` hook), computes exact
probabilities for `rows` strided query rows of each query block only (ending on the block's last
row, as FlexPrefill estimates a pattern from its last query block, but per block). The mean of
those rows' block masses estimates the block's mean row mass; the same top-p rule as the exact
capture then keeps blocks. Cost: about rows / block of the attention's causal QK^T product (chunks
of query blocks stop at their own last key), and no PV product.

With rows = block every row is sampled and the result equals the exact capture's pattern and
masses (a test checks it); the maps hold no tiles, so replace mode cannot read them.
"""

from __future__ import annotations

import torch

from ctxrelay.models.attention import AttnCall, positions_mask
from ctxrelay.transports.mapflow.sparse import BlockMaps, MapsError, _select, maps_meta, maps_to_tensors

SOURCE = "sampled"
MAX_SCORE_ELEMS = 1 << 23  # floats in one chunk's score slab (32 MB): memory flat in the context length
CHUNKS = 8  # at least this many chunks of query blocks per layer (see sampled_block_mass)


def sample_rows(length: int, rows: int) -> torch.Tensor:
    """Offsets of the rows sampled in a query block of `length` rows: min(rows, length) of them,
    evenly spaced, the last one the block's last row."""
    n = min(rows, length)
    return length - 1 - ((n - 1 - torch.arange(n)) * length) // n


def sampled_block_mass(c: AttnCall, block: int, rows: int) -> torch.Tensor:
    """[H, nqb, nkb] mean block mass of each query block's sampled rows (zero above the diagonal)."""
    if c.q_start != 0 or c.positions is not None or c.k.shape[2] != c.q.shape[2]:
        raise MapsError("the sampled map capture covers a prefill from position 0; capture a fresh prefill")
    h, t = c.q.shape[1], c.q.shape[2]
    nb, full = -(-t // block), t // block
    mass = torch.zeros(h, nb, nb)
    offsets = sample_rows(block, rows)
    # query blocks per chunk: bounded in memory, and at most 1/CHUNKS of them, so each chunk's product
    # stops at its last block's keys (causal) and little of the QK^T product falls on masked keys
    step = max(1, min(MAX_SCORE_ELEMS // (h * len(offsets) * t), -(-nb // CHUNKS)))
    for b0 in range(0, full, step):
        blocks = torch.arange(b0, min(full, b0 + step))
        mass[:, blocks] = _rows_mass(c, blocks[:, None] * block + offsets, nb, block)
    if full < nb:  # a partial last block samples among its own rows
        last = full * block + sample_rows(t - full * block, rows)
        mass[:, full] = _rows_mass(c, last[None, :], nb, block)[:, 0]
    return mass


def _rows_mass(c: AttnCall, picked: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """[H, n, nb]: exact probabilities of the picked query rows [n, r], summed per key block, mean over r."""
    _, h, _, d = c.q.shape
    hkv = c.k.shape[1]
    n, r = picked.shape
    idx = picked.reshape(-1)
    s = int(idx.max()) + 1  # causal: no picked row sees a key past the last of them
    k = c.k[0, :, :s].float()  # [Hkv, s, d]: the heads of a kv group share it without expanding
    q = c.q[0, :, idx].float().view(hkv, (h // hkv) * idx.numel(), d)
    scores = (q @ k.transpose(1, 2)).mul_(c.scale).view(h, idx.numel(), s)
    if c.softcap is not None:
        scores = torch.tanh(scores / c.softcap) * c.softcap
    scores.masked_fill_(~positions_mask(idx, s, c.window), float("-inf"))
    probs = torch.nn.functional.pad(torch.softmax(scores, dim=-1), (0, nb * block - s))
    return probs.view(h, n, r, nb, block).sum(-1).mean(2)


def pattern_maps(mass: torch.Tensor, top_p: float, block: int, tokens: int) -> BlockMaps:
    """A pattern-only BlockMaps from block masses [H, nqb, nkb]: top-p per (head, query block) row.

    row_mass holds the kept estimated mass of each row's block (what renormalising would divide by).
    """
    h, nb, _ = mass.shape
    keep = _select(mass, top_p)  # [H, nqb, nkb]
    qb, kb, hd = keep.permute(1, 2, 0).nonzero(as_tuple=True)  # row-major: col = kb*H + head ascending
    crow = torch.zeros(nb + 1, dtype=torch.int32)
    crow[1:] = torch.bincount(qb, minlength=nb).cumsum(0).to(torch.int32)
    kept = (mass * keep).sum(-1)  # [H, nqb]
    return BlockMaps(
        crow=crow,
        col=(kb * h + hd).to(torch.int32),
        tiles=torch.zeros(0, block, block, dtype=torch.float16),
        mass=mass[hd, qb, kb].float(),
        row_mass=kept.repeat_interleave(block, dim=1)[:, :tokens].contiguous(),
        heads=h,
        block=block,
    )


class SampledMapCapture:
    """Plug `on_qk` into runner.Capture(on_qk=..., qk_layers=...): pattern-only maps, attention stays fused."""

    def __init__(
        self,
        heads: int,
        num_layers: int,
        *,
        top_p: float = 0.9,
        block: int = 64,
        rows: int = 16,
        layers: list[int] | None = None,
        sender: str = "",
    ):
        if not 0.0 < top_p <= 1.0:
            raise MapsError(f"top_p must be in (0, 1], got {top_p}")
        if not 1 <= rows <= block:
            raise MapsError(f"sampled rows per query block must be in 1..{block} (the block size), got {rows}")
        self.heads, self.block, self.top_p, self.rows = heads, block, top_p, rows
        self.num_layers, self.sender = num_layers, sender
        self.layers = sorted(set(range(num_layers) if layers is None else layers))
        self._maps: dict[int, BlockMaps] = {}

    def on_qk(self, c: AttnCall) -> None:
        if c.layer not in self.layers:
            return
        if c.q.shape[1] != self.heads:
            raise MapsError(f"layer {c.layer} has {c.q.shape[1]} query heads, the capture was built for {self.heads}")
        mass = sampled_block_mass(c, self.block, self.rows)
        self._maps[c.layer] = pattern_maps(mass, self.top_p, self.block, c.q.shape[2])

    def result(self) -> tuple[dict[str, torch.Tensor], dict]:
        missing = [i for i in self.layers if i not in self._maps]
        if missing:
            raise MapsError(f"the sampled capture saw no queries of layers {missing}: run the prefill with it first")
        meta = maps_meta(self._maps, self.top_p, self.sender, self.num_layers, source=SOURCE, sample_rows=self.rows)
        return maps_to_tensors(self._maps), meta
