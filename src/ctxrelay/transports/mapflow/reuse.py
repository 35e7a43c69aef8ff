"""The receiver's reuse path: build its cache over the shared context from the sender's maps.

Per receiver layer j, the mode decides how attention over the context is computed:
  native   softmax(QK^T)V as usual (always the first r layers)
  replace  the W-mixed sender map of layer m(j) applied to the receiver's own V (apply.py); no
           queries are projected, and the key projection is deferred until the context pass is
           done (keys only matter to later tokens: the suffix and decoding)
  guided   the receiver's own softmax(QK^T), only in the key blocks the sender's map keeps (guided.py)
  flex     the receiver's own softmax(QK^T) in key blocks chosen by its last query block (baseline)
  hybrid   guided's blocks united with flex's: the sender's per-row pattern plus the receiver's own
           choice of globally important blocks
Tokens appended after the context (question, new turn) then run natively over the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrelay.models import runner
from ctxrelay.models.attention import native_attention
from ctxrelay.models.spec import LoadedModel
from ctxrelay.timing import Stopwatch
from ctxrelay.transports.mapflow import apply, guided
from ctxrelay.transports.mapflow.sparse import BlockMaps, MapsError, reselect

MODES = ("native", "replace", "guided", "flex", "hybrid")


@dataclass
class ReuseConfig:
    """What the receiver does per layer; built from an artifact or by calibration."""

    modes: list[str]  # per receiver layer, one of MODES
    mapping: list[int]  # per receiver layer: the sender layer whose map it uses (-1: none)
    w: dict[int, torch.Tensor] = field(default_factory=dict)  # receiver layer -> W [Hs, Hr]
    top_p: float = 0.9  # sender map top-p (maps captured at a higher p are re-selected down)
    guided_p: float = 0.9  # top-p over the W-mixed block masses in guided layers
    unit: str = "group"  # guided/flex pattern per kv group or per head
    flex_p: float = 0.9  # flex layers: top-p of the last query block's block masses
    block: int = 64  # flex layers' block size (replace/guided use the maps' own)
    local: int = 1  # guided/flex/hybrid also keep this many key blocks before the diagonal one
    defer_keys: bool = True
    guided_select: str = "row"  # guided top-p per query-block row, or "global" over each unit's tiles

    def __post_init__(self) -> None:
        if len(self.modes) != len(self.mapping):
            raise ValueError(f"{len(self.modes)} modes but {len(self.mapping)} mapped layers")
        if self.guided_select not in guided.SELECTS:
            raise ValueError(f"unknown guided selection {self.guided_select!r}: use {', '.join(guided.SELECTS)}")
        bad = sorted({m for m in self.modes if m not in MODES})
        if bad:
            raise ValueError(f"unknown mapflow mode(s) {bad}: use {', '.join(MODES)}")
        for j, mode in enumerate(self.modes):
            if mode in ("replace", "guided", "hybrid") and (self.mapping[j] < 0 or j not in self.w):
                raise ValueError(f"receiver layer {j} uses {mode} but has no sender layer or no mixing weights")

    @property
    def r(self) -> int:
        """Leading layers recomputed natively."""
        for j, m in enumerate(self.modes):
            if m != "native":
                return j
        return len(self.modes)

    def sender_layers(self) -> list[int]:
        used = ("replace", "guided", "hybrid")
        return sorted({self.mapping[j] for j, m in enumerate(self.modes) if m in used})

    def counts(self) -> dict[str, int]:
        return {m: self.modes.count(m) for m in MODES if m in self.modes}

    def method(self) -> str:
        """'replace', 'guided' or 'mixed' (what a results row names), from the reused layers' modes."""
        used = {m for m in self.modes if m != "native"}
        return used.pop() if len(used) == 1 else ("mixed" if used else "native")

    def to_params(self) -> dict:
        return {
            "modes": self.modes,
            "mapping": self.mapping,
            "top_p": self.top_p,
            "guided_p": self.guided_p,
            "unit": self.unit,
            "flex_p": self.flex_p,
            "block": self.block,
            "local": self.local,
            "guided_select": self.guided_select,
            "r": self.r,
        }

    def w_tensors(self) -> dict[str, torch.Tensor]:
        return {f"w.{j}": w.float().clone() for j, w in self.w.items()}

    @staticmethod
    def from_params(params: dict, tensors: dict[str, torch.Tensor]) -> ReuseConfig:
        w = {int(k[2:]): v.float() for k, v in tensors.items() if k.startswith("w.")}
        return ReuseConfig(
            modes=list(params["modes"]),
            mapping=[int(x) for x in params["mapping"]],
            w=w,
            top_p=float(params["top_p"]),
            guided_p=float(params.get("guided_p", 0.9)),
            unit=str(params.get("unit", "group")),
            flex_p=float(params.get("flex_p", 0.9)),
            block=int(params.get("block", 64)),
            local=int(params.get("local", 1)),
            guided_select=str(params.get("guided_select", "row")),  # edges from before it: per row
        )

    def guided_pattern(self, bm: BlockMaps, w: torch.Tensor, kv_heads: int, **change) -> guided.BlockPattern:
        """The pattern a guided layer with sender map `bm` and mixing `w` computes in (`change`
        overrides guided_p, unit, top_p, local or select, as the benchmarks' sweeps do)."""
        args = dict(guided_p=self.guided_p, unit=self.unit, top_p=self.top_p, local=self.local)
        args["select"] = self.guided_select
        args.update(change)
        return guided.guided_pattern(bm, w, kv_heads=kv_heads, **args)


