"""Attention kernels the runner can plug into any layer.

An attention function takes an `AttnCall` (post-RoPE q, the layer's full k/v including the new
tokens, where the queries sit, and the family's masking facts) and returns [1, H, T, d].
Transports supply their own functions (map reuse, map-guided sparse) through the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnCall:
    layer: int
    q: torch.Tensor  # [1, H, T, d], post q-norm and RoPE
    k: torch.Tensor  # [1, Hkv, S, d], post k-norm and RoPE; S = q_start + T
    v: torch.Tensor  # [1, Hkv, S, d]
    q_start: int  # absolute position of the first query
    scale: float
    window: int | None  # sliding window (keys with q_pos - k_pos < window are visible)
    softcap: float | None
    positions: torch.Tensor | None = None  # [T] absolute query positions when not q_start.. in a row
    key_mask: torch.Tensor | None = None  # [S] or per query [T, S] bool: keys a query may see at all (None: all)

    @property
    def query_positions(self) -> torch.Tensor:
        if self.positions is not None:
            return self.positions
        return torch.arange(self.q_start, self.q_start + self.q.shape[2], device=self.q.device)


# query rows per SDPA call in sliding-window layers: each call sees rows + window - 1 keys
WINDOW_CHUNK = 256
# the fewest queries at the cache's end that causal_tail takes (two kernel calls; a decode step keeps one)
SPLIT_MIN_ROWS = 32
# SDPA's CPU flash kernel, which also returns each row's log-sum-exp (causal_tail merges two calls by it)
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

AttnFn = Callable[[AttnCall], torch.Tensor]
ProbsCallback = Callable[[int, int, torch.Tensor], None]  # (layer, first query row, probs [H, rows, S])
QKCallback = Callable[[AttnCall], None]  # a layer's attention inputs, seen before the attention runs


def positions_mask(qpos: torch.Tensor, s: int, window: int | None, k_start: int = 0) -> torch.Tensor:
    """Boolean [len(qpos), s - k_start]: True where the query at position qpos[i] may attend the key
    at k_start + j (causal by position, and inside the sliding window where the layer has one)."""
    q = qpos.view(-1, 1)
    kpos = torch.arange(k_start, s, device=qpos.device)[None, :]
    mask = kpos <= q
    if window is not None:
        mask &= kpos > q - window
    return mask


def visibility_mask(q_start: int, t: int, s: int, window: int | None, device=None) -> torch.Tensor:
    """Boolean [t, s]: True where query i (at q_start + i) may attend key j."""
    return positions_mask(torch.arange(q_start, q_start + t, device=device), s, window)


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[1, Hkv, S, d] -> [1, H, S, d] (grouped-query heads share a kv head)."""
    groups = num_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def call_mask(c: AttnCall, rows: slice | None = None, keys: tuple[int, int] | None = None) -> torch.Tensor:
    """Boolean [T, S] (or [rows, S], or [rows, hi - lo] for keys=(lo, hi)) of what each query may
    attend (by position, window, key mask)."""
    qpos = c.query_positions if rows is None else c.query_positions[rows]
    lo, hi = keys or (0, c.k.shape[2])
    mask = positions_mask(qpos, hi, c.window, lo)
    if c.key_mask is None:
        return mask
    if c.key_mask.dim() == 1:
        return mask & c.key_mask[lo:hi].to(mask.device)[None, :]
    return mask & (c.key_mask if rows is None else c.key_mask[rows])[:, lo:hi].to(mask.device)


def native_attention(c: AttnCall) -> torch.Tensor:
    """The model's own attention: SDPA (flash/efficient kernels where possible)."""
    if c.softcap is not None:
        return eager_attention(c)
    t, s = c.q.shape[2], c.k.shape[2]
    gqa = c.q.shape[1] != c.k.shape[1]
    if c.positions is None and c.key_mask is None and c.q_start == 0 and c.window is None and t == s:
        return F.scaled_dot_product_attention(c.q, c.k, c.v, is_causal=True, scale=c.scale, enable_gqa=gqa)
    qpos = c.query_positions
    out = torch.empty_like(c.q)
    chunks = _row_chunks(qpos, c.window)
    fast = _flash_cpu is not None and c.window is None and c.key_mask is None and c.q.device.type == "cpu"
    run = final_run(qpos, s) if fast and t >= SPLIT_MIN_ROWS else 0  # a decode step never looks
    if run >= SPLIT_MIN_ROWS:  # the last queries in a row: no mask, the fast kernel (causal_tail)
        out[:, :, t - run :] = causal_tail(c, run)
        chunks = [slice(0, t - run)] if t > run else []
    as_gemms = c.q.dtype == torch.bfloat16 and c.q.device.type == "cpu"
    for r in chunks:
        lo, hi = _key_range(qpos[r], s, c.window)
        q, k, v = c.q[:, :, r], c.k[:, :, lo:hi], c.v[:, :, lo:hi]
        mask = call_mask(c, r, (lo, hi))
        if as_gemms:
            out[:, :, r] = gemm_attention(q, k, v, mask, c.scale)
        else:
            out[:, :, r] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.scale, enable_gqa=gqa)
    return out


# scores held at once by gemm_attention (fp32): 64 MB
GEMM_SCORES = 1 << 24


