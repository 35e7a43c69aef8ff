"""Two artifacts (or two settings) on the same held-out requests: paired differences from frontier files.

    python scripts/frontier_paired.py OLD:NEW [OLD:NEW ...]
    e.g. python scripts/frontier_paired.py heterofold-frontier-q15g3-seed700:heterofold-frontier-q15g3-long-conv-seed700

Each OLD:NEW names two `ctxrelay bench heterofold-frontier` results files (names in benchmarks/results, or
paths), typically the installed artifact's run and a work artifact's (`--set artifact=PATH`) on the same
cases. Requests are matched by their context (the files' case hashes), counted once over all pairs, and
grouped by direction, length, dataset and point (rule, f, hiding). Per group: requests, top-1 agreement
OLD -> NEW, the paired mean difference with its standard error and how many requests went up / down,
the geometric-mean continuation perplexity against native, and needles answered right (native). No model runs.
"""

import statistics
import sys
from collections import defaultdict

from ctxrelay.results import read_results


def requests(name: str) -> dict:
    """(direction, length, dataset, point, context hash) -> the row, for every quality row of the file."""
    doc = read_results(name)
    sha = {c["key"]: c["context_sha"] for c in doc.get("cases", [])}
    out = {}
    for x in doc["rows"]:
        if x.get("kind") == "timing" or x["case_key"] not in sha:
            continue
        point = (x["selection"], x["f"], str(x.get("hide_translated", 0) or 0))
        out[((x["sender"], x["receiver"]), x["length"], x["dataset"], point, sha[x["case_key"]])] = x
    return out


def ppl_ratio(x: dict) -> float:
    return x["ppl"]["128"] / x["native_ppl"]["128"]


def main() -> None:
    pairs = [a.split(":") for a in sys.argv[1:]]
    if not pairs or any(len(p) != 2 for p in pairs):
        sys.exit(__doc__)
    groups: dict[tuple, list[tuple[dict, dict]]] = defaultdict(list)
    seen = set()
    for old_name, new_name in pairs:
        old, new = requests(old_name), requests(new_name)
        for key in sorted(set(old) & set(new), key=str):
            if key not in seen:
                seen.add(key)
                groups[key[:4]].append((old[key], new[key]))
    print("| direction | tokens | dataset | rule, f, hide | requests | top-1 old -> new | paired +- se (up / down) "
          "| ppl x old -> new | needles old -> new (native) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for (d, n, ds, point), rows in sorted(groups.items(), key=str):
        diff = [b["top1_agreement"] - a["top1_agreement"] for a, b in rows]
        se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
        top = [statistics.mean(r[i]["top1_agreement"] for r in rows) for i in (0, 1)]
        ppl = [statistics.geometric_mean(ppl_ratio(r[i]) for r in rows) for i in (0, 1)]
        needles = "-"
        if ds == "needle":
            right = [sum(r[i].get("needle_acc", 0) for r in rows) for i in (0, 1)]
            needles = f"{right[0]} -> {right[1]} ({sum(r[0].get('native_needle_acc', 0) for r in rows)})"
        up, down = sum(v > 0 for v in diff), sum(v < 0 for v in diff)
        print(f"| {d[0]} -> {d[1]} | {n} | {ds} | {', '.join(map(str, point))} | {len(rows)} | {top[0]:.3f} -> "
              f"{top[1]:.3f} | {statistics.mean(diff):+.4f} +- {se:.4f} ({up} / {down}) | {ppl[0]:.3f} -> {ppl[1]:.3f} "
              f"| {needles} |")  # fmt: skip


if __name__ == "__main__":
    main()
