"""Replace mode: the fused mix-and-apply operator O_h = (sum_k W[k,h] A^S_k) V^R_h, on CPU in torch.

The mixture sum_k W[k,h] A^S_k is dense across heads even when every A^S_k is sparse (the union of
12 sender heads' kept blocks covers about half the causal map), so it is never formed. Because
W is linear and a receiver head h only reads its kv group's values V_g(h), the product factors:

    O_h = sum_k W[k,h] (A^S_k V_g(h))  and  A^S_k [V_0 | V_1 | ...]  is one sparse product per sender head.

So the operator runs one block-sparse x dense product per sender head against the receiver's values
of all kv groups side by side ([T, Hkv*d]), renormalises rows by the kept mass, and mixes the
Hs small [T, d] results per receiver head. Cost follows the sender heads' own sparsity, not the
mixture's, and no dense T x T map (receiver or sender) is ever materialised.

`ReplacePlan` regroups the stored tiles head-major as a torch BSR matrix [Hs*T, T] (the stored
layout is key-block-major, col = kb*Hs + head, which suits the fused GPU kernel); building it is
the copy step of the relay. `replace_attention_padded` is the autograd-friendly twin used for
training W (torch's BSR product has no backward on CPU).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ctxrelay.transports.mapflow.sparse import BlockMaps


@dataclass
class ReplacePlan:
    bsr: torch.Tensor  # sparse BSR [Hs * Tp, Tp], rows (sender head, query), cols keys
    inv_row_mass: torch.Tensor  # [Hs, T, 1]
    heads: int
    block: int
    tokens: int

    def nbytes(self) -> int:
        vals = self.bsr.values()
        return vals.numel() * vals.element_size() + self.inv_row_mass.numel() * 4


def _head_major_order(bm: BlockMaps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permutation of tiles sorting them by (head, query block, key block); also the sorted coords."""
    qb, kb, hd = bm.coords()
    nb = bm.num_row_blocks
    key = (hd * nb + qb) * nb + kb
    order = torch.argsort(key)
    return order, hd[order], qb[order], kb[order]


def prepare_replace(bm: BlockMaps, dtype: torch.dtype = torch.float32) -> ReplacePlan:
    """Regroup one sender layer's tiles head-major and convert them to the compute dtype."""
    nb, b, hs, t = bm.num_row_blocks, bm.block, bm.heads, bm.tokens
    order, hd, qb, kb = _head_major_order(bm)
    counts = torch.bincount(hd * nb + qb, minlength=hs * nb)
    crow = torch.zeros(hs * nb + 1, dtype=torch.int64)
    crow[1:] = counts.cumsum(0)
    tiles = bm.tiles.index_select(0, order).to(dtype)
    with warnings.catch_warnings():  # "BSR support is in beta": we only use construction and @ dense
        warnings.simplefilter("ignore", UserWarning)
        bsr = torch.sparse_bsr_tensor(crow, kb, tiles, size=(hs * nb * b, nb * b), check_invariants=False)
    inv = (1.0 / bm.row_mass.float().clamp_min(1e-30)).to(dtype).unsqueeze(-1)
    return ReplacePlan(bsr, inv, hs, b, t)


def _values_side_by_side(v: torch.Tensor, padded_len: int) -> torch.Tensor:
    """[1, Hkv, T, d] -> [Tp, Hkv*d] (zero rows past T)."""
    _, hkv, t, d = v.shape
    vcat = v[0].permute(1, 0, 2).reshape(t, hkv * d)
    if padded_len > t:
        vcat = torch.nn.functional.pad(vcat, (0, 0, 0, padded_len - t))
    return vcat


