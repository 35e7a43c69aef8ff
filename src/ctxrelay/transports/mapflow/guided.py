"""Map-guided sparse attention: the receiver's own softmax(QK^T), only inside chosen key blocks.

The sender's compressed map supplies the sparsity pattern, so the receiver's attention stays its
own (no head mixing) and it searches for no pattern itself. A pattern is a list of key blocks per
(unit, query block), where a unit is one receiver head or one kv group (all query heads that
share a key head: they then share one gathered K/V slab and one larger matmul). The diagonal
block (local context) and block 0 (the attention sink) are always kept.

Patterns come from:
  - `guided_pattern`: the W-mixed block masses of the sender layer's kept tiles, top-p per row;
  - `flex_pattern`: the receiver's own last query block (a FlexPrefill-style baseline);
  - `full_pattern`: every causal block (exactness checks: must reproduce native attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ctxrelay.models.attention import AttnCall, attention_logits, expand_kv, visibility_mask
from ctxrelay.timing import Stopwatch
from ctxrelay.transports.mapflow.sparse import BlockMaps, _select

Unit = Literal["head", "group"]


@dataclass
class BlockPattern:
    crow: torch.Tensor  # [units * nqb + 1], row = unit * nqb + query block
    kb: torch.Tensor  # [nnz] key blocks, ascending within a row (the diagonal block last)
    units: int
    heads_per_unit: int  # 1 (unit = receiver head) or Hr / Hkv (unit = kv group)
    num_row_blocks: int
    block: int

    @property
    def nnz(self) -> int:
        return int(self.kb.shape[0])

    def density(self) -> float:
        """Computed tiles per query head / causal tiles."""
        n = self.num_row_blocks
        return self.nnz / max(1, self.units * n * (n + 1) // 2)

    def counts(self) -> torch.Tensor:
        return (self.crow[1:] - self.crow[:-1]).long()

    def to_mask(self) -> torch.Tensor:
        """[units, nqb, nkb] bool."""
        nb = self.num_row_blocks
        keep = torch.zeros(self.units * nb, nb, dtype=torch.bool)
        keep[torch.repeat_interleave(torch.arange(self.units * nb), self.counts()), self.kb] = True
        return keep.view(self.units, nb, nb)

    def union(self, other: BlockPattern) -> BlockPattern:
        if (self.units, self.heads_per_unit, self.num_row_blocks) != (
            other.units,
            other.heads_per_unit,
            other.num_row_blocks,
        ):
            raise ValueError("patterns over different units or lengths cannot be merged")
        return pattern_from_mask(self.to_mask() | other.to_mask(), self.heads_per_unit, self.block)


def pattern_from_mask(keep: torch.Tensor, heads_per_unit: int, block: int, local: int = 0) -> BlockPattern:
    """keep [units, nqb, nkb] bool -> BlockPattern, adding the causal diagonal, the sink block and the
    `local` blocks before the diagonal (a query early in its block has its recent context there)."""
    units, nqb, nkb = keep.shape
    keep = keep.clone()
    idx = torch.arange(nqb)
    for back in range(local + 1):
        keep[:, idx[back:], idx[: nqb - back]] = True
    keep[:, :, 0] = True
    keep &= torch.ones(nqb, nkb, dtype=torch.bool).tril()  # causal: key block <= query block
    flat = keep.reshape(units * nqb, nkb)
    counts = flat.sum(1)
    crow = torch.zeros(units * nqb + 1, dtype=torch.int64)
    crow[1:] = counts.cumsum(0)
    kb = flat.nonzero(as_tuple=True)[1]  # row-major: ascending key blocks per row
    return BlockPattern(crow, kb, units, heads_per_unit, nqb, block)


def full_pattern(tokens: int, num_heads: int, block: int) -> BlockPattern:
    nb = -(-tokens // block)
    return pattern_from_mask(torch.ones(num_heads, nb, nb, dtype=torch.bool), 1, block)


def sender_block_mass(bm: BlockMaps, top_p: float = 1.0) -> torch.Tensor:
    """Dense [Hs, nqb, nkb] mean row mass of the kept tiles (zero where a tile was dropped).

    top_p < 1 applies the compression rule again on the kept masses: the pattern of the map as if
    captured at that p, without touching its tiles (guided mode never reads tile values).
    """
    qb, kb, hd = bm.coords()
    nb = bm.num_row_blocks
    mass = torch.zeros(bm.heads, nb, nb)
    mass[hd, qb, kb] = bm.mass.float()
    return mass if top_p >= 1.0 else mass * _select(mass, top_p, total=1.0)


def guided_pattern(
    bm: BlockMaps,
    w: torch.Tensor,
    guided_p: float,
    kv_heads: int,
    unit: Unit = "group",
    top_p: float = 1.0,
    local: int = 0,
) -> BlockPattern:
    """Key blocks per receiver head (or kv group) from the W-mixed sender block masses, top-p per row.

    guided_p = 1 keeps the union of the kept tiles of every sender head W mixes in; `top_p` first
    re-selects the sender map itself (as `sparse.reselect` would).
    """
    mixed = torch.einsum("kh,kqn->hqn", w.float(), sender_block_mass(bm, top_p))  # [Hr, nqb, nkb]
    hr = mixed.shape[0]
    if unit == "group":
        per = hr // kv_heads
        mixed = mixed.view(kv_heads, per, *mixed.shape[1:]).mean(1)
        return pattern_from_mask(_select(mixed, guided_p), per, bm.block, local)
    return pattern_from_mask(_select(mixed, guided_p), 1, bm.block, local)


def flex_pattern(c: AttnCall, block: int, top_p: float, unit: Unit = "group", local: int = 0) -> BlockPattern:
    """FlexPrefill-style: key blocks chosen by the receiver's own last query block, top-p per unit."""
    hr, t = c.q.shape[1], c.q.shape[2]
    nb = -(-t // block)
    rows = slice(max(0, t - block), t)
    probs = torch.softmax(attention_logits(c, rows), dim=-1)  # [Hr, rows, S]
    pad = nb * block - probs.shape[-1]
    mass = torch.nn.functional.pad(probs, (0, pad)).view(hr, probs.shape[1], nb, block).sum((1, 3))
    hkv = c.k.shape[1]
    per = hr // hkv if unit == "group" else 1
    if unit == "group":
        mass = mass.view(hkv, per, nb).mean(1)
    keep = _select(mass, top_p)[:, None, :].expand(-1, nb, -1)
    return pattern_from_mask(keep, per, block, local)


def _blocks(x: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """[H, T, d] -> [H, nb, B, d], zero-padded past T."""
    h, t, d = x.shape
    if nb * block > t:
        x = torch.nn.functional.pad(x, (0, 0, 0, nb * block - t))
    return x.view(h, nb, block, d)


def guided_attention(
    c: AttnCall, pat: BlockPattern, max_elems: int = 1 << 20, sw: Stopwatch | None = None
) -> torch.Tensor:
    """Softmax attention restricted to the pattern's key blocks, for a prefill from position 0.

    Rows (unit, query block) with the same number of kept blocks form one batched call (split so
    no score slab exceeds `max_elems` floats: peak memory stays flat in the context length).
    `sw` (optional) receives the time of each step: gather_s, attend_s, scatter_s.
    """
    _, hr, t, d = c.q.shape
    if c.q_start != 0 or c.k.shape[2] != t:
        raise ValueError("guided attention covers a prefill from position 0 (no cached prefix)")
    sw = sw or Stopwatch()
    nb, b, per = pat.num_row_blocks, pat.block, pat.heads_per_unit
    with sw("gather_s"):
        qb_ = _blocks(c.q[0], nb, b)  # [Hr, nb, B, d]
        kb_ = _blocks(c.k[0], nb, b)  # [Hkv, nb, B, d]
        vb_ = _blocks(c.v[0], nb, b)
    counts = pat.counts()
    starts = pat.crow[:-1].long()
    out_parts, out_rows = [], []
    for cnt in torch.unique(counts).tolist():
        same = (counts == cnt).nonzero(as_tuple=True)[0]
        step = max(1, max_elems // (per * b * cnt * b))  # bound the score slab of one batched call
        for rows in same.split(step):
            out_parts.append(_rows_attention(c, qb_, kb_, vb_, pat, starts, rows, cnt, sw))
            out_rows.append(rows)
    with sw("scatter_s"):  # rows back to [Hr, nb, B, d]
        out = torch.zeros(hr // per, nb, per, b, d, dtype=c.q.dtype)
        rows = torch.cat(out_rows)
        out = out.view(-1, per, b, d).index_copy(0, rows, torch.cat(out_parts))
        out = out.view(hr // per, nb, per, b, d).permute(0, 2, 1, 3, 4).reshape(hr, nb * b, d)[:, :t]
    return out.unsqueeze(0)


def _rows_attention(c: AttnCall, qb_, kb_, vb_, pat: BlockPattern, starts, rows, cnt: int, sw: Stopwatch):
    """Attention of pattern rows that all keep `cnt` key blocks: one batched matmul each way.

    (Torch's fused CPU attention per bucket, tried in place of the explicit softmax, measured no faster
    on real patterns: buckets hold a few rows each. bench mapflow-capture, phase operators.)"""
    nb, b, per = pat.num_row_blocks, pat.block, pat.heads_per_unit
    n, d, hkv = len(rows), qb_.shape[-1], kb_.shape[0]
    group = qb_.shape[0] // hkv
    with sw("gather_s"):
        unit, qi = rows // nb, rows % nb
        kbs = pat.kb[starts[rows][:, None] + torch.arange(cnt)[None, :]]  # [R, c], diagonal block last
        if per == 1:
            q, g = qb_[unit, qi], unit // group  # [R, B, d]
        else:
            q, g = qb_.view(hkv, per, nb, b, d)[unit, :, qi].reshape(n, per * b, d), unit
        k = kb_[g[:, None], kbs].reshape(n, cnt * b, d)
        v = vb_[g[:, None], kbs].reshape(n, cnt * b, d)
    with sw("attend_s"):
        s = torch.bmm(q, k.transpose(1, 2)).mul_(c.scale)  # [R, per*B, c*B]
        if c.softcap is not None:
            s = torch.tanh(s / c.softcap) * c.softcap
        s = s.view(n, per, b, cnt * b)
        if c.window is None:  # only the diagonal tile (last) needs the causal mask
            s[..., (cnt - 1) * b :] += torch.full((b, b), float("-inf"), dtype=s.dtype).triu(1)
        else:  # token-level visibility (sliding window) over every kept tile
            qpos = qi[:, None] * b + torch.arange(b)[None, :]  # [R, B]
            kpos = (kbs[:, :, None] * b + torch.arange(b)).view(n, 1, -1)  # [R, 1, c*B]
            vis = (kpos <= qpos[:, :, None]) & (kpos > qpos[:, :, None] - c.window)
            s = s.masked_fill(~vis[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)  # every query sees at least itself: the diagonal block is always kept
        return torch.bmm(p.view(n, per * b, cnt * b), v).view(n, per, b, d)


def pattern_attention_dense(c: AttnCall, pat: BlockPattern) -> torch.Tensor:
    """Reference: dense masked softmax with the pattern expanded to a token mask (tests, short T)."""
    _, hr, t, d = c.q.shape
    nb, b, per = pat.num_row_blocks, pat.block, pat.heads_per_unit
    keep = torch.zeros(pat.units * nb, nb, dtype=torch.bool)
    keep[torch.repeat_interleave(torch.arange(pat.units * nb), pat.counts()), pat.kb] = True
    keep = keep.view(pat.units, nb, nb).repeat_interleave(per, 0)
    tok = keep.repeat_interleave(b, 1).repeat_interleave(b, 2)[:, :t, :t]
    logits = attention_logits(c).masked_fill(~tok, float("-inf"))
    logits = logits.masked_fill(~visibility_mask(0, t, t, c.window), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return (probs @ expand_kv(c.v, hr)[0]).unsqueeze(0)
