"""The faithful relay's targets, checked on a frontier run's gate replay.

Per direction and length, at the point the gate picks by default, over the same held-out requests:
relayed needle accuracy >= native's - 0.125; TTFT >= 2x faster than native at 2048 tokens and >= 4x at
4096; essays ppl@128 <= 1.10x native and ShareGPT <= 1.5x (geometric means); top-1 agreement >= 0.85
(essays and ShareGPT each). Where the gate serves native prefill to every request the relay is 1x: it
misses the speed bar and trivially keeps the quality bars. So a frontier run says by how much each
target is missed, not only that it is.
"""

from __future__ import annotations

import math

SPEEDUP = {2048: 2.0, 4096: 4.0}  # by the length bucket of the frontier's cases
NEEDLE_SLACK = 0.125
TOP1 = 0.85
ESSAYS_PPL = 1.10
SHAREGPT_PPL = 1.5
_EPS = 1e-9  # 7/8 against native 8/8 - 0.125 holds despite float rounding
_DIGITS = {"speedup": 2}  # a miss by 0.004 top-1 must not print as 0.85 against 0.85


def checks(item: dict) -> list[dict]:
    """Each criterion of the bar that `item` (one gate-replay entry) can be judged on: name, value,
    target, and whether it holds ("at least" for speed, needles and top-1; "at most" for perplexity)."""
    native_only = set(item.get("points", {})) == {"native"}
    at_least = [
        ("speedup", 1.0 if native_only else item.get("speedup"), SPEEDUP.get(item["length"])),
        ("needles", item.get("needle_acc") if item.get("needle_cases") else None,
         None if item.get("native_needle_acc") is None else item["native_needle_acc"] - NEEDLE_SLACK),
        ("essays top-1", item.get("essays_top1"), TOP1),
        ("ShareGPT top-1", item.get("sharegpt_top1"), TOP1),
    ]  # fmt: skip
    at_most = [("essays ppl x", item.get("essays_ppl128_ratio"), ESSAYS_PPL),
               ("ShareGPT ppl x", item.get("sharegpt_ppl128_ratio"), SHAREGPT_PPL)]  # fmt: skip
    out = [{"name": n, "value": v, "target": t, "holds": v >= t - _EPS} for n, v, t in at_least if None not in (v, t)]
    out += [{"name": n, "value": v, "target": t, "holds": v <= t + _EPS} for n, v, t in at_most if None not in (v, t)]
    return out


def verdict(item: dict) -> str:
    """The verdict: "holds", or "misses" with each missed criterion, its value and its target, e.g.
    "misses speedup 2.38 (bar 4), essays top-1 0.798 (bar 0.85)"."""
    missed = [c for c in checks(item) if not c["holds"]]
    return "misses " + ", ".join(_missed(c, item) for c in missed) if missed else "holds"


def _missed(c: dict, item: dict) -> str:
    if c["name"] == "needles":  # as counts: "needles 15/24 (bar 17/24)"
        n = item["needle_cases"]
        return f"needles {round(c['value'] * n)}/{n} (bar {math.ceil(c['target'] * n - _EPS)}/{n})"
    return f"{c['name']} {c['value']:.{_DIGITS.get(c['name'], 3)}f} (bar {c['target']:.3g})"


def newest(runs: list[tuple[str, dict]], every: bool = False) -> list[tuple[dict, str]]:
    """The gate-replay entries of several runs ((name, results document) pairs) with the name of the run
    each comes from, one per direction and length: the run written last speaks for it (`every`: each
    run's own entry), sorted by direction and length."""
    found: dict[tuple, tuple[dict, str, str]] = {}
    for name, doc in runs:
        for x in doc.get("gate", []):
            key = (x["sender"], x["receiver"], x["length"]) + ((name,) if every else ())
            if key not in found or doc["written"] >= found[key][1]:
                found[key] = (x, doc["written"], name)
    return [(x, name) for _, (x, _, name) in sorted(found.items())]
