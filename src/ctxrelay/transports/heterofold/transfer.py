"""Sender ContextState (pre-RoPE K, V, offsets) -> receiver cache, without receiver prefill.

Steps, each timed into the RelayOutput contract:
  translate  tokenize the text with the receiver's tokenizer, align tokens, apply the per-layer maps
  copy       bring the sender's K/V to the receiver's device
  assemble   the receiver's own k-norm + RoPE at its own positions; native one-token passes for
             the attention sink and special tokens (never translated)
  first token  the appended tokens (question / new turn) run natively over the assembled cache
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ctxrelay.artifact import Artifact, model_binding
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.state import ContextState
from ctxrelay.timing import Stopwatch
from ctxrelay.transports.base import RelayOutput, check_edge
from ctxrelay.transports.heterofold.align import Alignment, align_ids, layer_sources, special_ids_of
from ctxrelay.transports.heterofold.hiding import hidden_layers, hide_code, hiding_gap
from ctxrelay.transports.heterofold.kv_maps import FoldMaps, translate
from ctxrelay.transports.heterofold.recompute.estimate import estimate, estimate_model, trusts
from ctxrelay.transports.heterofold.recompute.recompute_pass import SIGNALS, second_pass_positions
from ctxrelay.transports.heterofold.recompute.recompute_pass import recompute as recompute_positions
from ctxrelay.transports.heterofold.recompute.rules import TAIL, select

TRANSPORT = "heterofold"
ARTIFACT_VERSION = 1


def check_state(receiver: LoadedModel, state: ContextState, artifact: Artifact) -> None:
    """Bindings (the one edge check), then the state's K/V against the artifact's sender shapes."""
    check_edge(TRANSPORT, ARTIFACT_VERSION, receiver, state, artifact)
    if not state.has("kv"):
        raise UsageError(
            "this context state holds no pre-RoPE keys/values; heterofold needs them: "
            "capture the sender state with kv=True (ctxrelay.models.capture.capture_state)"
        )
    p = artifact.params
    want = (p["sender_layers"], p["sender_kv_heads"], p["sender_head_dim"])
    k = state.keys_pre_rope
    got = (k.shape[0], k.shape[2], k.shape[3])
    if got != want or state.values.shape != k.shape or k.shape[1] != state.num_tokens:
        raise UsageError(
            f"state K/V {tuple(k.shape)} / {tuple(state.values.shape)} do not fit the artifact's sender "
            f"(layers, kv_heads, head_dim) = {want} with {state.num_tokens} tokens"
        )


def align_for(receiver: LoadedModel, state: ContextState, artifact: Artifact, ids=None, offsets=None) -> Alignment:
    if ids is None:
        ids, offsets = tokenize_context(receiver, state.text)
    return align_ids(
        ids,
        offsets,
        special_ids_of(receiver.tokenizer),
        state.tokens,
        state.offsets,
        set(artifact.params.get("sender_special_ids", [])),
        artifact.params.get("pairing", "ta"),
    )


def fill_native(m: LoadedModel, ids: torch.Tensor, cache: KVCache, positions: list[int]) -> None:
    """Compute the receiver's own K/V at `positions` (sink, specials) and write them into `cache`.

    One pass at those positions: each attends by position to what precedes it in the cache (as in
    native prefill) and the ones before it in the pass.
    """
    if positions:
        pos = torch.tensor(positions, dtype=torch.long)
        runner.forward(m, ids[pos], cache, positions=pos, logits="none")


def check_own_layers(k: int, layers: int, name: str = "") -> int:
    """`k`, where it is a count of the receiver's first layers (0..layers); a clear error otherwise."""
    if not 0 <= int(k) <= layers:
        where = f" for {name}" if name else ""
        raise UsageError(f"own_layers must be a layer count in 0..{layers}{where}, got {k}")
    return int(k)


def own_layers_of(artifact: Artifact, receiver: LoadedModel, own_layers: int | None = None) -> int:
    """How many first layers get the receiver's own K/V: `own_layers` where given, else what the artifact
    serves (params["own_layers"], what its quality was calibrated with; 0 for artifacts made before it)."""
    k = artifact.params.get("own_layers", 0) if own_layers is None else own_layers
    return check_own_layers(k, receiver.spec.num_layers, receiver.name)


