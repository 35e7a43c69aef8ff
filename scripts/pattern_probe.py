"""Probe: attention time of the shipped mapflow edge's guided pattern against the FlexPrefill-style pattern,
all layers of qwen2.5-coder-0.5b, on the sender states `ctxrelay bench mapflow` cached for its contexts.

    python scripts/pattern_probe.py FLEX_P NAME STATE.safetensors [STATE ...]   # benchmarks/results/NAME.json

The states are the bench's (`$CTXRELAY_CACHE/mapflow/bench-states/qwen2.5-coder-1.5b/`: after one bench run
at 4096, `ls -tr` there lists its contexts last, in order). Each context's receiver q/k/v come from one native
forward; then every layer's attention is timed natively (SDPA), on the edge's guided pattern and on the
FlexPrefill-style pattern (its own last query block, at FLEX_P): a warm-up, then the median of 3. The
operator is the same for both patterns, so the difference is the patterns' density. Run it alone (it is a
timing run).
"""

import sys

import torch

from ctxrelay import paths, zoo
from ctxrelay.artifact import Artifact
from ctxrelay.bench.results import write_results
from ctxrelay.models.attention import native_attention
from ctxrelay.state import ContextState
from ctxrelay.timing import median_ms
from ctxrelay.transports.mapflow import PART, guided
from ctxrelay.transports.mapflow.modes import native_calls
from ctxrelay.transports.mapflow.reuse import ReuseConfig, select_maps
from ctxrelay.transports.mapflow.sparse import maps_from_tensors

RECEIVER = "qwen2.5-coder-0.5b"


def probe_context(r, cfg: ReuseConfig, state: ContextState, flex_p: float) -> list[dict]:
    meta = state.parts_meta[PART]
    maps = select_maps(maps_from_tensors(state.parts[PART], meta), cfg, float(meta.get("top_p", 1.0)))
    layers = r.spec.num_layers
    ms = {"sdpa": 0.0, "guided": 0.0, "flex": 0.0}
    density = {"guided": 0.0, "flex": 0.0}
    with torch.inference_mode():
        calls = native_calls(r, state.tokens.view(-1), list(range(layers)))
        for j in range(layers):
            c = calls[j]
            bm, w, kv = maps[cfg.mapping[j]], cfg.w[j], c.k.shape[1]
            pats = {
                "guided": cfg.guided_pattern(bm, w, kv),
                "flex": guided.flex_pattern(c, cfg.block, flex_p, cfg.unit, cfg.local),
            }
            for name, pat in pats.items():
                density[name] += pat.density() / layers
                ms[name] += median_ms(lambda c=c, pat=pat: guided.guided_attention(c, pat))
            ms["sdpa"] += median_ms(lambda c=c: native_attention(c))
    n = state.num_tokens
    return [
        {"transport": "native", "method": "sdpa", "context_tokens": n, "attention_ms": ms["sdpa"]},
        {"transport": "mapflow", "method": "guided", "context_tokens": n, "guided_p": cfg.guided_p,
         "density": density["guided"], "attention_ms": ms["guided"]},
        {"transport": "flexprefill", "method": "receiver-top-p", "context_tokens": n, "flex_p": flex_p,
         "density": density["flex"], "attention_ms": ms["flex"]},
    ]  # fmt: skip


def main() -> None:
    flex_p, name, states = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(2)
    path = paths.PACKAGED_ARTIFACTS / paths.artifact_name("mapflow", "qwen2.5-coder-1.5b", RECEIVER)
    art = Artifact.load(path)
    cfg = ReuseConfig.from_params(art.params, art.tensors)
    r = zoo.load(RECEIVER)
    rows = []
    for s in states:
        rows += probe_context(r, cfg, ContextState.load(s), flex_p)
        print(rows[-3:], flush=True)
    total = {
        t: sum(x["attention_ms"] for x in rows if x["transport"] == t) for t in ("native", "mapflow", "flexprefill")
    }
    dens = {t: sum(x["density"] for x in rows if x["transport"] == t) / len(states) for t in ("mapflow", "flexprefill")}
    command = f"python scripts/pattern_probe.py {flex_p} {name} <the bench's {len(states)} cached sender states>"
    write_results(name, rows, command, {"total_attention_ms": total, "mean_density": dens})
    print("total attention ms", {k: round(v) for k, v in total.items()}, "mean density", dens)


if __name__ == "__main__":
    main()
