"""`ctxrelay bench cost-model`: the gate's predicted TTFT against TTFT measured now, per transport and
length, on texts the profile never timed.

The gate decides from the installed profile (`ctxrelay profile`, a quadratic per component fit to
the lengths it measured). A profile measured on short requests only can keep a long request on
native prefill that a transport would serve faster (issue: predicted from 256-1024-token points, the
quadratic term of qwen-0.5b came out 0). This bench measures, at each length: every model's native
prefill (the profile's own probe: context + a short suffix, first token) and every calibrated edge's
operating points (the relay's components + first token), median of `repeats` after a warm-up, and
writes them beside the profile's prediction. Texts: held-out essays (the profile times training-split
ones). A length past a model's window is clipped to the window minus 64 tokens (smollm2 at 8192).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from ctxrelay.data.datasets import essay_haystack
from ctxrelay.errors import UsageError
from ctxrelay.models.spec import LoadedModel
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.profile import edge_models, measure_native, measure_point
from ctxrelay.results import read_results, write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.plots import plot_path, save_figure
from ctxrelay_bench.runs import bench_options

OPTIONS = {
    "models": "qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m,gemma3-270m",
    "tolerance": 0.15,
    "measured": "",  # an earlier run's results: judge its measurements again with the installed profile (no timing)
}
# `ctxrelay bench cost-model --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "models": "the models whose native prefill and edges are timed (comma list)",
        "tolerance": "largest relative error of a prediction counted as within tolerance",
        "measured": "an earlier run's results: judge its measurements again with the installed profile (no timing)",
    },
)
WINDOW_MARGIN = 64  # probe suffix + a few tokens of tokenizer drift between the text's models


def validation_text(m: LoadedModel, n: int) -> str:
    window = m.spec.context_window
    n = min(n, window - WINDOW_MARGIN) if window else n
    return essay_haystack(m.tokenizer, n, split="heldout", seed=2)


def _row(kind: str, name: str, label: str, n_tokens: int, predicted: float | None, measured: dict, tol: float) -> dict:
    measured_s = sum(measured.values())
    row = {"transport": kind, "model": name, "point": label, "context_tokens": n_tokens, "measured_s": measured_s,
           "components": measured}  # fmt: skip
    if predicted is not None:
        row.update(predicted_s=predicted, error=predicted / measured_s - 1.0)
        row["within_tolerance"] = abs(row["error"]) <= tol
    return row


def edge_points(pool: ModelPool) -> list[tuple]:
    """(edge, point, sender, receiver) of every operating point the gate costs (exact edges need no model)."""
    return [(e, p, *edge_models(pool, e)) for e in pool.graph.edges if not e.exact for p in e.points]


def measure(pool: ModelPool, lengths: Sequence[int], repeats: int, tol: float) -> list[dict]:
    """Predicted vs measured for every model's native prefill and every edge point, at each length."""
    prof = pool.profile
    points = edge_points(pool)
    bar = tqdm(total=len(lengths) * (len(pool.models) + len(points)), desc="cost-model", unit="pt")
    rows = []
    for n in lengths:
        for m in pool.models.values():
            bar.set_postfix_str(f"native {m.spec.name} @ {n}")
            tokens, measured = measure_native(m, validation_text(m, n), repeats)
            cm = prof.native.get(m.spec.weights_hash)
            rows.append(_row("native", m.spec.name, "", tokens, cm.total(tokens) if cm else None, measured, tol))
            bar.update()
        for e, p, sender, receiver in points:
            bar.set_postfix_str(f"{e.label} {p.label} @ {n}")
            window = receiver.spec.context_window
            text = validation_text(sender, min(n, window - 2 * WINDOW_MARGIN) if window else n)
            tokens, measured = measure_point(pool, e, p, text, repeats)
            cm = prof.edges.get(e.point_key(p))
            predicted = cm.total(tokens) if cm else None
            row = _row(e.transport, receiver.spec.name, p.label, tokens, predicted, measured, tol)
            row["sender"] = sender.spec.name
            rows.append(row)
            bar.update()
    bar.close()
    return rows


