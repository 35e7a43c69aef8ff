"""One forward loop for every family, built from small per-layer steps.

The steps (embed, attention input, q/k/v projection, k finishing, layer output, head) are public
so a transport can write its own layer loop (mapflow's reuse path skips q/k work in reused layers;
heterofold finishes translated pre-RoPE keys with `finish_keys`). `forward` is the plain loop:
native prefill, capture, injection and decode all go through it.

Shapes are batch-1: hidden [1, T, D]; heads [1, H, T, d]. The KV cache holds keys after the
family's k-norm and RoPE, exactly what native attention consumes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ctxrelay.models.attention import AttnCall, AttnFn, ProbsCallback, QKCallback, eager_attention, native_attention
from ctxrelay.models.sampling import Sampler, Sampling, StopText, TokenLogprob
from ctxrelay.models.spec import LoadedModel


class KVCache:
    """Per-layer key/value buffers [1, Hkv, capacity, d], written by position (cf. gpt-fast's KVCache).

    `length` is one past the last position held; `keys[i]` / `values[i]` are views of positions
    0..length-1 (post k-norm and RoPE). Writes go to explicit positions, so a transport can overwrite
    scattered entries in place (selective recompute). Capacity grows in blocks by half again when a
    write goes past it: decoding copies the cache a few times per thousand tokens, not once per token.
    """

    BLOCK = 256

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int | None = None):
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} key layers but {len(values)} value layers")
        self._k, self._v = list(keys), list(values)
        self.length = (keys[0].shape[2] if keys else 0) if length is None else length
        self.reallocations = 0  # times the buffers grew (a test watches this)
        # entries hidden from every later query in the layers of hidden_in (see hide); positions past
        # the mask (the appended question, decoded tokens) are visible
        self.hidden: torch.Tensor | None = None
        self.hidden_in: frozenset[int] = frozenset()

    def hide(self, hidden: torch.Tensor, layers: int | Collection[int], first: int = 0) -> None:
        """Hide the entries where `hidden` ([length] bool) is True from every query past them (positions
        >= length: what is appended and decoded later), in layers first..layers-1, or in the layers named
        where `layers` is a collection (heterofold: translated entries kept from the question and the
        answer where they bent more than they told; `first`: the layers below it hold the receiver's own
        entries, nothing translated to hide). A query at one of the masked positions (recomputing it) is
        not affected. No layer left shows everything again."""
        named = range(layers) if isinstance(layers, int) else layers
        where = frozenset(int(i) for i in named if int(i) >= max(0, first))
        if not where:
            self.hidden, self.hidden_in = None, frozenset()
            return
        if hidden.shape != (self.length,):
            raise ValueError(f"hidden must be a bool mask of the cache's {self.length} positions")
        self.hidden, self.hidden_in = hidden.to(torch.bool).clone(), where

    def visible(self, n: int, qpos: torch.Tensor | None = None) -> torch.Tensor | None:
        """[n] bool of the positions a query may see in the hidden layers (hidden_in;
        None: all); with the queries' positions `qpos` where some lie inside the hidden mask, [len(qpos), n]
        rows, those queries' all True (a recomputed context token sees what it would without hiding)."""
        if self.hidden is None:
            return None
        vis = torch.ones(n, dtype=torch.bool, device=self.hidden.device)
        k = min(n, self.hidden.numel())
        vis[:k] = ~self.hidden[:k]
        inside = None if qpos is None else (qpos < self.hidden.numel()).to(vis.device)
        if inside is None or not bool(inside.any()):
            return vis
        return vis[None, :] | inside[:, None]

    @staticmethod
    def empty(m: LoadedModel, capacity: int = 0) -> KVCache:
        """Length 0 with room for `capacity` positions. The buffers are not zeroed (as `reserve` does
        not): nothing past `length` is ever read, and zeroing a 4096-token gemma3 cache was a 160 MB
        pass in every relay."""
        s = m.spec
        shape = (1, s.num_kv_heads, capacity, s.head_dim)
        make = lambda: torch.empty(shape, dtype=m.dtype, device=m.device)
        return KVCache([make() for _ in range(s.num_layers)], [make() for _ in range(s.num_layers)], 0)

    @property
    def capacity(self) -> int:
        return self._k[0].shape[2] if self._k else 0

    @property
    def keys(self) -> list[torch.Tensor]:
        return [k[:, :, : self.length] for k in self._k]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[:, :, : self.length] for v in self._v]

    def reserve(self, n: int) -> None:
        """Make room for positions 0..n-1 (keeps what is held; grows by at least half the capacity)."""
        if n <= self.capacity:
            return
        cap = max(n, self.capacity + max(self.BLOCK, self.capacity // 2))
        cap = -(-cap // self.BLOCK) * self.BLOCK
        for bufs in (self._k, self._v):
            for i, old in enumerate(bufs):
                new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
                new[:, :, : self.length] = old[:, :, : self.length]
                bufs[i] = new
        self.reallocations += 1

    def write(self, layer: int, where: slice | torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Write k / v [1, Hkv, T, d] at positions `where` (a slice or [T] indices) of `layer`."""
        for buf, x in ((self._k[layer], k), (self._v[layer], v)):
            if x is None:
                continue
            if isinstance(where, slice):
                buf[:, :, where] = x
            else:
                buf.index_copy_(2, where, x)

    def view(self, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length if length is None else length
        return self._k[layer][:, :, :n], self._v[layer][:, :, :n]

    def clone(self) -> KVCache:
        out = KVCache([k.clone() for k in self.keys], [v.clone() for v in self.values])
        if self.hidden is not None:  # the mask as held: shorter than length once a question is appended
            out.hidden, out.hidden_in = self.hidden[: self.length].clone(), self.hidden_in
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class Capture:
    """What to record during a forward pass (the sender side of every transport)."""

    keys_pre_rope: bool = False  # k_proj output, before k-norm and RoPE
    values: bool = False  # v_proj output
    on_probs: ProbsCallback | None = None  # attention probabilities, streamed in row chunks
    prob_chunk: int = 64
    prob_layers: set[int] | None = None  # layers whose probabilities are wanted (None: all); others run SDPA
    on_qk: QKCallback | None = None  # sees each chosen layer's AttnCall (post-RoPE q, k) beside fused SDPA
    qk_layers: set[int] | None = None  # layers on_qk sees (None: all)
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [T, Hkv, d]
    vals: list[torch.Tensor] = field(default_factory=list)
    # called before each layer: raises to stop a prefill nobody waits for any more (a state build that gives
    # way to a request), so the compute lock is free within one layer
    check: Callable[[], None] | None = None


@dataclass
class ForwardOut:
    logits: torch.Tensor | None  # [T, V] ("all"), [1, V] ("last") or None
    cache: KVCache
    hidden: torch.Tensor | None = None  # last layer's output [1, T, D] before the final norm


# ---- per-layer steps --------------------------------------------------------------------------


def layers(m: LoadedModel):
    return m.hf.model.layers


def embed(m: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    return m.hf.model.embed_tokens(ids)


def rope_tables(m: LoadedModel, positions: torch.Tensor, like: torch.Tensor) -> dict[str, tuple]:
    """cos/sin [1, T, d] per layer type (one table unless the family varies RoPE by layer type)."""
    rot = m.hf.model.rotary_emb
    pos = positions.view(1, -1)
    if m.spec.family.rope_per_layer_type:
        return {lt: rot(like, pos, lt) for lt in set(m.spec.layer_types)}
    table = rot(like, pos)
    return {lt: table for lt in set(m.spec.layer_types)}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attn_input(m: LoadedModel, i: int, h: torch.Tensor) -> torch.Tensor:
    return layers(m)[i].input_layernorm(h)


def _heads(x: torch.Tensor, d: int) -> torch.Tensor:
    return x.view(1, x.shape[1], -1, d).transpose(1, 2)


def project_q(m: LoadedModel, i: int, x: torch.Tensor, rope: dict) -> torch.Tensor:
    attn = layers(m)[i].self_attn
    q = _heads(attn.q_proj(x), m.spec.head_dim)
    if m.spec.family.qk_norm:
        q = attn.q_norm(q)
    return rotate(q, *rope[m.spec.layer_types[i]])


def project_k_raw(m: LoadedModel, i: int, x: torch.Tensor) -> torch.Tensor:
    """Keys before k-norm and RoPE, [1, Hkv, T, d]: the model-independent part heterofold maps."""
    return _heads(layers(m)[i].self_attn.k_proj(x), m.spec.head_dim)


def finish_keys(m: LoadedModel, i: int, k_raw: torch.Tensor, rope: dict) -> torch.Tensor:
    """Apply the family's k-norm and this model's RoPE at the given positions."""
    attn = layers(m)[i].self_attn
    k = attn.k_norm(k_raw) if m.spec.family.qk_norm else k_raw
    return rotate(k, *rope[m.spec.layer_types[i]])


def project_v(m: LoadedModel, i: int, x: torch.Tensor) -> torch.Tensor:
    return _heads(layers(m)[i].self_attn.v_proj(x), m.spec.head_dim)


def attn_call(
    m: LoadedModel, i: int, q, k, v, q_start: int, positions: torch.Tensor | None = None, key_mask=None
) -> AttnCall:
    s = m.spec
    return AttnCall(i, q, k, v, q_start, s.attn_scale, s.sliding_windows[i], s.softcap, positions, key_mask)


def layer_output(m: LoadedModel, i: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """o_proj, the family's norms around attention and MLP, residual adds."""
    layer = layers(m)[i]
    o = layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(1, attn_out.shape[2], -1))
    if m.spec.family.sandwich_norm:
        h = h + layer.post_attention_layernorm(o)
        return h + layer.post_feedforward_layernorm(mlp(layer.mlp, layer.pre_feedforward_layernorm(h)))
    h = h + o
    return h + mlp(layer.mlp, layer.post_attention_layernorm(h))


# floats in one chunk's gate activation (16 MB). glibc serves blocks over 32 MB by a fresh mmap, so a
# whole prefill's activation (4096 x 4864 floats in qwen-0.5b, 80 MB) faulted in new zeroed pages at
# every layer: 12% system time; in chunks the blocks are reused and native prefill at 4096 measured
# 1.075x faster on qwen-0.5b, 1.09x on qwen-1.5b (interleaved pairs, scripts/mlp_chunks.py; same logits)
MLP_CHUNK_ELEMS = 1 << 22


def mlp(f: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's gated MLP, down(act(gate(x)) * up(x)), over chunks of rows when not training."""
    gated = all(hasattr(f, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
    rows = max(64, MLP_CHUNK_ELEMS // f.gate_proj.out_features) if gated else 0
    if not gated or x.shape[1] <= rows or torch.is_grad_enabled():
        return f(x)
    out = x.new_empty(*x.shape[:-1], f.down_proj.out_features)
    for a in range(0, x.shape[1], rows):
        xc = x[:, a : a + rows]
        g = f.act_fn(f.gate_proj(xc))
        out[:, a : a + rows] = f.down_proj(g.mul_(f.up_proj(xc)))
    return out


def head(m: LoadedModel, h: torch.Tensor, which: Literal["last", "all"]) -> torch.Tensor:
    h = m.hf.model.norm(h if which == "all" else h[:, -1:])
    logits = m.hf.lm_head(h)[0]
    cap = getattr(m.hf.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def tail_logits(m: LoadedModel, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Next-token logits [n, V] at the last n of `ids` after a prefill of them all. The LM head runs on
    those rows only: over every row it is T x V floats (into gemma3's 262k vocabulary at 4096 tokens,
    4.4 GB) for the few rows a caller keeps."""
    h = forward(m, ids, logits="none").hidden
    return head(m, h[:, h.shape[1] - n :], "all")


# ---- the loop ---------------------------------------------------------------------------------


def _where(cache: KVCache, t: int, positions: torch.Tensor | None) -> tuple[slice | torch.Tensor, int]:
    """Where `t` new tokens go (appended, or at explicit positions) and the cache length after them."""
    if positions is None:
        return slice(cache.length, cache.length + t), cache.length + t
    pos = torch.as_tensor(positions, dtype=torch.long).view(-1)
    if pos.numel() != t:
        raise ValueError(f"{t} tokens but {pos.numel()} positions")
    if t and int(pos.min()) < 0:
        raise ValueError("positions must be >= 0")
    if pos.unique().numel() != t:
        raise ValueError("positions must be distinct")
    new = pos[pos >= cache.length].sort().values
    end = cache.length + new.numel()
    if new.numel() and not torch.equal(new, torch.arange(cache.length, end)):
        raise ValueError(f"positions past the cache's {cache.length} entries must continue it without a gap")
    return pos.to(cache._k[0].device if cache._k else "cpu"), end


@torch.inference_mode()
def forward(
    m: LoadedModel,
    ids: torch.Tensor,
    cache: KVCache | None = None,
    *,
    positions: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    attention: Mapping[int, AttnFn] | None = None,
    capture: Capture | None = None,
    logits: Literal["last", "all", "none"] = "last",
) -> ForwardOut:
    """Run `ids` ([T] or [1, T]) after whatever `cache` holds; returns logits and the grown cache.

    `positions` ([T], optional) places the tokens at explicit, possibly scattered positions: their
    K/V are written there (over what the cache held) and each query attends by position, causally,
    to the whole cache (sliding windows by position too). Default: appended after the cache.
    `key_mask` ([cache length after the call] bool, or [T, that] per query; optional) hides the False keys;
    entries the cache hides (KVCache.hide) are hidden too in the layers it hides them in.
    `attention` replaces the attention of chosen layers; `capture` records sender state.
    """
    ids = ids.view(1, -1).to(m.device)
    cache = cache if cache is not None else KVCache.empty(m)
    t = ids.shape[1]
    where, end = _where(cache, t, positions)
    start = where.start if isinstance(where, slice) else int(where[0]) if t else cache.length
    qpos = None if isinstance(where, slice) else where
    cache.reserve(end)
    h = embed(m, ids)
    rope_pos = torch.arange(start, start + t, device=m.device) if qpos is None else qpos
    rope = rope_tables(m, rope_pos, h)
    attention = attention or {}
    # the key mask of the layers where the cache hides entries: one per call, not one per layer
    early_mask, vis = key_mask, cache.visible(end, rope_pos)
    if vis is not None:
        early_mask = vis if key_mask is None else key_mask & vis.to(key_mask.device)
    for i in range(m.spec.num_layers):
        if capture is not None and capture.check is not None:
            capture.check()
        x = attn_input(m, i, h)
        q = project_q(m, i, x, rope)
        k_raw, v = project_k_raw(m, i, x), project_v(m, i, x)
        if capture is not None:
            if capture.keys_pre_rope:
                capture.keys.append(k_raw[0].transpose(0, 1).clone())
            if capture.values:
                capture.vals.append(v[0].transpose(0, 1).clone())
        cache.write(i, where, finish_keys(m, i, k_raw, rope), v)
        k_all, v_all = cache.view(i, end)
        mask = early_mask if i in cache.hidden_in else key_mask
        call = attn_call(m, i, q, k_all, v_all, start, qpos, mask)
        if capture is not None and capture.on_qk is not None and (capture.qk_layers is None or i in capture.qk_layers):
            capture.on_qk(call)
        if i in attention:
            out = attention[i](call)
        elif (
            capture is not None
            and capture.on_probs is not None
            and (capture.prob_layers is None or i in capture.prob_layers)
        ):
            out = eager_attention(call, capture.prob_chunk, capture.on_probs)
        else:
            out = native_attention(call)
        h = layer_output(m, i, h, out)
    cache.length = end
    out_logits = None if logits == "none" else head(m, h, logits)
    return ForwardOut(out_logits, cache, h)


@torch.inference_mode()
def cache_from_pre_rope(m: LoadedModel, keys_pre_rope: torch.Tensor, values: torch.Tensor, room: int = 0) -> KVCache:
    """Assemble a receiver cache from pre-k-norm, pre-RoPE keys and values [L, T, Hkv, d].

    The model applies its own k-norm and its own RoPE at positions 0..T-1, as native prefill would.
    `room`: capacity for that many more tokens (the appended question), so they are written in place
    instead of copying the whole cache into a larger one (60 ms of a relay into gemma3 at 4096).
    """
    s = m.spec
    want = (s.num_layers, s.num_kv_heads, s.head_dim)
    got = (keys_pre_rope.shape[0], keys_pre_rope.shape[2], keys_pre_rope.shape[3])
    if got != want or values.shape != keys_pre_rope.shape:
        raise ValueError(
            f"cannot build a {s.name} cache from keys {tuple(keys_pre_rope.shape)} / values "
            f"{tuple(values.shape)}: expected [layers={want[0]}, T, kv_heads={want[1]}, head_dim={want[2]}]"
        )
    t = keys_pre_rope.shape[1]
    like = torch.empty(1, t, s.hidden_size, dtype=m.dtype, device=m.device)
    rope = rope_tables(m, torch.arange(t, device=m.device), like)
    capacity = t if room <= 0 else -(-(t + room) // KVCache.BLOCK) * KVCache.BLOCK
    cache = KVCache.empty(m, capacity)
    for i in range(s.num_layers):
        k_raw = keys_pre_rope[i].to(m.device, m.dtype).transpose(0, 1).unsqueeze(0)
        v = values[i].to(m.device, m.dtype).transpose(0, 1).unsqueeze(0)
        cache.write(i, slice(0, t), finish_keys(m, i, k_raw, rope), v)
    cache.length = t
    return cache


@torch.inference_mode()
def early_kv(m: LoadedModel, ids: torch.Tensor, n_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's own K/V ([1, Hkv, T, d], keys after k-norm and RoPE at positions 0..T-1) of its first
    `n_layers` layers for `ids`, exactly as native prefill makes them: layer 0's are projections of the
    token embeddings alone (no attention), each further layer costs one full layer of prefill."""
    t = ids.numel()
    h = embed(m, ids.view(1, -1).to(m.device))
    rope = rope_tables(m, torch.arange(t, device=m.device), h)
    out = []
    for i in range(n_layers):
        x = attn_input(m, i, h)
        k, v = finish_keys(m, i, project_k_raw(m, i, x), rope), project_v(m, i, x)
        out.append((k, v))
        if i + 1 < n_layers:
            h = layer_output(m, i, h, native_attention(attn_call(m, i, project_q(m, i, x, rope), k, v, 0)))
    return out


@dataclass
class Generation:
    tokens: list[int]
    text: str  # ends before a stop string where one ended the decode
    ttft_s: float  # prefill of `ids` + choice of the first token
    total_s: float
    finish_reason: str = "length"  # "stop": end-of-text or a stop string; "length": max_new_tokens reached
    logprobs: list[TokenLogprob] | None = None  # per token, where Sampling.logprobs asked for them


@torch.inference_mode()
def generate(
    m: LoadedModel,
    ids: torch.Tensor,
    cache: KVCache | None = None,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    attention: Mapping[int, AttnFn] | None = None,
    stop_at_eos: bool = True,
) -> Generation:
    """Greedy (temperature 0) or sampled decode after prefilling `ids` on top of `cache`."""
    t0 = time.perf_counter()
    out = forward(m, ids, cache, attention=attention)
    return decode(m, out.cache, out.logits[-1], t0, max_new_tokens, temperature, seed, stop_at_eos)


@torch.inference_mode()
def decode(
    m: LoadedModel,
    cache: KVCache,
    logits: torch.Tensor,
    t0: float,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    stop_at_eos: bool = True,
    on_token: Callable[[int], None] | None = None,
    sampling: Sampling | None = None,
) -> Generation:
    """Decode from next-token `logits` [V] over `cache`; times are measured from `t0` (request start).

    `sampling` (models/sampling.py), when given, carries temperature and seed too; without it the
    choice is greedy at temperature 0, else seeded sampling. `on_token` sees each kept token as soon
    as it is chosen (a server streams them)."""
    eos = eos_ids(m)
    s = sampling or Sampling(temperature=temperature, seed=seed)
    pick, stops = Sampler(s, logits.numel(), eos if stop_at_eos else set()), StopText(s.stop, s.min_tokens)
    cache.reserve(cache.length + max_new_tokens)  # one allocation for the whole decode
    tokens: list[int] = []
    ttft, finish, cut = 0.0, "length", None
    step_logits = logits.view(-1)
    for step in range(max_new_tokens):
        nxt = pick.choose(step_logits, len(tokens))
        if step == 0:
            ttft = time.perf_counter() - t0
        if stop_at_eos and nxt in eos:
            finish = "stop"
            break
        tokens.append(nxt)
        if on_token is not None:
            on_token(nxt)
        cut = stops.cut(m.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)) if s.stop else None
        if cut is not None:  # 0 too: the text began with a stop string
            finish = "stop"
            break
        if step + 1 < max_new_tokens:
            out = forward(m, torch.tensor([nxt]), cache)
            cache, step_logits = out.cache, out.logits[-1]
    total = time.perf_counter() - t0
    text = m.tokenizer.decode(tokens, skip_special_tokens=True)[:cut]
    logprobs = pick.logprobs[: len(tokens)] if s.logprobs is not None else None  # never end-of-text's
    return Generation(tokens, text, ttft, total, finish, logprobs)


def eos_ids(m: LoadedModel) -> set[int]:
    """The token ids that end generation (generation config, model config and tokenizer)."""
    ids = set()
    for src in (m.hf.generation_config, m.hf.config, m.tokenizer):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list | tuple):
            ids.update(int(x) for x in e)
    return ids