def mix_heads(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [Hs, T, Hkv, d] (sender head k applied to each kv group's values), w [Hs, Hr] -> [1, Hr, T, d].

    Receiver head h reads kv group h // (Hr / Hkv), as grouped-query attention does.
    """
    hs, t, hkv, d = y.shape
    hr = w.shape[1]
    per = hr // hkv
    outs = [torch.einsum("kh,ktd->htd", w[:, g * per : (g + 1) * per].to(y.dtype), y[:, :, g]) for g in range(hkv)]
    return torch.cat(outs, dim=0).unsqueeze(0)


def replace_attention(plan: ReplacePlan, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Receiver attention output [1, Hr, T, d] from the sender's map, W [Hs, Hr] and the receiver's V."""
    _, hkv, t, d = v.shape
    if t != plan.tokens:
        raise ValueError(f"map covers {plan.tokens} tokens but the receiver's values cover {t}")
    tp = plan.bsr.shape[1]
    vcat = _values_side_by_side(v.to(plan.inv_row_mass.dtype), tp)
    y = (plan.bsr @ vcat).view(plan.heads, tp, hkv * d)[:, :t] * plan.inv_row_mass
    return mix_heads(y.view(plan.heads, t, hkv, d), w).to(v.dtype)


# ---- autograd-friendly variant (training) -------------------------------------------------------


@dataclass
class PaddedPlan:
    """Tiles grouped by output row (sender head, query block), bucketed by how many tiles a row has.

    Each bucket holds rows with exactly `c` tiles: a [R, B, c*B] slab of the map and the key blocks
    [R, c] it multiplies, so one batched matmul covers the bucket and no padding is wasted.
    """

    buckets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (row ids, key blocks, slab)
    inv_row_mass: torch.Tensor  # [Hs, T, 1]
    heads: int
    block: int
    tokens: int
    num_row_blocks: int


def prepare_padded(bm: BlockMaps, dtype: torch.dtype = torch.float32) -> PaddedPlan:
    nb, b = bm.num_row_blocks, bm.block
    order, hd, qb, kb = _head_major_order(bm)
    rows = hd * nb + qb
    counts = torch.bincount(rows, minlength=bm.heads * nb)
    starts = counts.cumsum(0) - counts
    tiles = bm.tiles.index_select(0, order).to(dtype)
    buckets = []
    for c in torch.unique(counts).tolist():
        if c == 0:
            continue
        row_ids = (counts == c).nonzero(as_tuple=True)[0]
        idx = starts[row_ids][:, None] + torch.arange(c)[None, :]  # [R, c] positions in sorted order
        slab = tiles[idx].permute(0, 2, 1, 3).reshape(len(row_ids), b, c * b)
        buckets.append((row_ids, kb[idx], slab))
    inv = (1.0 / bm.row_mass.float().clamp_min(1e-30)).to(dtype).unsqueeze(-1)
    return PaddedPlan(buckets, inv, bm.heads, b, bm.tokens, nb)


def replace_attention_padded(plan: PaddedPlan, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Same result as `replace_attention`; differentiable in W and V."""
    _, hkv, t, d = v.shape
    nb, b = plan.num_row_blocks, plan.block
    vcat = _values_side_by_side(v.to(plan.inv_row_mass.dtype), nb * b).view(nb, b, hkv * d)
    parts, ids = [], []
    for row_ids, kbs, slab in plan.buckets:
        gathered = vcat[kbs].reshape(len(row_ids), -1, hkv * d)  # [R, c*B, Hkv*d]
        parts.append(torch.bmm(slab, gathered))
        ids.append(row_ids)
    y = torch.zeros(plan.heads * nb, b, hkv * d, dtype=vcat.dtype)
    y = y.index_copy(0, torch.cat(ids), torch.cat(parts)) if parts else y
    y = y.view(plan.heads, nb * b, hkv * d)[:, :t] * plan.inv_row_mass
    return mix_heads(y.view(plan.heads, t, hkv, d), w).to(v.dtype)


def replace_attention_dense(maps: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: materialise the mixed receiver map [Hr, T, T] and multiply (tests, short T only)."""
    hr = w.shape[1]
    mixed = torch.einsum("kh,kts->hts", w.to(maps.dtype), maps)
    vv = v[0].repeat_interleave(hr // v.shape[1], dim=0).to(maps.dtype)
    return (mixed @ vv).unsqueeze(0).to(v.dtype)
