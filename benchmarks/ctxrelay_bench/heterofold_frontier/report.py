"""heterofold recompute frontier: resuming a run, the per-point summary, the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ctxrelay.errors import UsageError
from ctxrelay.results import machine_facts, read_results, results_file
from ctxrelay.transports.heterofold.hiding import hide_code, hide_last, point_label
from ctxrelay_bench.heterofold_frontier.targets import verdict
from ctxrelay_bench.runs import markdown_table as _markdown

SAME_MACHINE = ("cpu_model", "cores", "torch_threads", "device", "torch")


def reusable(out: str, extra: dict) -> dict | None:
    """An earlier run's results with the same cases, options, repeats and machine (any directions),
    whose rows this run keeps; None when there is no earlier file. An earlier file this run cannot
    extend is refused, naming what differs: starting over would overwrite its rows with this run's
    (a resume at other torch threads once dropped every row of the frontier that way)."""
    path = results_file(out)
    if not path.exists():
        return None
    try:
        doc = read_results(path)
    except ValueError as e:
        raise UsageError(f"{path} is not a readable results file ({e}); move it away or --set resume=false") from None
    now, then = machine_facts(), doc.get("machine", {})
    differs = [k for k in ("options", "lengths", "repeats", "cases") if doc.get(k) != extra[k]]
    differs += [f"{k} ({then.get(k)} then, {now.get(k)} now)" for k in SAME_MACHINE if now.get(k) != then.get(k)]
    if differs:
        raise UsageError(
            f"{path} holds rows of a run this one cannot extend (it differs in {', '.join(differs)}); "
            "rerun with the same settings, or pick another --out, or --set resume=false to overwrite it"
        )
    return doc


def measured_before(out: str, cases: list[dict], dirs: list[tuple[str, str]]) -> list[str]:
    """Which of these requests (by context) other frontier results files already measured in a direction
    of this run: one line per such direction, naming the requests and the files. Such a run is not a fresh
    held-out sample there. Seeds repeat requests far apart: a needle case is fixed by (seed + i) mod 40
    (10 held-out essays to start the haystack at, 8 facts) with i's depth and wording, so seeds 40 apart
    give the same requests, and every run at one length continues the same 10 essay texts; ShareGPT
    haystacks start at conversation 7 (seed + j + length) of 400, so seeds 400 apart repeat."""
    here = results_file(out).resolve()
    mine = {c["context_sha"]: c["key"] for c in cases}
    shared: dict[tuple[str, str], tuple[set, list]] = {}
    for path in sorted(here.parent.glob("heterofold-frontier*.json")):
        if path.resolve() == here:
            continue
        try:
            doc = read_results(path)
        except ValueError:
            continue
        keys = {mine[c["context_sha"]] for c in doc.get("cases", []) if c.get("context_sha") in mine}
        if not keys:
            continue
        for d in {(x["sender"], x["receiver"]) for x in doc.get("rows", [])} & set(dirs):
            seen, files = shared.setdefault(d, (set(), []))
            seen |= keys
            files.append(path.stem)
    lines = []
    for (s, r), (keys, files) in sorted(shared.items()):
        named = ", ".join(sorted(keys)[:3]) + (", ..." if len(keys) > 3 else "")
        where = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        lines.append(f"{len(keys)} of these {len(cases)} requests ({named}) were measured for {s} -> {r} before "
                     f"(in {where}): not a fresh sample there")  # fmt: skip
    return lines


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _geo(xs) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows: list[dict]) -> list[dict]:
    """Per direction x length x point: needle accuracy (and native's), continuation top-1 / KL /
    ppl@128 ratio (geometric mean) per dataset, the recompute fraction run, the TTFT speedup."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["sender"], row["receiver"], row["length"], row["selection"], row["f"]), []).append(row)
    timing = {k: [x for x in rs if x.get("kind") == "timing"] for k, rs in groups.items()}
    groups = {k: [x for x in rs if x.get("kind") != "timing"] for k, rs in groups.items()}
    out = []
    for (s, r, n, rule, f), rs in sorted(groups.items(), key=lambda kv: (kv[0][:3], kv[0][4], kv[0][3])):
        needles = [x for x in rs if x["dataset"] == "needle"]
        item = {"sender": s, "receiver": r, "length": n, "selection": rule, "f": f,
                "recompute_fraction": _mean(x.get("recompute_fraction") for x in rs),
                "needle_acc": _mean(x.get("needle_acc") for x in needles),
                "native_needle_acc": _mean(x.get("native_needle_acc") for x in needles),
                "needle_cases": len(needles)}  # fmt: skip
        for ds, label in (("needle", "essays"), ("sharegpt", "sharegpt")):
            part = [x for x in rs if x["dataset"] == ds]
            if part:
                item[f"{label}_top1"] = _mean(x["top1_agreement"] for x in part)
                item[f"{label}_kl"] = _mean(x["kl"] for x in part)
                item[f"{label}_ppl128_ratio"] = _geo(
                    x["ppl"]["128"] / x["native_ppl"]["128"] for x in part if "128" in x["ppl"]
                )
                item[f"{label}_cases"] = len(part)
        timed = timing[(s, r, n, rule, f)]
        if timed:
            item["speedup"] = statistics.median(x["speedup"] for x in timed)
            item["relay_ttft_s"] = statistics.median(x["relay_ttft_s"] for x in timed)
            item["native_ttft_s"] = statistics.median(x["native_ttft_s"] for x in timed)
        out.append({k: v for k, v in item.items() if v is not None})
    return out


def estimate_check(rows: list[dict], estimators: dict[tuple[str, str], dict]) -> list[dict]:
    """How well each artifact's per-request estimate ranks held-out requests: Spearman of the estimate
    against per-request top-1 agreement (continuations) and needle correctness (questions), per
    direction, fraction of the default rule, length and hiding (with the signal of that setting's
    estimate and whether the gate acts on it), and per fraction pooled over directions."""
    from scipy.stats import spearmanr

    from ctxrelay.transports.heterofold.recompute.estimate import estimate, estimate_model, trusts

    def rho(pairs):
        if len(pairs) < 4 or len({p[0] for p in pairs}) < 2 or len({p[1] for p in pairs}) < 2:
            return None
        return float(spearmanr([p[0] for p in pairs], [p[1] for p in pairs]).statistic)

    out, pooled = [], {}
    for (s, r), model in sorted(estimators.items()):
        if not model:
            continue
        mine = [x for x in rows if (x["sender"], x["receiver"]) == (s, r) and x.get("kind") != "timing"
                and x.get("selection") == model.get("rule", "mix") and x["f"] > 0]  # fmt: skip
        settings = {(x["f"], x["length"], x.get("hide_translated", 0)) for x in mine}
        for f, n, hide in sorted(settings, key=hide_last):
            part = [x for x in mine if (x["f"], x["length"], x.get("hide_translated", 0)) == (f, n, hide)]
            cont = [(estimate(model, _info(x, "continuation_info")), x["top1_agreement"]) for x in part]
            cont = [(e, y) for e, y in cont if e is not None]
            qa = [(e, x["needle_acc"]) for x in part
                  if "needle_acc" in x and (e := estimate(model, _info(x, "question_info"))) is not None]  # fmt: skip
            pooled.setdefault(f, ([], []))
            pooled[f][0].extend(cont)
            pooled[f][1].extend(qa)
            sub = estimate_model(model, n, hide) or {}  # the estimate of this setting (where fitted per setting)
            out.append({"sender": s, "receiver": r, "f": f, "length": n, "hide_translated": hide,
                        "signal": sub.get("signal"), "trusted": trusts(model, n, hide), "requests": len(cont),
                        "spearman_top1": rho(cont), "questions": len(qa), "spearman_needle": rho(qa)})  # fmt: skip
    for f, (cont, qa) in sorted(pooled.items()):
        out.append({"sender": "all", "receiver": "all", "f": f, "requests": len(cont), "spearman_top1": rho(cont),
                    "questions": len(qa), "spearman_needle": rho(qa)})  # fmt: skip
    return [{k: v for k, v in x.items() if v is not None} for x in out]


def plot(rows: list[dict], path: Path) -> Path:
    """Needle accuracy and top-1 agreement vs TTFT speedup, one column per direction, one line per
    rule through its fractions (longest length; quality pooled over lengths)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from ctxrelay.transports.heterofold.recompute.rules import RULES

    colors = {rule: f"C{i}" for i, rule in enumerate(RULES)}  # one colour per rule in every column
    summary = summarize(rows)
    dirs = sorted({(x["sender"], x["receiver"]) for x in summary})
    longest = max(x["length"] for x in summary)
    timed = any("speedup" in x for x in summary)  # a quality-only run plots against f instead
    fig, axes = plt.subplots(2, len(dirs), figsize=(3.6 * len(dirs), 6.4), dpi=110, squeeze=False)
    for col, (s, r) in enumerate(dirs):
        pts = [x for x in summary if (x["sender"], x["receiver"]) == (s, r)]
        speed = {(x["selection"], x["f"]): x.get("speedup") if timed else x["f"] for x in pts if x["length"] == longest}
        for row_i, (metric, label) in enumerate((("needle_acc", "needle accuracy"), ("essays_top1", "top-1 (essays)"))):
            ax = axes[row_i][col]
            for rule in sorted({x["selection"] for x in pts}):
                xs, ys = [], []
                for f in sorted({x["f"] for x in pts if x["selection"] == rule}):
                    vals = [x[metric] for x in pts if x["selection"] == rule and x["f"] == f and metric in x]
                    sp = speed.get((rule, f))
                    if vals and sp:
                        xs.append(sp)
                        ys.append(sum(vals) / len(vals))
                style = {"marker": "o", "color": colors.get(rule)}
                if rule == "none":
                    style = {"marker": "*", "ms": 12, "color": "black"}
                ax.plot(xs, ys, label="f = 0" if rule == "none" else rule, **style)
            if metric == "needle_acc":
                nat = [x["native_needle_acc"] for x in pts if "native_needle_acc" in x]
                if nat:
                    ax.axhline(sum(nat) / len(nat), color="grey", ls="--", lw=1, label="native")
            if timed:  # plain numbers on a log axis: the interesting range is 1.5x-25x
                ax.set_xscale("log")
                top = max((v for v in speed.values() if v), default=1.0)
                ax.set_xticks([t for t in (1, 2, 3, 5, 10, 20, 30) if t <= 1.5 * top])
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(f"TTFT speedup at {longest} tokens (x)" if timed else "recompute fraction f")
            ax.set_ylabel(label)
            ax.set_title(f"{s} -> {r}", fontsize=8)
            ax.grid(alpha=0.3)
    legend = {}  # one legend for every rule of any column
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(legend), fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out = Path(path).with_suffix(".png")
    fig.savefig(out)
    plt.close(fig)
    return out


def _candidates(points: list[dict], timing: dict, key: tuple, threshold: float, margin: float) -> list[tuple]:
    """(rule, f, hide, relay_s, native_s, top1) of the points passing the gate's checks, in the gate's
    order (expected TTFT, gate.decide): calibrated top-1 at the key's length and (where the artifact
    measured it) fact recall at the threshold, measured TTFT beating native by the margin, also counting
    the relays a trusted per-request estimate refused on the calibration texts."""
    from ctxrelay.relay.gate import expected_with_refusals, quality_at, quality_refusal

    out = []
    for p in points:
        p = quality_at(p, key[2])
        hide = hide_code(p.get("hide_translated", 0))  # rows measured the way the gate serves the point
        t = timing.get((*key, p["selection"], p["f"], hide))
        if not t or quality_refusal(p, threshold) is not None:
            continue
        expected = t["relay_ttft_s"]
        if p.get("calibrated_estimates"):
            expected = expected_with_refusals(
                t["relay_ttft_s"], t["native_ttft_s"], p["calibrated_estimates"], threshold
            )[0]
        if expected * margin < t["native_ttft_s"]:
            out.append((expected, (p["selection"], p["f"], hide, t["relay_ttft_s"], t["native_ttft_s"],
                                   p["top1_agreement"])))  # fmt: skip
    return [c for _, c in sorted(out, key=lambda x: x[0])]


def _points(params: dict, quality: dict) -> list[dict]:
    """An artifact's recompute points as the gate sees them (the transport's operating points: the fact
    stage's fields at each f, per-length quality where the stage ran at several lengths), by f."""
    from ctxrelay.transports.heterofold import transport

    return [p["quality"] for p in transport.operating_points(params, quality) if p["options"]]