@torch.inference_mode()
def assemble_cache(
    receiver: LoadedModel,
    state: ContextState,
    artifact: Artifact,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    sw: Stopwatch | None = None,
    room: int = 0,
    native: bool = True,
    own_layers: int | None = None,
) -> tuple[KVCache, Alignment]:
    """The receiver cache for the context tokens `ids` (receiver tokenization of state.text) from the
    sender's K/V, with capacity for `room` more tokens; bindings must be checked already. Timed into
    `sw` as translate / copy / assemble. native=False leaves the sink and specials translated (zero
    rows): for a caller whose recompute pass computes them anyway (`fill_native` is a pass over every
    weight of the receiver, however few its tokens). own_layers = k: the receiver's own K/V for every
    context token in its first k layers instead of translated ones (layer 0's are projections of its
    token embeddings, nearly free; each further layer costs one layer of prefill); default: what the
    artifact serves (own_layers_of)."""
    sw = sw or Stopwatch()
    own_layers = own_layers_of(artifact, receiver, own_layers)
    with sw("translate_s"):
        al = align_for(receiver, state, artifact, ids, offsets)
        maps = FoldMaps.from_tensors(artifact.tensors, artifact.params["sources"])
    with sw("copy_s"):  # the maps run in fp32 whatever the receiver computes in (translate converts once)
        send_k = state.keys_pre_rope.to(receiver.device)
        send_v = state.values.to(receiver.device)
    with sw("translate_s"):
        s = receiver.spec
        keys, values = translate(maps, send_k, send_v, al.src.to(receiver.device), s.num_kv_heads, s.head_dim)
    with sw("assemble_s"):
        cache = runner.cache_from_pre_rope(receiver, keys, values, room) if ids.numel() else KVCache.empty(receiver)
        for i, (k, v) in enumerate(runner.early_kv(receiver, ids, own_layers) if ids.numel() else []):
            cache.write(i, slice(0, ids.numel()), k, v)
        if ids.numel() and native:
            fill_native(receiver, ids, cache, al.native)
    return cache, al


