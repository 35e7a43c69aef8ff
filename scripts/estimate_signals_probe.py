"""Probe: would a per-request estimate over all signals rank requests better than the one signal it uses?

    python scripts/estimate_signals_probe.py

No model runs. The shipped heterofold artifacts keep the recompute stage's rows (per calibration text
and fraction f: top-1 agreement and every signal relay_prefill measures); the frontier results keep the
same signals per held-out request. For each direction with a held-out run of its shipped artifact,
three estimates are fitted on the calibration rows of one setting (length, hiding) and judged two ways:
left out (leave one text out, fit on the rest, Spearman of the left-out estimates with top-1 per f,
averaged) and held out (fit on all, Spearman per f on the frontier's requests):
  - each signal alone, a least-squares line on values centred per f (the shipped estimate's form);
  - ridge over every signal that varies (standardised, centred per f; penalty alpha * n), and the same
    without hiding_gap (a second receiver pass) and without the tail signals (the LM head over the tail).
Prints one line per estimate and the setting's shipped signal with its left-out Spearman.
"""

import json
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from ctxrelay.bench.heterofold_frontier import _artifact as installed_artifact
from ctxrelay.transports.heterofold.recompute import SIGNALS

ROOT = Path(__file__).resolve().parent.parent
CASES = [  # sender, receiver, tokens, hidden layers, held-out run of the shipped artifact
    ("qwen2.5-coder-1.5b", "gemma3-270m", 4096, 0, "heterofold-frontier-q15g3-sr128-seed200"),
    ("smollm2-135m", "gemma3-270m", 4096, 0, "heterofold-frontier-s2g3-seed200"),  # the translator before 12-06
    ("smollm2-135m", "gemma3-270m", 4096, 0, "heterofold-frontier-s2g3-long-nohide-seed400"),
    ("smollm2-135m", "gemma3-270m", 4096, 0, "heterofold-frontier-s2g3-seed500"),
    ("gemma3-270m", "qwen2.5-coder-0.5b", 4096, 0, "heterofold-frontier-g3q05-seed300-own1"),
    ("gemma3-270m", "qwen2.5-coder-0.5b", 2048, 0, "heterofold-frontier-g3q05-seed300-own1"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 4096, 12, "heterofold-frontier-q05-seed300"),
]


def features(rows: list[dict], sigs: list[str]) -> np.ndarray:
    return np.array([[float(x[s]) for s in sigs] for x in rows])


def fit(rows: list[dict], sigs: list[str], alpha: float) -> dict:
    centres, xs, ys = {}, [], []
    for f in sorted({r["f"] for r in rows}):
        part = [r for r in rows if r["f"] == f]
        x, y = features(part, sigs), np.array([r["top1_agreement"] for r in part])
        centres[f] = (x.mean(0), y.mean())
        xs.append(x - x.mean(0))
        ys.append(y - y.mean())
    x, y = np.vstack(xs), np.concatenate(ys)
    sd = x.std(0) + 1e-12
    z = x / sd
    w = np.linalg.solve(z.T @ z + alpha * len(y) * np.eye(z.shape[1]), z.T @ y)
    return {"sd": sd, "w": w, "centres": centres}


def predict(model: dict, f: float, x: np.ndarray) -> float:
    mx, my = model["centres"][min(model["centres"], key=lambda k: abs(k - f))]
    return my + float(((x - mx) / model["sd"]) @ model["w"])


def rho(a, b) -> float:
    return float(spearmanr(a, b).statistic)


def left_out(rows: list[dict], sigs: list[str], alpha: float) -> float:
    est = {}
    for t in sorted({r["text"] for r in rows}):
        model = fit([r for r in rows if r["text"] != t], sigs, alpha)
        est |= {i: predict(model, r["f"], features([r], sigs)[0]) for i, r in enumerate(rows) if r["text"] == t}
    per_f = []
    for f in sorted({r["f"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["f"] == f]
        per_f.append(rho([est[i] for i in idx], [rows[i]["top1_agreement"] for i in idx]))
    return float(np.mean(per_f))


def held_out(model: dict, rows: list[dict], sigs: list[str]) -> str:
    out = []
    for f in sorted({r["f"] for r in rows}):
        part = [r for r in rows if r["f"] == f]
        est = [predict(model, f, features([r["continuation_info"]], sigs)[0]) for r in part]
        out.append(f"f={f}: {rho(est, [r['top1_agreement'] for r in part]):+.2f} over {len(part)}")
    return ", ".join(out)


def main() -> None:
    for sender, receiver, tokens, hide, run in CASES:
        art = installed_artifact(sender, receiver)
        stage_rows = art.params["recompute_stage"]["rows"]
        rows = [x for x in stage_rows if x["f"] > 0 and int(x.get("tokens", 2048)) == tokens
                and int(x.get("hide_translated", 0)) == hide]  # fmt: skip
        results = json.loads((ROOT / f"benchmarks/results/{run}.json").read_text())
        held = [x for x in results["rows"] if x["f"] > 0 and x["length"] == tokens and x["sender"] == sender
                and x["receiver"] == receiver and "continuation_info" in x]  # fmt: skip
        sigs = [s for s in SIGNALS if all(s in x for x in rows) and np.ptp([x[s] for x in rows]) > 1e-6]
        sigs = [s for s in sigs if all(s in x["continuation_info"] for x in held)]
        setting = f"{tokens}+hide{hide}" if hide else str(tokens)
        used = art.quality["estimate"].get("by_setting", {}).get(setting, {})
        print(f"\n{sender} -> {receiver} at {setting}: {len(rows)} calibration rows, {len(held)} held-out ({run})")
        print(f"  shipped estimate: {used.get('signal')}, left out {used.get('cv_spearman', float('nan')):+.2f}")
        variants = {s: [s] for s in sigs}
        variants["ridge, all signals"] = sigs
        variants["ridge, no hiding_gap"] = [s for s in sigs if s != "hiding_gap"]
        variants["ridge, no hiding_gap or tail"] = [
            s for s in sigs if s not in ("hiding_gap", "tail_nll", "tail_confidence")
        ]
        for name, use in variants.items():
            alpha = 0.0 if len(use) == 1 else 0.1
            judged = held_out(fit(rows, use, alpha), held, use)
            print(f"  {name:30s} left out {left_out(rows, use, alpha):+.2f}; held out {judged}")


if __name__ == "__main__":
    main()
