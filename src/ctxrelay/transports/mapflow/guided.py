"""Map-guided sparse attention: the receiver's own softmax(QK^T), only inside chosen key blocks.

The sender's compressed map supplies the sparsity pattern, so the receiver's attention stays its
own (no head mixing) and it searches for no pattern itself. A pattern is a list of key blocks per
(unit, query block), where a unit is one receiver head or one kv group (all query heads that
share a key head: they then share one gathered K/V slab and one larger matmul). The diagonal
block (local context) and block 0 (the attention sink) are always kept.

Patterns come from:
  - `guided_pattern`: the W-mixed block masses of the sender layer's kept tiles, top-p per row, or
    top-p over all of a unit's tiles at once ("global": the fewest tiles that keep p of the unit's
    whole mass; rows whose mass is spread thin give up blocks to rows where few blocks hold most of
    it: more of the receiver's mass per computed tile, yet lower top-1 at equal density, measured at
    4096 tokens, so edges select per row);
  - `flex_pattern`: the receiver's own last query block (a FlexPrefill-style baseline);
  - `full_pattern`: every causal block (exactness checks: must reproduce native attention).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Literal

import torch

from ctxrelay.models.attention import AttnCall, attention_logits, expand_kv, visibility_mask
from ctxrelay.timing import Stopwatch
from ctxrelay.transports.mapflow.sparse import BlockMaps, select_blocks

Unit = Literal["head", "group"]
Select = Literal["row", "global"]
SELECTS = ("row", "global")


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
    return mass if top_p >= 1.0 else mass * select_blocks(mass, top_p, total=1.0)


def guided_pattern(
    bm: BlockMaps,
    w: torch.Tensor,
    guided_p: float,
    kv_heads: int,
    unit: Unit = "group",
    top_p: float = 1.0,
    local: int = 0,
    select: Select = "row",
) -> BlockPattern:
    """Key blocks per receiver head (or kv group) from the W-mixed sender block masses, top-p per row
    (`select="row"`) or over each unit's tiles together (`select="global"`).

    guided_p = 1 keeps the union of the kept tiles of every sender head W mixes in; `top_p` first
    re-selects the sender map itself (as `sparse.reselect` would).
    """
    if select not in SELECTS:
        raise ValueError(f"unknown guided selection {select!r}: use one of {', '.join(SELECTS)}")
    mixed = torch.einsum("kh,kqn->hqn", w.float(), sender_block_mass(bm, top_p))  # [Hr, nqb, nkb]
    hr = mixed.shape[0]
    per = hr // kv_heads if unit == "group" else 1
    if unit == "group":
        mixed = mixed.view(kv_heads, per, *mixed.shape[1:]).mean(1)
    if select == "global":
        keep = select_blocks(mixed.reshape(mixed.shape[0], -1), guided_p).view_as(mixed)
    else:
        keep = select_blocks(mixed, guided_p)
    return pattern_from_mask(keep, per, bm.block, local)


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
    keep = select_blocks(mass, top_p)[:, None, :].expand(-1, nb, -1)
    return pattern_from_mask(keep, per, block, local)


_WORKSPACE = threading.local()  # per-thread scratch reused across layers and calls (see _scratch)


def _scratch(name: str, numel: int) -> torch.Tensor:
    """A float32 buffer of `numel` elements kept for this thread and grown as needed.

    Fresh tensors of tens of MB are fresh pages: on this CPU first-touching them cost ~7% of the
    guided operator. A thread keeps at most a few context-sized buffers (~3 x heads x T x d floats).
    """
    bufs = getattr(_WORKSPACE, "bufs", None)
    if bufs is None:
        bufs = _WORKSPACE.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: usable inside and outside inference mode
            buf = bufs[name] = torch.empty(numel)
    return buf[:numel]


def _kv_blocks(name: str, x: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """[H, T, d] -> [H * nb, B, d] in scratch, zero past T (one copy, no full fill)."""
    h, t, d = x.shape
    out = _scratch(name, h * nb * block * d).view(h, nb * block, d)
    out[:, :t] = x
    out[:, t:] = 0
    return out.view(h * nb, block, d)


def _unit_rows(q: torch.Tensor, units: int, nb: int, block: int, scale: float) -> torch.Tensor:
    """[Hr, T, d] -> scale * q as [units * nb, heads_per_unit * B, d]: one row per (unit, query block)."""
    hr, t, d = q.shape
    per, full = hr // units, t // block
    out = _scratch("q_rows", hr * nb * block * d).view(units, nb, per, block, d)
    q4 = q.view(units, per, t, d)
    blocks = q4[:, :, : full * block].reshape(units, per, full, block, d).permute(0, 2, 1, 3, 4)
    torch.mul(blocks, scale, out=out[:, :full])
    if full < nb:  # the last, partial query block: zero rows past T
        rem = t - full * block
        torch.mul(q4[:, :, full * block :], scale, out=out[:, full, :, :rem])
        out[:, full, :, rem:] = 0
    return out.view(units * nb, per * block, d)


def guided_attention(
    c: AttnCall, pat: BlockPattern, max_elems: int = 1 << 21, sw: Stopwatch | None = None
) -> torch.Tensor:
    """Softmax attention restricted to the pattern's key blocks, for a prefill from position 0.

    Rows (unit, query block) are sorted by their number of kept blocks, so each count is one run of
    contiguous rows: one batched QK^T, an in-place softmax and one batched PV written straight into
    its slice of the output (split so no score slab exceeds `max_elems` floats: memory stays flat in
    the context length). q is scaled once, before the products. The result is laid out [T, Hr, d]
    (as the layer's output projection reads it) and returned as the [1, Hr, T, d] view SDPA gives.
    `sw` (optional) receives the time of each step: gather_s, attend_s, scatter_s.
    """
    _, hr, t, d = c.q.shape
    if c.q_start != 0 or c.k.shape[2] != t:
        raise ValueError("guided attention covers a prefill from position 0 (no cached prefix)")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (c.q, c.k, c.v)):
        raise ValueError("guided attention is inference-only (it writes into scratch); train W in replace mode")
    sw = sw or Stopwatch()
    nb, b, per = pat.num_row_blocks, pat.block, pat.heads_per_unit
    units, hkv = hr // per, c.k.shape[1]
    counts, starts = pat.counts(), pat.crow[:-1].long()
    order = torch.argsort(counts, stable=True)
    run_counts, run_lengths = torch.unique_consecutive(counts[order], return_counts=True)
    with sw("gather_s"):
        rows_all = _unit_rows(c.q[0].to(torch.float32), units, nb, b, c.scale)
        q_sorted = _scratch("q_sorted", rows_all.numel()).view_as(rows_all)
        torch.index_select(rows_all, 0, order, out=q_sorted)
        k_blocks = _kv_blocks("k_blocks", c.k[0], nb, b)
        v_blocks = _kv_blocks("v_blocks", c.v[0], nb, b)
    kv_of_unit = torch.arange(units) * per // (hr // hkv)
    out_sorted = _scratch("out_sorted", rows_all.numel()).view_as(rows_all)
    scores = _scratch("scores", max(max_elems, per * b * b * int(run_counts[-1])))  # >= one row of the longest run
    slabs = _CallSlabs(starts, kv_of_unit, k_blocks, v_blocks, scores)
    first = 0
    for cnt, length in zip(run_counts.tolist(), run_lengths.tolist(), strict=True):
        step = max(1, max_elems // (per * b * cnt * b))
        for a in range(first, first + length, step):
            z = min(first + length, a + step)
            _run_attention(c, pat, slabs, order[a:z], cnt, q_sorted[a:z], out_sorted[a:z], sw)
        first += length
    with sw("scatter_s"):  # unsort the rows, then lay them out [T, Hr, d]
        unsorted = _scratch("q_rows", rows_all.numel()).view_as(rows_all)  # q_rows is free again
        torch.index_select(out_sorted, 0, torch.argsort(order), out=unsorted)
        res = torch.empty(nb * b, hr, d, dtype=torch.float32)
        res.view(nb, b, units, per, d).copy_(unsorted.view(units, nb, per, b, d).permute(1, 3, 0, 2, 4))
    return res[:t].to(c.q.dtype).unsqueeze(0).transpose(1, 2)


@dataclass
class _CallSlabs:
    """What every run of one guided_attention call reads: row starts in pat.kb, the kv head of each
    unit, K/V as [Hkv * nb, B, d] blocks, and the score scratch."""

    starts: torch.Tensor
    kv_of_unit: torch.Tensor
    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    scores: torch.Tensor


def _run_attention(
    c: AttnCall,
    pat: BlockPattern,
    slabs: _CallSlabs,
    rows: torch.Tensor,
    cnt: int,
    q: torch.Tensor,
    out: torch.Tensor,
    sw: Stopwatch,
) -> None:
    """Attention of pattern rows that all keep `cnt` key blocks, into `out` [R, per*B, d].

    (Torch's fused CPU attention per run, tried in place of the explicit softmax, measured no faster:
    runs hold a few rows each. bench mapflow-capture, phase operators.)"""
    n, nb, b, per, d = len(rows), pat.num_row_blocks, pat.block, pat.heads_per_unit, q.shape[-1]
    with sw("gather_s"):
        kbs = pat.kb[slabs.starts[rows][:, None] + torch.arange(cnt)[None, :]]  # [R, c], diagonal block last
        flat = (slabs.kv_of_unit[rows // nb][:, None] * nb + kbs).reshape(-1)
        k_out, v_out = (_scratch(name, flat.numel() * b * d).view(-1, b, d) for name in ("k_rows", "v_rows"))
        k = torch.index_select(slabs.k_blocks, 0, flat, out=k_out)
        v = torch.index_select(slabs.v_blocks, 0, flat, out=v_out)
    with sw("attend_s"):
        s = slabs.scores[: n * per * b * cnt * b].view(n, per * b, cnt * b)
        torch.bmm(q, k.view(n, cnt * b, d).transpose(1, 2), out=s)  # q is already scaled
        if c.softcap is not None:
            s.div_(c.softcap).tanh_().mul_(c.softcap)
        s4 = s.view(n, per, b, cnt * b)
        if c.window is None:  # only the diagonal tile (last) needs the causal mask
            s4[..., (cnt - 1) * b :] += _causal_bias(b)
        else:  # token-level visibility (sliding window) over every kept tile
            qpos = (rows % nb)[:, None] * b + torch.arange(b)[None, :]  # [R, B]
            kpos = (kbs[:, :, None] * b + torch.arange(b)).view(n, 1, -1)  # [R, 1, c*B]
            vis = (kpos <= qpos[:, :, None]) & (kpos > qpos[:, :, None] - c.window)
            s4.masked_fill_(~vis[:, None], float("-inf"))
        # in place (the kernel reads each row before writing it): every query sees itself, so no row is all -inf
        torch.ops.aten._softmax.out(s, -1, False, out=s)
        torch.bmm(s, v.view(n, cnt * b, d), out=out)


@functools.cache
def _causal_bias(block: int) -> torch.Tensor:
    return torch.full((block, block), float("-inf")).triu(1)


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
