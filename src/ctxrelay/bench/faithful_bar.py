"""Issue 11's bar for the faithful relay, checked on a frontier run's gate replay.

Per direction and length, at the point the gate picks by default, over the same held-out requests:
relayed needle accuracy >= native's - 0.125; TTFT >= 2x faster than native at 2048 tokens and >= 4x at
4096; essays ppl@128 <= 1.10x native and ShareGPT <= 1.5x (geometric means); top-1 agreement >= 0.85
(essays and ShareGPT each). Where the gate serves native prefill to every request the relay is 1x: it
misses the speed bar and trivially keeps the quality bars. So a frontier run says by how much each
target is missed, not only that it is.
"""

from __future__ import annotations

import math

from ctxrelay.errors import UsageError

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


def pooled(group: list[tuple[str, dict]]) -> dict:
    """Several runs' gate replays as one results document: held-out samples of one configuration (a sample
    of 4 conversations is one unlucky draw away from a miss, so the bar is read on all of them). Per
    direction and length the entries are pooled (`pool`). Refused where two runs served other points
    there (another artifact or hiding: not one configuration) or measured the same request twice (a
    rerun of the same cases is not a second sample)."""
    by_key: dict[tuple, list[tuple[dict, str, dict]]] = {}
    for name, doc in group:
        for e in doc.get("gate", []):
            by_key.setdefault((e["sender"], e["receiver"], e["length"]), []).append((e, name, doc))
    gate = []
    for (s, r, n), items in sorted(by_key.items()):
        served = {name: sorted(e["points"]) for e, name, _ in items}
        if len({tuple(v) for v in served.values()}) > 1:
            raise UsageError(f"{s} -> {r} at {n} tokens: the runs served other points ({served}); pool only "
                             "samples of one configuration")  # fmt: skip
        seen: dict[str, str] = {}
        for _, name, doc in items:
            for c in doc.get("cases", []):
                if c["key"].rsplit("-", 2)[1] == str(n) and c["context_sha"] in seen:  # "needle-4096-0"
                    other = seen[c["context_sha"]]
                    raise UsageError(f"{name} and {other} both measured the context of {c['key']}: a rerun of the "
                                     "same requests is not another sample; pool runs of other seeds")  # fmt: skip
                seen.setdefault(c["context_sha"], name)
        gate.append(pool([e for e, _, _ in items]))
    return {"written": max(doc["written"] for _, doc in group), "gate": gate}


def pool(entries: list[dict]) -> dict:
    """Gate-replay entries of one direction, length and set of points as one: counts summed, needle
    accuracy and top-1 weighted by their cases (essays: the needle cases' continuations; ShareGPT: the
    other requests), perplexity ratios and speedups as case-weighted geometric means (each speedup is a
    ratio measured within its own run, so runs on different machines pool as ratios, never as seconds)."""
    if len(entries) == 1:
        return entries[0]
    first = entries[0]
    out = {k: first[k] for k in ("sender", "receiver", "length", "threshold") if k in first}
    out["requests"] = sum(e["requests"] for e in entries)
    out["runs"] = len(entries)
    points: dict[str, int] = {}
    for e in entries:
        for p, k in e["points"].items():
            points[p] = points.get(p, 0) + k
    out["points"] = points
    needles = [(e, e.get("needle_cases", 0)) for e in entries]
    convs = [(e, e["requests"] - e.get("needle_cases", 0)) for e in entries]
    out["needle_cases"] = sum(n for _, n in needles)
    for field, by in (("needle_acc", needles), ("native_needle_acc", needles), ("essays_top1", needles),
                      ("sharegpt_top1", convs)):  # fmt: skip
        out[field] = _weighted(by, field, lambda v: v, lambda v: v)
    for field, by in (("essays_ppl128_ratio", needles), ("sharegpt_ppl128_ratio", convs),
                      ("speedup", [(e, e["requests"]) for e in entries])):  # fmt: skip
        out[field] = _weighted(by, field, math.log, math.exp)
    return {k: v for k, v in out.items() if v is not None}


def _weighted(by: list[tuple[dict, int]], field: str, to, back) -> float | None:
    """back(weighted mean of to(value)) over the entries that have `field`, weighted by their counts."""
    have = [(e[field], n) for e, n in by if e.get(field) is not None and n > 0]
    total = sum(n for _, n in have)
    return back(sum(to(v) * n for v, n in have) / total) if total else None