def predicted_again(pool: ModelPool, earlier: list[dict], tol: float) -> list[dict]:
    """An earlier run's measured rows judged with the installed profile (after a refit of the cost model:
    the measurements stand, only the predictions change). A row the pool cannot place is kept unjudged."""
    prof = pool.profile
    native = {m.spec.name: prof.native.get(m.spec.weights_hash) for m in pool.models.values()}
    edges = {(e.transport, sender.spec.name, receiver.spec.name, p.label): prof.edges.get(e.point_key(p))
             for e, p, sender, receiver in edge_points(pool)}  # fmt: skip
    need = ("transport", "model", "point", "context_tokens", "components")
    if not earlier or any(not isinstance(r, dict) or any(k not in r for k in need) for r in earlier):
        raise UsageError(f"measured=: not the rows of a `bench cost-model` run (each needs {', '.join(need)})")
    rows = []
    for r in earlier:
        key = (r["transport"], r.get("sender", ""), r["model"], r["point"])
        cm = native.get(r["model"]) if r["transport"] == "native" else edges.get(key)
        predicted = cm.total(int(r["context_tokens"])) if cm else None
        row = _row(r["transport"], r["model"], r["point"], int(r["context_tokens"]), predicted, r["components"], tol)
        rows.append({**row, **({"sender": r["sender"]} if "sender" in r else {})})
    return rows


def plot(rows: list[dict], tol: float, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)
    kinds = sorted({r["transport"] for r in rows if "predicted_s" in r})
    for k in kinds:
        xs = [r["measured_s"] for r in rows if r["transport"] == k and "predicted_s" in r]
        ys = [r["predicted_s"] for r in rows if r["transport"] == k and "predicted_s" in r]
        ax.scatter(xs, ys, label=k, s=18)
    lo = min(r["measured_s"] for r in rows) * 0.8
    hi = max(r["measured_s"] for r in rows) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.fill_between([lo, hi], [lo * (1 - tol), hi * (1 - tol)], [lo * (1 + tol), hi * (1 + tol)], color="grey",
                    alpha=0.2, label=f"within {tol:.0%}")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="measured TTFT (s)", ylabel="predicted by the profile (s)",
           title="gate cost model: predicted vs measured")  # fmt: skip
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (1024, 4096, 8192),
    repeats: int = 2,
    out: str = "cost-model",
    options: dict | None = None,
    command: str = "",
) -> Path:
    """Predicted (installed profile) vs measured TTFT -> OUT.json + OUT.png."""
    opts = bench_options("cost-model", options, OPTIONS)
    if sender or receiver:
        raise UsageError("bench cost-model measures every edge among --set models=a,b,c (or --model a,b,c)")
    names = [x for x in (model or str(opts["models"])).split(",") if x]
    pool = ModelPool(names)
    if not pool.profile.native:
        raise UsageError(f"no profile at {pool.profile_path}: run `ctxrelay profile` first (this bench checks it)")
    tol = float(opts["tolerance"])
    if opts["measured"]:  # no timing: the earlier run's measurements, the installed profile's predictions
        rows = predicted_again(pool, read_results(str(opts["measured"]))["rows"], tol)
    else:
        rows = measure(pool, lengths, repeats, tol)
    judged = [r for r in rows if "within_tolerance" in r]
    by_kind = {k: [r for r in judged if r["transport"] == k] for k in sorted({r["transport"] for r in judged})}
    extra = {
        "options": opts, "profile": str(pool.profile_path),
        "profile_lengths": {k[:12]: [n for n, _ in cm.samples] for k, cm in pool.profile.native.items()},
        "within_tolerance": {k: f"{sum(r['within_tolerance'] for r in v)}/{len(v)}" for k, v in by_kind.items()},
        "unprofiled": [f"{r['transport']} {r['model']} {r['point']}".strip() for r in rows if "predicted_s" not in r],
    }  # fmt: skip
    path = write_results(out, rows, command or "ctxrelay bench cost-model", extra)
    plot(rows, tol, plot_path(path))
    return path
