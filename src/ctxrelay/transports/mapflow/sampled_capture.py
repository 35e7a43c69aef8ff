"""Sampled-row map capture: the block pattern of the sender's attention at a fraction of its cost.

Guided (and hybrid) layers read only which key blocks each query block and head keeps, and the
mean row mass of each kept block (sparse.py). The exact capture gets those from every row's
probabilities, which forces eager attention on the sender. This capture leaves the sender on
fused SDPA and, from the same post-RoPE q and k (the runner's `on_qk` hook), computes exact
probabilities for `rows` strided query rows of each query block only (ending on the block's last
row, as FlexPrefill estimates a pattern from its last query block, but per block). The mean of
those rows' block masses estimates the block's mean row mass; the same top-p rule as the exact
capture then keeps blocks. Cost: about rows / block of the attention's causal QK^T product (each
query block's product stops at its own last row's key), and no PV product.

With rows = block every row is sampled and the result equals the exact capture's pattern and
masses (a test checks it); the maps hold no tiles, so replace mode cannot read them.
"""

from __future__ import annotations

import torch

from ctxrelay.models.attention import AttnCall, positions_mask
from ctxrelay.transports.mapflow.sparse import BlockMaps, MapsError, maps_meta, maps_to_tensors, select_blocks

SOURCE = "sampled"


def sample_rows(length: int, rows: int) -> torch.Tensor:
    """Offsets of the rows sampled in a query block of `length` rows: min(rows, length) of them,
    evenly spaced, the last one the block's last row."""
    n = min(rows, length)
    return length - 1 - ((n - 1 - torch.arange(n)) * length) // n


def sampled_block_mass(c: AttnCall, block: int, rows: int) -> torch.Tensor:
    """[H, nqb, nkb] mean block mass of each query block's sampled rows (zero above the diagonal).

    One query block at a time, over only the keys its rows can see: the score slab (heads x rows x
    keys, a few MB) stays in cache, and no product or pass falls on masked keys. The first version
    scored chunks of 8 blocks against their last block's keys and padded to the full width; its
    masking, padding, softmax and copies took 4/5 of the hook's time and its products 1/5."""
    if c.q_start != 0 or c.positions is not None or c.k.shape[2] != c.q.shape[2]:
        raise MapsError("the sampled map capture covers a prefill from position 0; capture a fresh prefill")
    h, t = c.q.shape[1], c.q.shape[2]
    nb = -(-t // block)
    mass = torch.zeros(h, nb, nb)
    k = c.k[0].float()  # [Hkv, t, d]: the heads of a kv group share it without expanding
    for b in range(nb):
        first = b * block
        picked = first + sample_rows(min(block, t - first), rows)
        lo = 0 if c.window is None else max(0, int(picked[0]) - c.window + 1) // block * block
        rows_mass = _rows_mass(c, k, picked, lo, block)
        mass[:, b, lo // block : lo // block + rows_mass.shape[1]] = rows_mass
    return mass


def _rows_mass(c: AttnCall, k: torch.Tensor, picked: torch.Tensor, lo: int, block: int) -> torch.Tensor:
    """[H, nkb]: exact probabilities of one query block's picked rows over keys lo.. (a block
    boundary), summed per key block, mean over the rows. Softmax as exp(score - row max) summed per
    block, then divided by the row's total: one pass fewer than normalising every probability."""
    h, d = c.q.shape[1], c.q.shape[3]
    hkv = k.shape[0]
    r = picked.numel()
    s = int(picked[-1]) + 1  # causal: the block's last row sees the most keys
    first = int(picked[0])
    q = (c.q[0, :, picked].float() * c.scale).reshape(hkv, (h // hkv) * r, d)
    scores = torch.matmul(q, k[:, lo:s].transpose(1, 2)).view(h, r, s - lo)
    if c.softcap is not None:
        scores = torch.tanh(scores / c.softcap) * c.softcap
    edge = lo if c.window is not None else first  # left of `first`, causal hides nothing
    scores[..., edge - lo :].masked_fill_(~positions_mask(picked, s, c.window, edge), float("-inf"))
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    if (s - lo) % block:  # a partial last block: zeros after it
        scores = torch.nn.functional.pad(scores, (0, block - (s - lo) % block))
    sums = scores.view(h, r, -1, block).sum(-1)  # [H, r, nkb]
    return (sums / sums.sum(-1, keepdim=True)).mean(1)


def pattern_maps(mass: torch.Tensor, top_p: float, block: int, tokens: int) -> BlockMaps:
    """A pattern-only BlockMaps from block masses [H, nqb, nkb]: top-p per (head, query block) row.

    row_mass holds the kept estimated mass of each row's block (what renormalising would divide by).
    """
    h, nb, _ = mass.shape
    keep = select_blocks(mass, top_p)  # [H, nqb, nkb]
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