def gemm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked attention of q [1, H, T, d] over k, v [1, Hkv, S, d] (bool mask [T, S]) as two GEMMs per kv head,
    its query heads stacked as the rows of one, softmax in fp32. In bf16 on the CPU this runs on the bf16 GEMM
    units where SDPA's masked flash kernel does not: 815 scattered queries over 4096 keys (gemma3's heads)
    measured 95 ms as SDPA against 59 ms here on the AVX512-bf16 EPYC."""
    _, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    out = torch.empty_like(q)
    step = max(1, GEMM_SCORES // max(1, g * s))
    for r0 in range(0, t, step):
        rows = slice(r0, min(t, r0 + step))
        n = rows.stop - r0
        neg = torch.zeros(n, s).masked_fill_(~mask[rows], float("-inf"))
        for j in range(hkv):
            heads = slice(j * g, (j + 1) * g)
            scores = (q[0, heads, rows].reshape(g * n, d) @ k[0, j].T).float().view(g, n, s)
            scores = torch.softmax(scores.mul_(scale).add_(neg), -1)
            out[0, heads, rows] = (scores.to(q.dtype).view(g * n, s) @ v[0, j]).view(g, n, d)
    return out


def final_run(qpos: torch.Tensor, s: int) -> int:
    """How many of the (sorted, distinct) query positions are the cache's last ones, s - run .. s - 1."""
    k = qpos.numel()
    if not k or int(qpos[-1]) != s - 1:
        return 0
    return int((qpos - torch.arange(k, device=qpos.device) == s - k).sum())


def causal_tail(c: AttnCall, run: int) -> torch.Tensor:
    """Attention of the last `run` queries, which sit at the cache's last `run` positions, exactly as the
    masked call computes it: every key before them unmasked plus a causal square among them, two calls of
    the CPU flash kernel merged by their log-sum-exp. A boolean mask over the whole cache (selective
    recompute's tail and the suffix, a suffix after a cache) took the slower masked kernel: 1230 queries
    over 4108 keys (qwen-0.5b's heads) read 419 ms masked against 232 ms split."""
    q = c.q[:, :, c.q.shape[2] - run :]
    k, v = expand_kv(c.k, c.q.shape[1]), expand_kv(c.v, c.q.shape[1])
    p = k.shape[2] - run
    out, lse = _flash_cpu(q, k[:, :, p:], v[:, :, p:], 0.0, True, scale=c.scale)
    if p == 0:
        return out
    out_before, lse_before = _flash_cpu(q, k[:, :, :p], v[:, :, :p], 0.0, False, scale=c.scale)
    total = torch.logaddexp(lse, lse_before)
    mixed = out.float() * (lse - total).exp()[..., None] + out_before.float() * (lse_before - total).exp()[..., None]
    return mixed.to(c.q.dtype)


def _row_chunks(qpos: torch.Tensor, window: int | None) -> list[slice]:
    """Query rows per SDPA call: all at once without a window; with one, runs of at most WINDOW_CHUNK
    rows whose positions lie within WINDOW_CHUNK of the run's first, so each call's key range stays
    rows + window. Scattered positions (selective recompute: the sink, a matched sentence, the last
    tokens) in one run of 256 rows spanned nearly the whole cache in every sliding-window layer."""
    t = qpos.numel()
    if window is None:
        return [slice(0, t)]
    if t and bool((qpos[1:] - qpos[:-1] == 1).all()):  # in a row: fixed-size chunks
        return [slice(r0, min(t, r0 + WINDOW_CHUNK)) for r0 in range(0, t, WINDOW_CHUNK)]
    p = qpos.tolist()
    chunks, r0 = [], 0
    for r in range(1, t + 1):
        if r == t or r - r0 >= WINDOW_CHUNK or abs(p[r] - p[r0]) >= WINDOW_CHUNK:
            chunks.append(slice(r0, r))
            r0 = r
    return chunks


def _key_range(qpos: torch.Tensor, s: int, window: int | None) -> tuple[int, int]:
    """The keys [lo, hi) any of these queries can see: none past the last query, none before the
    first query's window. SDPA with a mask computes every key it is given, so a sliding-window layer
    given the whole cache spent ~40% of gemma3's prefill at 4096 tokens on masked-out keys."""
    hi = min(s, int(qpos.max()) + 1)
    lo = 0 if window is None else max(0, int(qpos.min()) - window + 1)
    return lo, max(hi, lo)


def attention_logits(c: AttnCall, rows: slice | None = None) -> torch.Tensor:
    """Masked pre-softmax scores [H, rows, S] (soft-capped where the family caps)."""
    q = c.q[0] if rows is None else c.q[0, :, rows]
    k = expand_kv(c.k, c.q.shape[1])[0]
    scores = (q @ k.transpose(-1, -2)) * c.scale
    if c.softcap is not None:
        scores = torch.tanh(scores / c.softcap) * c.softcap
    mask = call_mask(c, rows)
    return scores.masked_fill(~mask, float("-inf"))


def eager_attention(c: AttnCall, chunk: int = 256, on_probs: ProbsCallback | None = None) -> torch.Tensor:
    """Explicit softmax(QK^T)V, in chunks of query rows so the dense map is never whole.

    `on_probs(layer, row0, probs)` sees each chunk's probabilities (the capture path for mapflow).
    """
    t = c.q.shape[2]
    v = expand_kv(c.v, c.q.shape[1])[0]
    out = torch.empty_like(c.q[0])
    for r0 in range(0, t, chunk):
        rows = slice(r0, min(t, r0 + chunk))
        probs = torch.softmax(attention_logits(c, rows), dim=-1)
        if on_probs is not None:
            on_probs(c.layer, r0, probs)
        out[:, rows] = probs @ v
    return out.unsqueeze(0)


def probs_attention(probs_by_layer: dict[int, torch.Tensor]) -> Callable[[AttnCall], torch.Tensor]:
    """Inject given attention probabilities [H, T, S] in place of softmax(QK^T) (exactness checks)."""

    def attend(c: AttnCall) -> torch.Tensor:
        p = probs_by_layer[c.layer].to(c.v.dtype)
        v = expand_kv(c.v, c.q.shape[1])[0]
        return (p @ v).unsqueeze(0)

    return attend
