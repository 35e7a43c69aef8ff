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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ctxrelay.models.attention import AttnCall, AttnFn, ProbsCallback, eager_attention, native_attention
from ctxrelay.models.spec import LoadedModel


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per layer [1, Hkv, S, d], post k-norm + RoPE
    values: list[torch.Tensor]  # per layer [1, Hkv, S, d]

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    @staticmethod
    def empty(m: LoadedModel) -> KVCache:
        s = m.spec
        z = torch.zeros(1, s.num_kv_heads, 0, s.head_dim, dtype=m.dtype, device=m.device)
        return KVCache([z] * s.num_layers, [z] * s.num_layers)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer].shape[2]:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def clone(self) -> KVCache:
        return KVCache([k.clone() for k in self.keys], [v.clone() for v in self.values])

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
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [T, Hkv, d]
    vals: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ForwardOut:
    logits: torch.Tensor | None  # [T, V] ("all"), [1, V] ("last") or None
    cache: KVCache
    hidden: torch.Tensor | None = None  # final-norm hidden states [1, T, D] when asked


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


def attn_call(m: LoadedModel, i: int, q, k, v, q_start: int) -> AttnCall:
    s = m.spec
    return AttnCall(i, q, k, v, q_start, s.attn_scale, s.sliding_windows[i], s.softcap)


def layer_output(m: LoadedModel, i: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """o_proj, the family's norms around attention and MLP, residual adds."""
    layer = layers(m)[i]
    o = layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(1, attn_out.shape[2], -1))
    if m.spec.family.sandwich_norm:
        h = h + layer.post_attention_layernorm(o)
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    h = h + o
    return h + layer.mlp(layer.post_attention_layernorm(h))


def head(m: LoadedModel, h: torch.Tensor, which: Literal["last", "all"]) -> torch.Tensor:
    h = m.hf.model.norm(h if which == "all" else h[:, -1:])
    logits = m.hf.lm_head(h)[0]
    cap = getattr(m.hf.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


# ---- the loop ---------------------------------------------------------------------------------


@torch.inference_mode()
def forward(
    m: LoadedModel,
    ids: torch.Tensor,
    cache: KVCache | None = None,
    *,
    attention: Mapping[int, AttnFn] | None = None,
    capture: Capture | None = None,
    logits: Literal["last", "all", "none"] = "last",
) -> ForwardOut:
    """Run `ids` ([T] or [1, T]) after whatever `cache` holds; returns logits and the grown cache.

    `attention` replaces the attention of chosen layers; `capture` records sender state.
    """
    ids = ids.view(1, -1).to(m.device)
    cache = cache if cache is not None else KVCache.empty(m)
    start = cache.length
    h = embed(m, ids)
    rope = rope_tables(m, torch.arange(start, start + ids.shape[1], device=m.device), h)
    attention = attention or {}
    for i in range(m.spec.num_layers):
        x = attn_input(m, i, h)
        q = project_q(m, i, x, rope)
        k_raw, v = project_k_raw(m, i, x), project_v(m, i, x)
        if capture is not None:
            if capture.keys_pre_rope:
                capture.keys.append(k_raw[0].transpose(0, 1).clone())
            if capture.values:
                capture.vals.append(v[0].transpose(0, 1).clone())
        k_all, v_all = cache.append(i, finish_keys(m, i, k_raw, rope), v)
        call = attn_call(m, i, q, k_all, v_all, start)
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
    out_logits = None if logits == "none" else head(m, h, logits)
    return ForwardOut(out_logits, cache)


@torch.inference_mode()
def cache_from_pre_rope(m: LoadedModel, keys_pre_rope: torch.Tensor, values: torch.Tensor) -> KVCache:
    """Assemble a receiver cache from pre-k-norm, pre-RoPE keys and values [L, T, Hkv, d].

    The model applies its own k-norm and its own RoPE at positions 0..T-1, as native prefill would.
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
    ks, vs = [], []
    for i in range(s.num_layers):
        k_raw = keys_pre_rope[i].to(m.device, m.dtype).transpose(0, 1).unsqueeze(0)
        ks.append(finish_keys(m, i, k_raw, rope))
        vs.append(values[i].to(m.device, m.dtype).transpose(0, 1).unsqueeze(0))
    return KVCache(ks, vs)


@dataclass
class Generation:
    tokens: list[int]
    text: str
    ttft_s: float  # prefill of `ids` + choice of the first token
    total_s: float


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
) -> Generation:
    """Decode from next-token `logits` [V] over `cache`; times are measured from `t0` (request start)."""
    gen = torch.Generator().manual_seed(seed)
    eos = _eos_ids(m)
    tokens: list[int] = []
    ttft = 0.0
    step_logits = logits.view(-1)
    for step in range(max_new_tokens):
        if temperature > 0:
            p = torch.softmax(step_logits.float() / temperature, dim=-1)
            nxt = int(torch.multinomial(p, 1, generator=gen))
        else:
            nxt = int(step_logits.argmax())
        if step == 0:
            ttft = time.perf_counter() - t0
        if stop_at_eos and nxt in eos:
            break
        tokens.append(nxt)
        if step + 1 < max_new_tokens:
            out = forward(m, torch.tensor([nxt]), cache)
            cache, step_logits = out.cache, out.logits[-1]
    total = time.perf_counter() - t0
    return Generation(tokens, m.tokenizer.decode(tokens, skip_special_tokens=True), ttft, total)


def _eos_ids(m: LoadedModel) -> set[int]:
    ids = set()
    for src in (m.hf.generation_config, m.hf.config, m.tokenizer):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list | tuple):
            ids.update(int(x) for x in e)
    return ids
