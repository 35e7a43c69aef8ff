"""Per-layer mode choice by measured quality: guided, replace or native in each reused layer.

Cost order on long contexts (measured in the benchmark): replace < guided < hybrid < native. So the
choice starts from guided everywhere, moves the layers guided covers worst up to hybrid (and then
native) until the quality target holds, then turns guided layers into replace, best-fitting first,
keeping each change only if the target still holds. Every step is one evaluation of the receiver on the
selection contexts, logged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxrelay.mapflow.reuse import ReuseConfig, context_pass
from ctxrelay.models import runner
from ctxrelay.models.spec import LoadedModel


def relay_suffix_logits(receiver: LoadedModel, item, cfg: ReuseConfig) -> torch.Tensor:
    """Logits [S, V] predicting each suffix token after a reuse-path prefill of the context."""
    with torch.inference_mode():
        cache, h = context_pass(receiver, item.ctx, item.maps, cfg)
        first = runner.head(receiver, h, "last")
        rest = runner.forward(receiver, item.suffix[:-1], cache, logits="all").logits
    return torch.cat([first, rest]).float()


def evaluate(receiver: LoadedModel, items: list, cfg: ReuseConfig) -> dict:
    """Mean top-1 agreement and KL(native || relay) over the items' suffix positions."""
    top1, kl, n = 0.0, 0.0, 0
    for item in items:
        logits = relay_suffix_logits(receiver, item, cfg)
        ref = item.native
        log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
        kl += float((log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0).sum())
        top1 += float((ref.argmax(-1) == logits.argmax(-1)).sum())
        n += ref.shape[0]
    return {"top1_agreement": top1 / max(1, n), "kl": kl / max(1, n), "positions": n}


def choose_modes(
    evaluate_fn: Callable[[list[str]], dict],
    start: list[str],
    *,
    replace_order: list[int],
    upgrade_order: list[int],
    upgrades: tuple[str, ...] = ("hybrid", "native"),
    min_top1: float,
    log=print,
) -> tuple[list[str], dict]:
    """Greedy per-layer choice; returns (modes, log of every evaluated step).

    From `start` (guided in every reused layer): while below `min_top1`, move the next layer of
    `upgrade_order` one step up `upgrades` (guided -> hybrid -> native: more of the receiver's own
    attention, more cost); then try each layer of `replace_order` as replace, keeping it if the
    target still holds.
    """
    steps = []

    def score(layer_modes: list[str], what: str) -> dict:
        q = evaluate_fn(layer_modes)
        steps.append({"step": what, "top1": round(q["top1_agreement"], 4), "kl": round(q["kl"], 4)})
        log(f"  modes {what}: top1 {q['top1_agreement']:.3f} kl {q['kl']:.3f}")
        return q

    cur = list(start)
    q = score(cur, "start (guided in every reused layer)")
    for target in upgrades:
        for j in upgrade_order:
            if q["top1_agreement"] >= min_top1:
                break
            cur[j] = target
            q = score(cur, f"layer {j} -> {target}")
    for j in replace_order:
        if cur[j] != "guided" or q["top1_agreement"] < min_top1:
            continue
        trial = list(cur)
        trial[j] = "replace"
        qt = score(trial, f"layer {j} -> replace")
        if qt["top1_agreement"] >= min_top1:
            cur, q = trial, qt
    return cur, {"steps": steps, "min_top1": min_top1, "final_top1": round(q["top1_agreement"], 4)}
