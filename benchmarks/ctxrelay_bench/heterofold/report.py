"""heterofold benchmark results: resuming a stopped run, the summary the issue's bar names, the plot."""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path

from ctxrelay.errors import UsageError
from ctxrelay.results import machine_facts, read_results


def file_sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def reusable_rows(out: str, extra: dict, dirs, methods, art_sha: dict) -> dict[str, tuple[list[dict], dict]]:
    """Receivers an earlier run of this bench finished, with their rows: a long run that stopped,
    or one run per receiver, resumes instead of measuring again. Only a receiver whose every row
    is there, made with the same cases, options, repeats, artifacts (by content) and machine."""
    try:
        doc = read_results(out)
    except (UsageError, ValueError):
        return {}
    same = all(doc.get(k) == extra[k] for k in ("options", "lengths", "repeats", "cases"))
    now, then = machine_facts(), doc.get("machine", {})
    if not same or any(now.get(k) != then.get(k) for k in ("cpu_model", "cores", "torch_threads", "device", "torch")):
        return {}
    cases = [(c["length"], c["dataset"]) for c in extra["cases"]]
    found: dict[str, tuple[list[dict], dict]] = {}
    for rname in dict.fromkeys(r for _, r in dirs):
        want = {("native", "", "text-relay", case) for case in cases}
        want |= {("heterofold", s, m, case) for s, r in dirs if r == rname for m in methods for case in cases}
        got = {}
        for row in doc["rows"]:
            if row.get("receiver") != rname:
                continue
            key = (row["transport"], row.get("sender", ""), row["method"], (row["length"], row["dataset"]))
            if key[0] == "heterofold" and row.get("artifact_sha") != art_sha.get((key[1], rname, key[2])):
                continue
            if key in want:
                got[key] = row
        if set(got) == want:
            found[rname] = (list(got.values()), {"command": doc.get("command"), "written": doc.get("written")})
    return found


def summarize(rows: list[dict]) -> list[dict]:
    """Per direction x method x dataset, pooled over lengths: the numbers the issue's bar names."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["transport"] == "heterofold":
            groups.setdefault((row["sender"], row["receiver"], row["method"], row["dataset"]), []).append(row)
    out = []
    for (s, r, m, ds), rs in groups.items():
        ratios = [x["ppl"]["128"] / x["native_ppl"]["128"] for x in rs if "128" in x["ppl"]]
        timed = {x["length"]: x["speedup"] for x in rs if "speedup" in x}
        out.append(
            {
                "sender": s,
                "receiver": r,
                "method": m,
                "dataset": ds,
                "lengths": sorted(x["length"] for x in rs),
                "top1_agreement": statistics.mean(x["top1_agreement"] for x in rs),
                "kl": statistics.mean(x["kl"] for x in rs),
                "ppl128_ratio": statistics.mean(ratios) if ratios else None,
                # one copy-heavy case can dominate the arithmetic mean of ratios; the geometric mean
                # weighs a 2x gain and a 2x loss alike
                "ppl128_ratio_geomean": statistics.geometric_mean(ratios) if ratios else None,
                "needle_acc": statistics.mean(x["needle_acc"] for x in rs),
                "native_needle_acc": statistics.mean(x["native_needle_acc"] for x in rs),
                "speedup_by_length": {str(k): v for k, v in sorted(timed.items())},
            }
        )
    return out


def plot(rows: list[dict], path: Path) -> Path:
    """Speedup vs length (heterofold), and ppl@128 ratio / top-1 per direction and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ctxrelay_bench.plots import plot_path

    het = [x for x in rows if x["transport"] == "heterofold"]
    dirs = list(dict.fromkeys((x["sender"], x["receiver"]) for x in het))
    methods = list(dict.fromkeys(x["method"] for x in het))
    short = lambda n: n.replace("qwen2.5-coder-", "qw").replace("smollm2-135m", "smol").replace("gemma3-270m", "gem")
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), dpi=110)
    for s, r in dirs:
        pts = sorted((x["length"], x["speedup"]) for x in het if (x["sender"], x["receiver"]) == (s, r) and
                     x["method"] == "heterofold" and "speedup" in x)  # fmt: skip
        if pts:
            axes[0].plot(*zip(*pts, strict=True), marker="o", label=f"{short(s)}->{short(r)}")
    axes[0].axhline(10, color="grey", ls="--", lw=0.8)
    axes[0].set(xscale="log", yscale="log", xlabel="context tokens", ylabel="native TTFT / relay TTFT",
                title="heterofold receiver speedup (same run)")  # fmt: skip
    axes[0].legend(fontsize=7)
    width = 0.8 / max(len(methods), 1)
    for k, (key, ax, label) in enumerate(
        (("ppl", axes[1], "relay ppl@128 / native ppl@128"), ("top1", axes[2], "top-1 agreement with native"))
    ):
        del k
        for mi, m in enumerate(methods):
            vals = []
            for s, r in dirs:
                rs = [x for x in het if (x["sender"], x["receiver"], x["method"]) == (s, r, m)]
                if key == "ppl":
                    v = [x["ppl"]["128"] / x["native_ppl"]["128"] for x in rs if "128" in x["ppl"]]
                else:
                    v = [x["top1_agreement"] for x in rs]
                mean = statistics.geometric_mean if key == "ppl" else statistics.mean
                vals.append(mean(v) if v else float("nan"))
            ax.bar([i + mi * width for i in range(len(dirs))], vals, width, label=m)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(dirs))])
        ax.set_xticklabels([f"{short(s)}->{short(r)}" for s, r in dirs], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    axes[1].axhline(1.3, color="grey", ls="--", lw=0.8)
    axes[1].set_yscale("log")
    axes[1].set_title("continuation perplexity vs native (geo mean: lengths, datasets)")
    axes[2].axhline(0.8, color="grey", ls="--", lw=0.8)
    axes[2].set_title("next-token top-1 agreement vs native")
    fig.tight_layout()
    out = plot_path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