def relay_prefill(
    receiver: LoadedModel,
    state: ContextState,
    artifact: Artifact,
    suffix_ids: torch.Tensor,
    *,
    logits: Literal["last", "all"] = "last",
    recompute: float = 0.0,
    selection: str = "mix",
    query: str | None = None,
    attend: str = "all",
    hide_translated: int | str = 0,
    signals: Literal["estimate", "all"] = "estimate",
    own_layers: int | None = None,
) -> RelayOutput:
    """Receiver cache for `state.text` from the sender's K/V, then `suffix_ids` natively.

    recompute = f > 0: after translation the receiver recomputes its own K/V for a share f of the
    context tokens chosen by `selection` (recompute.py; `query` is the appended span's text, default
    the decoded suffix), through all layers; f = 1 is native prefill. With an empty suffix the last
    context token runs natively so there are next-token logits. logits="all" returns logits for every
    suffix position (quality benchmarks); the contract is "last". hide_translated = k > 0: the suffix
    and every token decoded after it do not see the translated entries in the receiver's first k
    layers, only the native and recomputed ones (the artifact's recompute stage measures k);
    hide_translated = "global": only in its full-attention layers (hiding.py); the first own_layers
    layers hold the receiver's own entries for every token and hide nothing.
    signals="estimate" measures only the per-request signal the gate acts on (none where the artifact's
    estimate is not trusted); "all" measures every recompute signal and reports an untrusted estimate as
    info["estimate_unused"] (calibration and quality benchmarks). Neither changes the cache or logits.
    own_layers = k: the receiver's own K/V for every context token in its first k layers (assemble_cache);
    default: what the artifact serves (own_layers_of).
    selection="mix2": a first pass (mix), then a second that recomputes the rest of the budget from the
    positions still translated that the first pass's last context tokens and question attended to most
    (second_pass_positions), and the context's last tokens and the suffix again over them.
    """
    sw = Stopwatch()
    with sw("translate_s"):
        check_state(receiver, state, artifact)
        hide_translated = hide_code(hide_translated)
        own_layers = own_layers_of(artifact, receiver, own_layers)
        hide_in = hidden_layers(receiver.spec, hide_translated, own_layers)  # checks the count
        suffix = torch.as_tensor(suffix_ids, dtype=torch.long).view(-1)
        if signals not in ("estimate", "all"):
            raise UsageError(f"signals must be 'estimate' or 'all', not {signals!r}")
        if suffix.numel() and (int(suffix.min()) < 0 or int(suffix.max()) >= receiver.spec.vocab_size):
            raise ValueError(f"suffix ids must be token ids of {receiver.name} (0..{receiver.spec.vocab_size - 1})")
        ids, offsets = tokenize_context(receiver, state.text)
        if suffix.numel() == 0:
            if ids.numel() == 0:
                raise ValueError("nothing to run: the context text and the suffix are both empty")
            ids, offsets, suffix = ids[:-1], offsets[:-1], ids[-1:]
    # room for the suffix and a short answer: neither copies the assembled cache into a larger one.
    # With recompute the sink and specials go into the recompute pass (select always includes them):
    # one pass over the receiver's weights instead of two
    recomputing = recompute > 0 and ids.numel() > 0
    room = suffix.numel() + KVCache.BLOCK
    cache, al = assemble_cache(receiver, state, artifact, ids, offsets, sw, room, not recomputing, own_layers)
    picked = None
    # the estimate of this request's setting (its length, its hiding), where the stage fitted one per setting
    model = estimate_model(artifact.quality.get("estimate"), int(ids.numel()), hide_translated)
    wanted = SIGNALS if signals == "all" else ((model or {}).get("signal"),) if trusts(model) else ()
    if recomputing:
        with sw("select_s"):
            q = query if query is not None else receiver.tokenizer.decode(suffix)
            picked = select(receiver, selection, recompute, ids, offsets, state.text, q, cache, al.native)
        if not picked.positions.numel():  # a budget that rounds to no token: plain heterofold
            with sw("assemble_s"):
                fill_native(receiver, ids, cache, al.native)
    translated = None  # the positions still holding translated K/V: what hiding hides, what the gap compares
    if ids.numel() and (hide_in or "hiding_gap" in wanted):
        with sw("assemble_s"):
            translated = translated_mask(ids.numel(), al.native, picked)
            if hide_in:  # hidden from the suffix and later tokens, not from recomputed ones
                cache.hide(translated, hide_in)
    measured: dict = {}
    info_extra: dict = {}
    # with recompute the suffix runs in the recompute pass (one read of the receiver's weights, not two):
    # recompute_s holds the suffix's rows (and the hiding gap where measured), first_token_s the LM head
    merged = picked is not None and picked.positions.numel() > 0
    if merged:
        with sw("recompute_s"):
            budget = int(picked.info.get("second_pass_budget", 0))
            attended = torch.zeros(ids.numel(), device=receiver.device) if budget > 0 else None
            out, measured = recompute_positions(
                receiver, ids, cache, picked.positions, attend, wanted, suffix, attended, query != ""
            )
            if attended is not None:
                out, again, translated = _second_pass(receiver, ids, cache, picked, al, attended, budget, suffix)
                info_extra["second_pass"] = again
            if "hiding_gap" in wanted:  # the first suffix row again under the other hiding
                first_row = out.hidden[:, -suffix.numel() :][:, :1]
                gap = hiding_gap(receiver, cache, suffix[:1], first_row, translated, hide_translated, own_layers)
                measured["hiding_gap"] = gap
    with sw("first_token_s"):
        if merged:
            hidden = out.hidden[:, -suffix.numel() :]
            out = runner.ForwardOut(runner.head(receiver, hidden, logits), out.cache, hidden)
        else:
            out = runner.forward(receiver, suffix, cache, logits=logits)
        first = int(out.logits[-1].argmax())
    info = {
        "method": artifact.params.get("method", ""),
        "pairing": artifact.params.get("pairing", "ta"),
        "context_tokens": int(ids.numel()),
        "sender_tokens": state.num_tokens,
        "native_positions": len(al.native),
        "exact_boundaries": al.exact,
        "exact_share": al.exact / max(1, int(ids.numel())),  # receiver tokens whose end a sender token shares
        "char_mismatch": al.char_mismatch,
        "first_token": first,
        "first_token_p": float(torch.softmax(out.logits[-1].float(), -1).max()),
    }
    if hide_translated:
        info["hide_translated"] = hide_translated
    if own_layers:
        info["own_layers"] = own_layers
    if picked is not None:
        recomputed = int(picked.positions.numel()) + info_extra.get("second_pass", 0)  # both passes
        info.update(
            recompute_fraction=recomputed / max(1, ids.numel()),
            selection=picked.rule,
            attend=attend,
            recomputed=recomputed,
            **picked.info,
            **measured,
            **info_extra,
        )
    est = estimate(model, info) if signals == "all" or trusts(model) else None
    if est is not None:  # the gate checks info["estimate"]; one that ranks too weakly is only reported
        info["estimate" if trusts(model) else "estimate_unused"] = est
    return RelayOutput(out.cache, out.logits, sw.timings, info)