def _replay(cands: list[tuple], by_case: dict, key: tuple, model: dict | None, threshold: float) -> dict:
    """One request through the gate and the relay layer: the first candidate (in the gate's order) whose
    estimate passes, skipping those calibrated no better than one it refused, else native."""
    from ctxrelay.transports.heterofold.recompute.estimate import estimate, trusts

    native = by_case.get((*key, "none", 0.0, 0), {})
    spent, low = 0.0, -1.0  # low: the best calibrated top-1 the estimate refused for this request
    for rule, f, hide, relay_s, native_s, top1 in cands:
        if top1 <= low:  # the relay layer skips a point calibrated no better than a refused one
            continue
        row = by_case.get((*key, rule, f, hide))
        if row is None:  # every candidate beats native by the margin: a refused one's time is spent either way
            break
        spent += relay_s
        e = estimate(model, _info(row, "question_info" if row.get("question_info") else "continuation_info"))
        # the gate refuses a relay whose first token ends the text: an empty answer
        empty = row.get("dataset") == "needle" and row.get("answer") is not None and not row["answer"].strip()
        trusted = trusts(model, row.get("context_tokens"), hide)
        if (e is None or not trusted or e >= threshold) and not empty:
            ratio = row["ppl"]["128"] / row["native_ppl"]["128"] if "128" in row["ppl"] else None
            return {"point": point_label(f, rule, hide), "ttft_s": spent, "native_ttft_s": native_s,
                    "top1": row["top1_agreement"], "needle": row.get("needle_acc"), "ppl_ratio": ratio,
                    "native_needle": native.get("native_needle_acc"), "dataset": native.get("dataset")}  # fmt: skip
        if e is not None and trusted and e < threshold:
            low = max(low, top1)
    native_s = cands[0][4] if cands else None
    return {"point": "native", "ttft_s": spent + native_s if native_s else None, "native_ttft_s": native_s,
            "top1": 1.0, "needle": native.get("native_needle_acc"), "ppl_ratio": 1.0,
            "native_needle": native.get("native_needle_acc"), "dataset": native.get("dataset")}  # fmt: skip


