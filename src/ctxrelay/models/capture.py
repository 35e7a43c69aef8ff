"""The one sender prefill: read a context natively and leave a ContextState with what transports need.

The pool, calibration and every benchmark call `capture_state`. What is recorded comes from
capture plans (one per transport that will read the state): pre-RoPE keys and values, attention
probabilities streamed to a consumer (mapflow's exact block compressor), and each layer's queries
and keys handed to a consumer beside fused SDPA (mapflow's sampled-row pattern estimate); each
consumer writes its own state part when the prefill is done. Layers nobody asked probabilities of
keep fused SDPA.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.attention import AttnCall, ProbsCallback, QKCallback
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.state import Binding, ContextState


@dataclass
class CapturePlan:
    """What one transport needs recorded during the sender's prefill (plans are merged)."""

    kv: bool = False  # pre-RoPE keys and values of every layer
    on_probs: ProbsCallback | None = None  # attention probabilities, streamed in row chunks
    prob_chunk: int = 64
    prob_layers: set[int] | None = None  # layers whose probabilities are wanted (None: all)
    on_qk: QKCallback | None = None  # post-RoPE q and k of a layer (its AttnCall); attention stays fused
    qk_layers: set[int] | None = None  # layers whose q/k are wanted (None: all)
    finish: Callable[[ContextState], None] | None = None  # writes the transport's part into the state


def merge(plans: Sequence[CapturePlan], kv: bool = False) -> runner.Capture:
    """One runner.Capture serving every plan: K/V if anyone wants them, each probs consumer its layers."""
    cap = runner.Capture(keys_pre_rope=kv or any(p.kv for p in plans), values=kv or any(p.kv for p in plans))
    _merge_qk(cap, [p for p in plans if p.on_qk is not None])
    readers = [p for p in plans if p.on_probs is not None]
    if not readers:
        return cap
    chunks = {p.prob_chunk for p in readers}
    if len(chunks) > 1:
        raise UsageError(f"capture plans ask for attention probabilities in different row chunks {sorted(chunks)}")
    cap.prob_chunk = chunks.pop()
    every = any(p.prob_layers is None for p in readers)
    cap.prob_layers = None if every else set().union(*(p.prob_layers for p in readers))

    def on_probs(layer: int, row0: int, probs: torch.Tensor) -> None:
        for p in readers:
            if p.prob_layers is None or layer in p.prob_layers:
                p.on_probs(layer, row0, probs)

    cap.on_probs = on_probs
    return cap


def _merge_qk(cap: runner.Capture, readers: list[CapturePlan]) -> None:
    """Every q/k consumer its layers, through the one runner hook."""
    if not readers:
        return
    every = any(p.qk_layers is None for p in readers)
    cap.qk_layers = None if every else set().union(*(p.qk_layers for p in readers))

    def on_qk(call: AttnCall) -> None:
        for p in readers:
            if p.qk_layers is None or call.layer in p.qk_layers:
                p.on_qk(call)

    cap.on_qk = on_qk


def run_capture(
    m: LoadedModel, ids: torch.Tensor, plans: Sequence[CapturePlan] = (), kv: bool = False,
    check: Callable[[], None] | None = None,
):  # fmt: skip
    """The sender's forward over `ids` recording what `plans` ask; returns the filled runner.Capture. `check`
    runs before each layer (runner.Capture.check)."""
    cap = merge(plans, kv)
    cap.check = check
    runner.forward(m, ids, capture=cap, logits="none")
    return cap


def capture_state(
    m: LoadedModel,
    text: str,
    tenant: str,
    plans: Sequence[CapturePlan] = (),
    *,
    kv: bool = True,
    meta: dict | None = None,
    check: Callable[[], None] | None = None,
) -> ContextState:
    """Native prefill of `text` by `m`; records what `plans` ask (and K/V when kv=True). `check` runs before
    each layer and may raise to stop the prefill."""
    ids, offsets = tokenize_context(m, text)
    t0 = time.perf_counter()
    cap = run_capture(m, ids, plans, kv, check)
    state = ContextState(
        text=text,
        tokens=ids,
        offsets=offsets,
        binding=Binding.of(m, tenant),
        keys_pre_rope=torch.stack(cap.keys) if cap.keys_pre_rope else None,
        values=torch.stack(cap.vals) if cap.values else None,
        meta={"sender": m.spec.name, **(meta or {})},
    )
    for p in plans:
        if p.finish is not None:
            p.finish(state)
    state.meta["prefill_s"] = time.perf_counter() - t0
    return state


