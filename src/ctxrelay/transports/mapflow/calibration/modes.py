"""Per-layer mode choice by measured quality and measured cost: replace, guided, hybrid or native.

Costs are measured per layer on a long selection context with the receiver's real activations
(`layer_costs`): the attention of that layer in each mode, including its pattern or plan. On this
CPU guided beats replace at equal map density (see the benchmark), so the cost order is not fixed:
the choice starts from guided everywhere (native where guided measured no cheaper than native: then
native is better on both counts), moves the layers guided covers worst up to hybrid (where
hybrid costs less than native) and then native until the quality target holds, then tries replace
in the best-fitting layers where replace measured cheaper than the layer's current mode, keeping
each change only if the target still holds. Every step is one evaluation on the selection
contexts, logged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxrelay.metrics import PooledQuality
from ctxrelay.models import runner
from ctxrelay.models.attention import AttnCall, native_attention
from ctxrelay.models.spec import LoadedModel
from ctxrelay.timing import median_ms
from ctxrelay.transports.mapflow import apply, guided
from ctxrelay.transports.mapflow.reuse import ReuseConfig, context_pass


def relay_suffix_logits(receiver: LoadedModel, item, cfg: ReuseConfig) -> torch.Tensor:
    """Logits [S, V] predicting each suffix token after a reuse-path prefill of the context."""
    with torch.inference_mode():
        cache, h = context_pass(receiver, item.ctx, item.maps, cfg)
        first = runner.head(receiver, h, "last")
        rest = runner.forward(receiver, item.suffix[:-1], cache, logits="all").logits
    return torch.cat([first, rest]).float()


def evaluate(receiver: LoadedModel, items: list, cfg: ReuseConfig) -> dict:
    """Mean top-1 agreement and KL(native || relay) over the items' suffix positions."""
    pooled = PooledQuality()
    for item in items:
        pooled.add(item.native, relay_suffix_logits(receiver, item, cfg))
    return pooled.result()


def native_calls(receiver: LoadedModel, ids: torch.Tensor, layers: list[int]) -> dict[int, AttnCall]:
    """The receiver's real attention inputs (q/k/v) of `layers`, recorded from one native prefill of `ids`."""
    calls: dict[int, AttnCall] = {}

    def record(c: AttnCall) -> torch.Tensor:
        calls[c.layer] = c
        return native_attention(c)

    runner.forward(receiver, ids, attention=dict.fromkeys(layers, record), logits="none")
    return calls


def layer_costs(
    receiver: LoadedModel, item, cfg: ReuseConfig, w_replace: dict[int, torch.Tensor], repeats: int = 2
) -> dict[int, dict[str, float]]:
    """Milliseconds of each reused layer's attention over `item`'s context in every mode.

    The receiver's real q/k/v are recorded from one native prefill; each mode is timed with what it
    must build at relay time (replace: the BSR plan; guided: the pattern; hybrid: both patterns).
    """
    layers = [j for j, m in enumerate(cfg.modes) if m != "native"]
    maps = item.maps
    with torch.inference_mode():
        calls = native_calls(receiver, item.ctx, layers)
        out = {}
        for j in layers:
            c, bm, w = calls[j], maps[cfg.mapping[j]], cfg.w[j]
            kv = c.k.shape[1]

            def pattern(bm=bm, w=w, kv=kv):
                return cfg.guided_pattern(bm, w, kv)

            def replace(bm=bm, j=j, c=c):
                from ctxrelay.transports.mapflow.sparse import reselect

                return apply.replace_attention(apply.prepare_replace(reselect(bm, cfg.top_p)), w_replace[j], c.v)

            def hybrid(c=c, pattern=pattern):
                flex = guided.flex_pattern(c, cfg.block, cfg.flex_p, cfg.unit, cfg.local)
                return guided.guided_attention(c, flex.union(pattern()))

            out[j] = {
                "native": median_ms(lambda c=c: native_attention(c), repeats),
                "guided": median_ms(lambda c=c, pattern=pattern: guided.guided_attention(c, pattern()), repeats),
                "hybrid": median_ms(hybrid, repeats),
                "replace": median_ms(replace, repeats),
            }
    return out


def choose_modes(
    evaluate_fn: Callable[[list[str]], dict],
    start: list[str],
    *,
    replace_order: list[int],
    upgrade_order: list[int],
    upgrades: tuple[str, ...] = ("hybrid", "native"),
    min_top1: float,
    cost: dict[int, dict[str, float]] | None = None,
    log=print,
) -> tuple[list[str], dict]:
    """Greedy per-layer choice; returns (modes, log of every evaluated step).

    From `start` (guided in every reused layer): while below `min_top1`, move the next layer of
    `upgrade_order` one step up `upgrades` (guided -> hybrid -> native: more of the receiver's own
    attention), skipping a step that costs no less than the next one; then try each guided layer of
    `replace_order` as replace where replace costs less than guided, keeping it if the target still
    holds. Without `cost` every step is assumed to pay.
    """

    def cheaper(j: int, a: str, b: str) -> bool:
        return cost is None or cost[j][a] < cost[j][b]

    steps = []

    def score(layer_modes: list[str], what: str) -> dict:
        q = evaluate_fn(layer_modes)
        steps.append({"step": what, "top1": round(q["top1_agreement"], 4), "kl": round(q["kl"], 4)})
        log(f"  modes {what}: top1 {q['top1_agreement']:.3f} kl {q['kl']:.3f}")
        return q

    cur = list(start)
    dominated = [j for j, m in enumerate(cur) if m != "native" and cost is not None and not cheaper(j, m, "native")]
    for j in dominated:  # native is exact: where the sparse mode is not even cheaper, it is the better choice
        cur[j] = "native"
    what = "start (guided in every reused layer" + (f"; native where not cheaper: {dominated})" if dominated else ")")
    q = score(cur, what)
    for k, target in enumerate(upgrades):
        for j in upgrade_order:
            if q["top1_agreement"] >= min_top1:
                break
            later = upgrades[k + 1 :]
            if later and not cheaper(j, target, later[-1]):
                continue  # e.g. hybrid costs as much as native here: go straight to native later
            if cur[j] in upgrades[k:]:
                continue
            cur[j] = target
            q = score(cur, f"layer {j} -> {target}")
    for j in replace_order:
        if cur[j] != "guided" or q["top1_agreement"] < min_top1 or not cheaper(j, "replace", "guided"):
            continue
        trial = list(cur)
        trial[j] = "replace"
        qt = score(trial, f"layer {j} -> replace")
        if qt["top1_agreement"] >= min_top1:
            cur, q = trial, qt
    return cur, {"steps": steps, "min_top1": min_top1, "final_top1": round(q["top1_agreement"], 4)}