def gate_replay(rows: list[dict], artifacts: dict, threshold: float, margin: float) -> list[dict]:
    """The gate's default decision, replayed per request on the measured rows; `artifacts` maps each
    (sender, receiver) to its artifact's (params, quality).

    Per direction and length: the operating points whose calibrated top-1 (the artifact's recompute
    table) and fact recall (where the fact stage ran) meet `threshold` and whose measured TTFT (timing
    rows) beats native by `margin`, by expected TTFT (refusals counted) as the gate orders them. Per
    request: relay at the first; accept when the artifact's estimate for that request (from the row's
    signals; where the gate trusts it) meets the threshold and the answer is not empty (the gate refuses
    a relay whose first token ends the text), else pay that relay and try the next candidate (each beats
    native by the margin) that is calibrated better than any the estimate refused, else native prefill.
    Answers, top-1 and TTFT come from the rows of the points tried."""
    timing = {_point_key(x): x for x in rows if x.get("kind") == "timing"}
    quality = [x for x in rows if x.get("kind") != "timing"]
    by_case = {(x["sender"], x["receiver"], x["case_key"], x["selection"], x["f"], x.get("hide_translated", 0)): x
               for x in quality}  # fmt: skip
    out = []
    for (s, r), (params, q) in sorted(artifacts.items()):
        points = _points(params, q)
        for n in sorted({x["length"] for x in quality if (x["sender"], x["receiver"]) == (s, r)}):
            cands = _candidates(points, timing, (s, r, n), threshold, margin)
            cases = sorted({x["case_key"] for x in quality if (x["sender"], x["receiver"], x["length"]) == (s, r, n)})
            res = [_replay(cands, by_case, (s, r, ck), q.get("estimate"), threshold) for ck in cases]
            needles = [x for x in res if x["native_needle"] is not None]
            timed = [x for x in res if x["ttft_s"]]
            item = {"sender": s, "receiver": r, "length": n, "threshold": threshold, "requests": len(res),
                    "points": {p: sum(1 for x in res if x["point"] == p) for p in sorted({x["point"] for x in res})},
                    "needle_cases": len(needles), "needle_acc": _mean(x["needle"] for x in needles),
                    "native_needle_acc": _mean(x["native_needle"] for x in needles)}  # fmt: skip
            for ds, label in (("needle", "essays"), ("sharegpt", "sharegpt")):
                part = [x for x in res if x["dataset"] == ds]
                item[f"{label}_top1"] = _mean(x["top1"] for x in part)
                item[f"{label}_ppl128_ratio"] = _geo(x["ppl_ratio"] for x in part)
            if timed:
                native_s = statistics.median(x["native_ttft_s"] for x in timed)
                item["speedup"] = native_s / statistics.mean(x["ttft_s"] for x in timed)
            out.append({k: v for k, v in item.items() if v is not None})
    return out