def extend_state(
    m: LoadedModel, state: ContextState, text: str, plans: Sequence[CapturePlan] = (),
    check: Callable[[], None] | None = None,
) -> ContextState | None:  # fmt: skip
    """The state of `text`, which continues `state.text`, reading only the added tokens over the
    state's own K/V (a conversation's next turn on the same model). None where that would not equal
    `capture_state(m, text, ...)`: another model, no K/V, a plan that needs the whole prefill's
    attention, or a tokenization that re-splits the tokens at the seam."""
    if any(p.on_probs is not None or p.finish is not None for p in plans) or not state.has("kv"):
        return None
    if state.binding.weights_hash != m.spec.weights_hash or not text.startswith(state.text):
        return None
    ids, offsets = tokenize_context(m, text)
    n = state.num_tokens
    if len(ids) <= n or not torch.equal(ids[:n], state.tokens) or not torch.equal(offsets[:n], state.offsets):
        return None
    t0 = time.perf_counter()
    cache = runner.cache_from_pre_rope(m, state.keys_pre_rope, state.values)
    cap = runner.Capture(keys_pre_rope=True, values=True, check=check)
    runner.forward(m, ids[n:], cache, capture=cap, logits="none")
    new = ContextState(
        text=text,
        tokens=ids,
        offsets=offsets,
        binding=state.binding,
        keys_pre_rope=torch.cat([state.keys_pre_rope, torch.stack(cap.keys)], dim=1),
        values=torch.cat([state.values, torch.stack(cap.vals)], dim=1),
        meta={**state.meta, "extended_from": n},
    )
    new.meta["prefill_s"] = time.perf_counter() - t0
    return new


def state_of_kv(
    m: LoadedModel, text: str, tenant: str, keys_pre_rope: torch.Tensor, values: torch.Tensor, start: int = 0,
    base: ContextState | None = None, meta: dict | None = None,
) -> ContextState:  # fmt: skip
    """The state of `text` from K/V read elsewhere (a serving engine's prefill) of its tokens start..T-1,
    [L, T - start, Hkv, d]; the first `start` come from `base`, a state of this model over those very tokens
    (the engine's prefix cache served them). Refused where the parts do not add up to the text's tokens."""
    ids, offsets = tokenize_context(m, text)
    s = m.spec
    if keys_pre_rope.shape != values.shape or keys_pre_rope.shape[0] != s.num_layers:
        raise UsageError(f"K/V of shape {tuple(keys_pre_rope.shape)} / {tuple(values.shape)} is not {s.name}'s")
    if start + keys_pre_rope.shape[1] != len(ids):
        raise UsageError(f"K/V of positions {start}..{start + keys_pre_rope.shape[1] - 1} for {len(ids)} tokens")
    keys, vals = keys_pre_rope.to(m.dtype), values.to(m.dtype)
    if start:
        if base is None or not base.has("kv") or base.num_tokens < start:
            raise UsageError(f"K/V from position {start} needs a state of the first {start} tokens")
        if base.binding.weights_hash != s.weights_hash or not torch.equal(base.tokens[:start], ids[:start]):
            raise UsageError("the state the K/V continues is of another model or other tokens")
        base.check(tenant=tenant)
        keys = torch.cat([base.keys_pre_rope[:, :start].to(m.dtype), keys], dim=1)
        vals = torch.cat([base.values[:, :start].to(m.dtype), vals], dim=1)
    return ContextState(
        text=text, tokens=ids, offsets=offsets, binding=Binding.of(m, tenant), keys_pre_rope=keys, values=vals,
        meta={"sender": s.name, **({"extended_from": start} if start else {}), **(meta or {})},
    )  # fmt: skip


def unrope_keys(m: LoadedModel, keys: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Keys after RoPE [L, T, Hkv, d] at positions start..start+T-1 (as an engine's cache holds them) back to
    pre-RoPE keys, the rotation undone (cos, -sin). A family with k-norm has none to give: its norm dropped
    each key's scale, which its pre-norm keys (what the translators read) still have."""
    if m.spec.family.qk_norm:
        raise ValueError(f"{m.spec.name} normalises keys before RoPE: its cached keys cannot give pre-norm keys")
    t = keys.shape[1]
    like = torch.empty(1, t, m.spec.hidden_size, dtype=torch.float32, device=keys.device)
    rope = runner.rope_tables(m, torch.arange(start, start + t, device=keys.device), like)
    out = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    for i in range(keys.shape[0]):
        cos, sin = rope[m.spec.layer_types[i]]
        k = keys[i].to(torch.float32).transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
        out[i] = runner.rotate(k, cos.float(), -sin.float())[0].transpose(0, 1)
    return out
