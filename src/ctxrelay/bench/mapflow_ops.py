"""One reused layer's attention over a real context, per operator: native SDPA vs mapflow's sparse ones.

Part of `ctxrelay bench mapflow` (the row "operators" of its results): what wins on this CPU, apart
from the rest of the layer (projections, MLP) that every mode pays alike.
"""

from __future__ import annotations

import torch

from ctxrelay.timing import median_time


def operator_times(state, art, receiver, ps: list[float], repeats: int = 3) -> dict:
    """One layer's attention over the context, per operator: native SDPA vs the sparse ones (ms).

    Random q/k/v at the receiver's shapes; the map is the real sender map of the layer the artifact
    maps to the middle reused receiver layer. Shows what wins on this CPU, apart from the rest of
    the layer (projections, MLP) that every mode pays alike.
    """
    from ctxrelay.models.attention import AttnCall, native_attention
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
    t = state.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, s.head_dim, generator=g) for h in (s.num_heads, s.num_kv_heads, s.num_kv_heads))
    call = AttnCall(j, q, k, v, 0, s.attn_scale, None, None)

    def ms(fn):
        return round(1000 * median_time(fn, repeats, warmup=1)[0], 2)

    out = {"receiver_layer": j, "sender_layer": layer, "sdpa_ms": ms(lambda: native_attention(call))}
    for p in ps:
        bm = reselect(bm_full, p)
        plan = apply.prepare_replace(bm)
        row = {
            "sender_density": round(bm.density(), 4),
            "replace_prepare_ms": ms(lambda bm=bm: apply.prepare_replace(bm)),
            "replace_ms": ms(lambda plan=plan: apply.replace_attention(plan, w, v)),
        }
        for unit in ("group", "head"):
            pat = guided.guided_pattern(bm_full, w, cfg.guided_p, s.num_kv_heads, unit, p)
            row[f"guided_{unit}_density"] = round(pat.density(), 4)
            row[f"guided_{unit}_pattern_ms"] = ms(
                lambda unit=unit, p=p: guided.guided_pattern(bm_full, w, cfg.guided_p, s.num_kv_heads, unit, p)
            )
            row[f"guided_{unit}_ms"] = ms(lambda pat=pat: guided.guided_attention(call, pat))
        out[f"p={p}"] = row
    return out