def select_maps(maps: dict[int, BlockMaps], cfg: ReuseConfig, meta_top_p: float) -> dict[int, BlockMaps]:
    """The sender layers the config reads, re-selected to its top-p (exact when the state's p is higher)."""
    out = {}
    replaced = {cfg.mapping[j] for j, m in enumerate(cfg.modes) if m == "replace"}
    for layer in cfg.sender_layers():
        if layer not in maps:
            raise MapsError(
                f"the state holds no compressed map of sender layer {layer}; capture it with all layers "
                f"(make_map_capture) or a layer list that includes {cfg.sender_layers()}"
            )
        bm = maps[layer]
        if layer in replaced and not bm.has_tiles:
            raise MapsError(
                f"sender layer {layer}'s map is a pattern without probabilities (a sampled capture), but "
                "replace mode applies the map itself: capture the state with map_capture_plan(..., capture='exact')"
            )
        # guided-only layers re-select their pattern from tile masses (guided_pattern), never copying tiles
        out[layer] = reselect(bm, cfg.top_p) if cfg.top_p < meta_top_p and layer in replaced else bm
    return out


def context_pass(
    m: LoadedModel,
    ids: torch.Tensor,
    maps: dict[int, BlockMaps],
    cfg: ReuseConfig,
    sw: Stopwatch | None = None,
    *,
    differentiable: bool = False,
    w_override: dict[int, torch.Tensor] | None = None,
    prepared: dict[int, object] | None = None,
    stats: dict | None = None,
) -> tuple[runner.KVCache, torch.Tensor]:
    """Prefill the context `ids` [T] through the reuse path; returns (cache, final hidden [1, T, D]).

    Preparing a layer's map (regrouping tiles, building a pattern) is timed as copy_s, the rest as
    assemble_s. `differentiable` uses the autograd-friendly replace operator (training W);
    `prepared` caches plans across calls (training reuses the same texts every epoch); `stats`, when
    given, receives the computed share of causal tiles per mode (what the sparse operators touched).
    """
    sw = sw or Stopwatch()
    s = m.spec
    if len(cfg.modes) != s.num_layers:
        raise ValueError(f"config covers {len(cfg.modes)} layers but {s.name} has {s.num_layers}")
    ids = ids.view(1, -1).to(m.device)
    t = ids.shape[1]
    w_all = w_override if w_override is not None else cfg.w
    cache = runner.KVCache.empty(m, t)
    deferred: list[tuple[int, torch.Tensor]] = []
    with sw("assemble_s"):
        h = runner.embed(m, ids)
        rope = runner.rope_tables(m, torch.arange(t, device=m.device), h)
    for i in range(s.num_layers):
        mode = cfg.modes[i]
        plan = None
        if mode in ("replace", "guided", "hybrid"):
            with sw("copy_s"):
                plan = _plan(i, mode, maps, cfg, w_all, differentiable, prepared, t, s.num_kv_heads)
                if stats is not None and mode != "hybrid":
                    dens = plan.density() if mode == "guided" else maps[cfg.mapping[i]].density()
                    stats.setdefault(f"{mode}_density", []).append(dens)
        with sw("assemble_s"):
            x = runner.attn_input(m, i, h)
            v = runner.project_v(m, i, x)
            if mode == "replace" and cfg.defer_keys:
                k = None
                deferred.append((i, x))
            else:
                k = runner.finish_keys(m, i, runner.project_k_raw(m, i, x), rope)
            if mode == "replace" and v.is_cuda and not differentiable and _triton_ok():
                from ctxrelay.transports.mapflow import triton_apply

                out = triton_apply.replace_attention_triton(maps[cfg.mapping[i]], w_all[i], v)
            elif mode == "replace":
                fn = apply.replace_attention_padded if differentiable else apply.replace_attention
                out = fn(plan, w_all[i], v)
            else:
                q = runner.project_q(m, i, x, rope)
                call = runner.attn_call(m, i, q, k, v, 0)
                if mode == "native":
                    out = native_attention(call)
                elif mode == "guided":
                    out = guided.guided_attention(call, plan)
                else:  # flex, hybrid: the receiver's own last query block picks (more) blocks
                    pat = guided.flex_pattern(call, cfg.block, cfg.flex_p, cfg.unit, cfg.local)
                    pat = pat if mode == "flex" else pat.union(plan)
                    if stats is not None:
                        stats.setdefault(f"{mode}_density", []).append(pat.density())
                    out = guided.guided_attention(call, pat)
            cache.write(i, slice(0, t), k, v)
            h = runner.layer_output(m, i, h, out)
    with sw("assemble_s"):  # deferred key projections: needed by the suffix and by decoding only
        for i, x in deferred:
            cache.write(i, slice(0, t), runner.finish_keys(m, i, runner.project_k_raw(m, i, x), rope), None)
    cache.length = t
    return cache, h