def _info(row: dict, which: str) -> dict:
    """A row's relay signals with the fraction asked for, the context length and the hiding (what the
    estimate is centred on)."""
    setting = {"requested_fraction": row["f"], "context_tokens": row.get("context_tokens"),
               "hide_translated": row.get("hide_translated", 0)}  # fmt: skip
    return {**setting, **row.get(which, {})}


def _point_key(x: dict) -> tuple:
    return x["sender"], x["receiver"], x["length"], x["selection"], x["f"], x.get("hide_translated", 0)


def _cell(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _needles(x: dict) -> str:
    n = x.get("needle_cases", 0)
    if not n:
        return "-"
    return f"{round(x['needle_acc'] * n)}/{n} ({round(x.get('native_needle_acc', 0) * n)})"


GATE_HEADS = ["direction", "tokens", "requests", "gate chose", "needles (native)", "essays top-1", "essays ppl x",
              "sharegpt top-1", "sharegpt ppl x", "speedup", "targets"]  # fmt: skip


def gate_row(x: dict) -> list[str]:
    """One gate-replay entry as a table row, ending with what the faithful relay's targets say of it."""
    return [f"{x['sender']} -> {x['receiver']}", str(x["length"]), str(x["requests"]),
            ", ".join(f"{p} x{k}" for p, k in x["points"].items()), _needles(x), _cell(x.get("essays_top1")),
            _cell(x.get("essays_ppl128_ratio")), _cell(x.get("sharegpt_top1")), _cell(x.get("sharegpt_ppl128_ratio")),
            _cell(x.get("speedup"), ".1f"), verdict(x)]  # fmt: skip


def tables(doc: dict, rules: set[str] | None = None) -> str:
    """The run as three markdown tables: the frontier (points of `rules`, all when None), the gate's
    default decision replayed per request, and how the per-request estimate ranks requests."""
    frontier = [
        [f"{x['sender']} -> {x['receiver']}", str(x["length"]), x["selection"], f"{x['f']:.2f}",
         _cell(x.get("recompute_fraction"), ".3f"), _needles(x), _cell(x.get("essays_top1")),
         _cell(x.get("essays_ppl128_ratio")), _cell(x.get("sharegpt_top1")),
         _cell(x.get("sharegpt_ppl128_ratio")), _cell(x.get("speedup"), ".1f")]
        for x in doc.get("summary", []) if rules is None or x["selection"] in rules
    ]  # fmt: skip
    gate = [gate_row(x) for x in doc.get("gate", [])]
    est = [
        [f"{x['sender']} -> {x['receiver']}", f"{x['f']:.2f}", str(x.get("length", "-")),
         str(x.get("hide_translated", "-")), x.get("signal", _pooled(x)),
         {True: "yes", False: "no"}.get(x.get("trusted"), "-"), str(x["requests"]),
         _cell(x.get("spearman_top1")), str(x["questions"]), _cell(x.get("spearman_needle"))]
        for x in doc.get("estimate_check", [])
    ]  # fmt: skip
    quality = ["essays top-1", "essays ppl x", "sharegpt top-1", "sharegpt ppl x", "speedup"]
    lines = _markdown(["direction", "tokens", "rule", "f", "run f", "needles (native)", *quality], frontier)
    lines += ["", *_markdown(GATE_HEADS, gate)]
    heads = ["direction", "f", "tokens", "hide", "signal", "trusted", "requests", "Spearman top-1", "questions",
             "Spearman needle"]  # fmt: skip
    lines += ["", *_markdown(heads, est)]
    cal = [
        [f"{x['sender']} -> {x['receiver']}", f"{x['f']:.2f}", str(x.get("tokens", 2048)),
         _cell(x.get("top1_agreement"), ".3f"),
         "-" if x.get("native_right") is None else f"{x['kept']}/{x['native_right']} of {x['cases']}",
         _cell(x.get("fact_recall")), "yes" if x["passes"] else "no"]
        for x in doc.get("calibrated", [])
    ]  # fmt: skip
    heads = ["direction", "f", "tokens", "calibrated top-1", "facts kept", "fact recall", "passes the gate's quality"]
    lines += ["", *_markdown(heads, cal)]
    return "\n".join(lines)


def _pooled(x: dict) -> str:
    return f"(pooled, {x['directions']} directions)" if "directions" in x else "(pooled)"


def calibrated_points(artifacts: dict, threshold: float) -> list[dict]:
    """Per direction ((sender, receiver) -> the artifact's (params, quality)), f and calibrated length of
    the artifact's recompute table: calibrated top-1, the fact stage's counts, and whether the point
    passes the gate's quality checks at `threshold` (before cost) for requests of that length."""
    from ctxrelay.relay.gate import quality_at, quality_refusal

    out = []
    for (s, r), (params, q) in sorted(artifacts.items()):
        for p in _points(params, q):
            hide = {"hide_translated": p["hide_translated"]} if p.get("hide_translated") else {}
            for n in [x["tokens"] for x in p.get("by_tokens", [])] or [p["tokens"]]:
                at = quality_at(p, n)
                counts = {k: at[k] for k in ("cases", "native_right", "kept", "fact_recall") if at.get(k) is not None}
                out.append({"sender": s, "receiver": r, "f": p["f"], **hide, "tokens": n,
                            "top1_agreement": at["top1_agreement"],
                            "passes": quality_refusal(at, threshold) is None, **counts})  # fmt: skip
    return out