def _second_pass(receiver, ids, cache, picked, al, attended, budget, suffix) -> tuple[runner.ForwardOut, int, Tensor]:
    """Recompute the translated positions the first pass attended to most, with the context's recomputed
    last tokens and the suffix again (they attended to what changed); the hidden mask follows. Returns the
    pass's output, how many positions it added and the positions still translated."""
    t = ids.numel()
    translated = translated_mask(t, al.native, picked)
    extra = second_pass_positions(attended.cpu(), translated, budget)
    translated[extra] = False
    if cache.hidden is not None:  # what the second pass made the receiver's own is no longer hidden
        cache.hidden[extra] = False
    last = picked.positions[picked.positions >= t - TAIL - 1]
    out, _ = recompute_positions(receiver, ids, cache, torch.cat([extra, last]).unique(), "all", (), suffix)
    return out, int(extra.numel()), translated


def translated_mask(n: int, native: list[int], picked=None) -> torch.Tensor:
    """[n] bool: the context positions that hold translated K/V (not the native sink and specials, not
    the recomputed tokens)."""
    mask = torch.ones(n, dtype=torch.bool)
    mask[torch.tensor(native, dtype=torch.long)] = False
    if picked is not None:
        mask[picked.positions] = False
    return mask


def make_artifact(
    sender: LoadedModel,
    receiver: LoadedModel,
    maps: FoldMaps,
    params: dict,
    quality_report: dict,
    command: str,
    dtype: torch.dtype = torch.float16,
) -> Artifact:
    return Artifact(
        transport=TRANSPORT,
        version=ARTIFACT_VERSION,
        sender=model_binding(sender),
        receiver=model_binding(receiver),
        tensors=maps.to_tensors(dtype),
        params=pair_params(sender, receiver, maps.sources, **params),
        quality=quality_report,
        command=command,
    )


def identity_artifact(m: LoadedModel) -> Artifact:
    """A model transferring to itself with identity maps (the exactness check)."""
    s = m.spec
    sources = layer_sources(s.num_layers, s.num_layers)
    maps = FoldMaps.identity(sources, s.num_kv_heads * s.head_dim)
    return make_artifact(m, m, maps, {"method": "identity", "pairing": "ta"}, {}, "", torch.float32)


def pair_params(sender: LoadedModel, receiver: LoadedModel, sources: list[list[int]], **extra) -> dict:
    """The shape facts and sender specials an artifact needs at relay time."""
    s, r = sender.spec, receiver.spec
    return {
        "sources": sources,
        "sender_layers": s.num_layers,
        "sender_kv_heads": s.num_kv_heads,
        "sender_head_dim": s.head_dim,
        "receiver_layers": r.num_layers,
        "receiver_kv_heads": r.num_kv_heads,
        "receiver_head_dim": r.head_dim,
        "sender_special_ids": sorted(special_ids_of(sender.tokenizer)),
        **extra,
    }