def _triton_ok() -> bool:
    from ctxrelay.transports.mapflow import triton_apply

    return triton_apply.available()


def _plan(i, mode, maps, cfg, w_all, differentiable, prepared, t, kv_heads):
    key = (i, mode)
    if prepared is not None and key in prepared and mode == "replace":
        return prepared[key]
    bm = maps[cfg.mapping[i]]
    if bm.tokens != t:
        raise MapsError(f"sender map covers {bm.tokens} tokens, the context has {t}: the state does not match")
    if mode == "replace":
        plan = apply.prepare_padded(bm) if differentiable else apply.prepare_replace(bm)
    else:
        plan = cfg.guided_pattern(bm, w_all[i].detach(), kv_heads)
    if prepared is not None and mode == "replace":
        prepared[key] = plan
    return plan


def last_logits(m: LoadedModel, h: torch.Tensor) -> torch.Tensor:
    return runner.head(m, h, "last")


# ---- the transport entry point -------------------------------------------------------------------


@torch.inference_mode()
def relay_prefill(receiver: LoadedModel, state, artifact, suffix_ids: torch.Tensor, transport: str, version: int):
    """Receiver cache over the state's tokens via the reuse path, then `suffix_ids` natively."""
    from ctxrelay.transports.base import RelayOutput, check_edge
    from ctxrelay.transports.mapflow import PART
    from ctxrelay.transports.mapflow.sparse import maps_from_tensors

    check_edge(transport, version, receiver, state, artifact, same_tokenizer=True)
    if not state.has(PART):
        raise MapsError(
            "context state has no attention maps: the sender must prefill with "
            "capture_state(sender, text, tenant, [map_capture_plan(sender)])"
        )
    cfg = ReuseConfig.from_params(artifact.params, artifact.tensors)
    sw = Stopwatch()
    with sw("copy_s"):
        meta = state.parts_meta[PART]
        maps = select_maps(maps_from_tensors(state.parts[PART], meta), cfg, float(meta.get("top_p", 1.0)))
    stats: dict[str, list[float]] = {}
    cache, h = context_pass(receiver, state.tokens, maps, cfg, sw, stats=stats)
    suffix_ids = torch.as_tensor(suffix_ids).view(-1)
    with sw("first_token_s"):
        if suffix_ids.numel():
            out = runner.forward(receiver, suffix_ids, cache, logits="last")
            cache, logits = out.cache, out.logits
        else:
            logits = last_logits(receiver, h)
    info = {
        "method": cfg.method(),
        "modes": cfg.counts(),
        "r": cfg.r,
        "top_p": cfg.top_p,
        "state_top_p": float(meta.get("top_p", 1.0)),
        "map_source": str(meta.get("source", "exact")),  # states from before sampled captures are exact
        "guided_p": cfg.guided_p,
        "guided_select": cfg.guided_select,
        **{k: sum(v) / len(v) for k, v in stats.items()},  # mean computed share of causal tiles per mode
        "context_tokens": state.num_tokens,
        "suffix_tokens": int(suffix_ids.numel()),
    }
    return RelayOutput(cache=cache, logits=logits.view(1, -1), timings=sw.timings, info=info)
