"""One reused layer's attention over a real context, per operator: native SDPA vs mapflow's sparse ones.

`operator_times` is part of `ctxrelay bench mapflow` (the row "operators" of its results): what wins
on this CPU, apart from the rest of the layer (projections, MLP) that every mode pays alike.
`guided_operator_times` is the operator phase of `bench mapflow-capture`: every guided layer's
sparse attention against SDPA's ideal at the same kept-block fraction.
"""

from __future__ import annotations

import torch

from ctxrelay.models.attention import AttnCall
from ctxrelay.timing import Stopwatch, median_ms


def random_call(receiver, layer: int, tokens: int, seed: int = 0) -> AttnCall:
    """A prefill's attention call at the receiver's shapes with random q/k/v (operator timing only)."""
    s = receiver.spec
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, h, tokens, s.head_dim, generator=g) for h in (s.num_heads, s.num_kv_heads, s.num_kv_heads)
    )
    return AttnCall(layer, q, k, v, 0, s.attn_scale, None, None)


def _ms(fn, repeats: int) -> float:
    return round(median_ms(fn, repeats), 2)


def guided_operator_times(state, cfg, receiver, repeats: int = 3) -> dict:
    """Every guided layer's sparse attention over the state's context vs SDPA at its kept fraction.

    The pattern is the one the relay builds (the layer's sender map, W, guided_p, unit, local);
    q/k/v are random at the receiver's shapes (SDPA's time does not depend on them). ideal_ms is
    density x SDPA time summed over the layers: what a sparse kernel as efficient as SDPA would take.
    parts_ms splits one guided call per layer into its steps (guided.guided_attention's stopwatch).
    """
    from ctxrelay.models.attention import native_attention
    from ctxrelay.transports import mapflow
    from ctxrelay.transports.mapflow import guided
    from ctxrelay.transports.mapflow.sparse import maps_from_tensors

    meta = state.parts_meta[mapflow.PART]
    maps = maps_from_tensors(state.parts[mapflow.PART], meta)
    s, t = receiver.spec, state.num_tokens
    layers = [j for j, m in enumerate(cfg.modes) if m == "guided"]
    call = random_call(receiver, layers[0], t)
    sdpa = _ms(lambda: native_attention(call), repeats)
    full = guided.full_pattern(t, s.num_heads, cfg.block)
    per_layer, parts = [], Stopwatch()
    for j in layers:
        bm = maps[cfg.mapping[j]]
        pat = cfg.guided_pattern(bm, cfg.w[j], s.num_kv_heads)
        spent = _ms(lambda pat=pat: guided.guided_attention(call, pat), repeats)
        per_layer.append({"layer": j, "density": round(pat.density(), 4), "guided_ms": spent})
        guided.guided_attention(call, pat, sw=parts)
    ideal = sum(x["density"] * sdpa for x in per_layer)
    spent = sum(x["guided_ms"] for x in per_layer)
    return {
        "guided_layers": len(layers),
        "sdpa_ms": sdpa,
        "full_pattern_guided_ms": _ms(lambda: guided.guided_attention(call, full), repeats),
        "density": round(sum(x["density"] for x in per_layer) / len(per_layer), 4),
        "sdpa_ms_total": round(sdpa * len(layers), 2),
        "guided_ms_total": round(spent, 2),
        "ideal_ms_total": round(ideal, 2),
        "fraction_of_ideal": round(ideal / spent, 4),
        "speedup_vs_sdpa": round(sdpa * len(layers) / spent, 4),
        "parts_ms": {k.removesuffix("_s"): round(1000 * v, 2) for k, v in parts.timings.items()},
        "layers": per_layer,
    }


def operator_times(state, art, receiver, ps: list[float], repeats: int = 3) -> dict:
    """One layer's attention over the context, per operator: native SDPA vs the sparse ones (ms).

    Random q/k/v at the receiver's shapes; the map is the real sender map of the layer the artifact
    maps to the middle reused receiver layer. Shows what wins on this CPU, apart from the rest of
    the layer (projections, MLP) that every mode pays alike.
    """
    from ctxrelay.models.attention import native_attention
    from ctxrelay.transports import mapflow
    from ctxrelay.transports.mapflow import apply, guided
    from ctxrelay.transports.mapflow.reuse import ReuseConfig
    from ctxrelay.transports.mapflow.sparse import maps_from_tensors, reselect

    cfg = ReuseConfig.from_params(art.params, art.tensors)
    s = receiver.spec
    j = (int(art.params.get("reuse_from", cfg.r)) + s.num_layers) // 2
    mapping = [int(x) for x in art.params.get("diagnosis_mapping", cfg.mapping)]
    meta, maps = state.parts_meta[mapflow.PART], state.parts[mapflow.PART]
    captured = [int(x) for x in meta["layers"]]
    layer = mapping[j] if mapping[j] in captured else captured[len(captured) // 2]
    bm_full = maps_from_tensors(
        {k: v for k, v in maps.items() if k.startswith(f"{layer}.")}, dict(meta, layers=[layer])
    )[layer]
    w = art.tensors.get(f"w_fit.{j}", torch.full((bm_full.heads, s.num_heads), 1.0 / bm_full.heads))
    call = random_call(receiver, j, state.num_tokens)

    def ms(fn):
        return _ms(fn, repeats)

    out = {"receiver_layer": j, "sender_layer": layer, "sdpa_ms": ms(lambda: native_attention(call))}
    for p in ps:
        if bm_full.has_tiles:
            bm = reselect(bm_full, p)
            density = bm.density()
        else:  # a pattern-only (sampled) map: the same rule re-selects its pattern; replace has nothing to apply
            density = int((guided.sender_block_mass(bm_full, p) > 0).sum()) / max(1, bm_full.causal_tiles())
        row = {"sender_density": round(density, 4)}
        if bm_full.has_tiles:
            plan = apply.prepare_replace(bm)
            row["replace_prepare_ms"] = ms(lambda bm=bm: apply.prepare_replace(bm))
            row["replace_ms"] = ms(lambda plan=plan: apply.replace_attention(plan, w, call.v))
        for unit in ("group", "head"):
            pat = cfg.guided_pattern(bm_full, w, s.num_kv_heads, unit=unit, top_p=p, local=0)
            row[f"guided_{unit}_density"] = round(pat.density(), 4)
            row[f"guided_{unit}_pattern_ms"] = ms(
                lambda unit=unit, p=p: cfg.guided_pattern(bm_full, w, s.num_kv_heads, unit=unit, top_p=p, local=0)
            )
            row[f"guided_{unit}_ms"] = ms(lambda pat=pat: guided.guided_attention(call, pat))
        out[f"p={p}"] = row
    return out
