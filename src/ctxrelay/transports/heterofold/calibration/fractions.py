"""The faithful mode's calibration: quality at each recompute fraction, and a per-request estimate.

For an existing artifact, on calibration texts (prompts only: the receiver's own native prefill is
the reference) of about the length the relay serves: relay each context at every fraction f of the
default selection rule, teacher-force the text's true continuation, and record top-1 agreement and
KL against native per text, together with the cheap signals relay_prefill reports (recompute.py /
transfer.py). The result goes into the artifact's quality:

  quality["recompute"]  one entry per f: pooled top-1 agreement and KL (the gate's operating points)
  quality["estimate"]   the signal whose per-text ranking follows per-text top-1 agreement best
                        (Spearman, pooled over the fractions), with a least-squares line signal ->
                        top-1, and cv_spearman, how it ranks texts left out of its fit: relay_prefill
                        reports info["estimate"] for every request from it where cv_spearman is high
                        enough for the gate to act on it, else info["estimate_unused"]
"""

from __future__ import annotations

from pathlib import Path

import torch
from scipy.stats import spearmanr
from tqdm import tqdm

from ctxrelay.artifact import Artifact
from ctxrelay.metrics import PooledQuality, position_agreement
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.heterofold.calibration import heldout
from ctxrelay.transports.heterofold.hiding import Hide, hide_code, hide_last
from ctxrelay.transports.heterofold.recompute.estimate import estimate
from ctxrelay.transports.heterofold.recompute.recompute_pass import SIGNALS
from ctxrelay.transports.heterofold.recompute.settings import Setting, row_tokens
from ctxrelay.transports.heterofold.transfer import relay_prefill

DEFAULT_RULE = "mix"


def fit_estimate(rows: list[dict], cross_validate: bool = True) -> dict:
    """The per-request estimate: the signal whose ranking of texts follows their top-1 agreement best
    AT A FIXED f AND SETTING (mean Spearman over the (f, length, hiding) groups; pooled over fractions f
    itself would explain it), and one slope fitted on the signal and top-1 centred per group. estimate =
    the calibrated mean top-1 at f (length, hiding) + slope * (signal - its mean there). Centres per
    length matter: into qwen-0.5b the mean top-1 at f = 0.3 falls from 2048 to 4096 tokens while the
    signal barely moves, so centres from one length rank a mix of lengths badly; per hiding too, as the
    same f hiding 12 layers and hiding none are two operating points with their own means."""
    groups = sorted({_group(r) for r in rows}, key=hide_last)
    best = None
    for sig in SIGNALS:
        rhos, xs, ys, settings = [], [], [], {}
        for g in groups:
            part = [(float(r[sig]), float(r["top1_agreement"])) for r in rows if _group(r) == g and sig in r]
            if len(part) < 4 or not _varies([x for x, _ in part]) or len({y for _, y in part}) < 2:
                continue
            rhos.append(float(spearmanr([x for x, _ in part], [y for _, y in part]).statistic))
            mx, my = sum(x for x, _ in part) / len(part), sum(y for _, y in part) / len(part)
            settings.setdefault(Setting(g[1], g[2]).key, {})[str(g[0])] = [mx, my]
            xs += [x - mx for x, _ in part]
            ys += [y - my for _, y in part]
        if not rhos or not any(xs):
            continue
        rho = sum(rhos) / len(rhos)
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        if best is None or abs(rho) > abs(best["spearman"]):
            # the first setting: what readers without per-setting centres use
            first = settings[min(settings, key=lambda k: hide_last(Setting.parse(k)))]
            best = {"signal": sig, "slope": slope, "centres": first, "spearman": rho, "texts": len(xs)}
            if len(settings) > 1:
                best["lengths"] = settings
    if best and cross_validate:
        best["cv_spearman"] = left_out_spearman(rows)
    return best or {}


def _group(row: dict) -> tuple[float, int, Hide]:
    """(f, context length, hiding) of a recompute-stage row: one operating point's texts."""
    return row["f"], row_tokens(row), hide_code(row.get("hide_translated", 0))


def left_out_spearman(rows: list[dict]) -> float | None:
    """How well the estimate ranks calibration texts it was not fitted on: leave one text out (at every
    hiding it was measured with), choose the signal and fit the line on the others, estimate the
    left-out text; then Spearman of those estimates with top-1 agreement per (f, length, hiding) group,
    averaged. The gate trusts this, not the in-sample figure: choosing the best of several signals on 24
    texts overfits. Measured: into qwen-0.5b in-sample |Spearman| 0.53, left out 0.21; on held-out
    requests 0.38-0.47, where acting on it refused 6 of 8 needle questions at f = 0.3 that the relay
    answered right, each after paying for the relay."""
    keys = [(r.get("text", i), row_tokens(r)) for i, r in enumerate(rows)]  # a row without a text id: its own
    held: dict[int, float] = {}
    for t in sorted(set(keys)):
        model = fit_estimate([r for r, k in zip(rows, keys, strict=True) if k != t], cross_validate=False)
        for i, r in enumerate(rows):
            if keys[i] == t:
                e = estimate(model, {**r, "requested_fraction": r["f"], "context_tokens": row_tokens(r)})
                if e is not None:
                    held[i] = e
    rhos = []
    for g in sorted({_group(r) for r in rows}, key=hide_last):
        part = [(held[i], float(r["top1_agreement"])) for i, r in enumerate(rows) if i in held and _group(r) == g]
        if len(part) >= 4 and len({e for e, _ in part}) > 1 and len({y for _, y in part}) > 1:
            rhos.append(float(spearmanr([e for e, _ in part], [y for _, y in part]).statistic))
    return sum(rhos) / len(rhos) if rhos else None


def _varies(xs: list[float]) -> bool:
    """Whether a signal tells texts apart at all. With a shared tokenizer exact_share is 1 - 1/n (every
    token end shared but the last): it ranks texts by their token count alone and once won the
    signal choice on noise (Spearman 0.54 in sample, -0.22 held out)."""
    return max(xs) - min(xs) > 1e-3 * max(abs(x) for x in xs)


@torch.inference_mode()
def calibrate_recompute(
    sender: LoadedModel,
    receiver: LoadedModel,
    artifact: Artifact,
    texts: list[str],
    fractions: list[float],
    rule: str = DEFAULT_RULE,
    suffix_tokens: int = 129,
    tokens: int = 2048,
    hide: Hide = 0,
    cache: Path | None = None,
) -> dict:
    """{"recompute": [...], "estimate": {...}, "recompute_rows": [...]} for the artifact's quality; rows
    and table entries carry `tokens`, the context length the texts were cut to. `cache`: a folder that
    keeps each text's sender state and native reference (quality.make_item) for the next run."""
    items = [heldout.make_item(sender, receiver, t, suffix_tokens, cache) for t in tqdm(texts, desc="recompute items")]
    table, rows = [], []
    for f in fractions:
        pooled = PooledQuality()
        for i, it in enumerate(tqdm(items, desc=f"recompute f={f}", leave=False)):
            kw = {"recompute": f, "selection": rule, "query": "", "hide_translated": hide if f else 0}  # no query
            out = relay_prefill(receiver, it.state, artifact, it.suffix, logits="all", signals="all", **kw)
            lp = torch.log_softmax(out.logits[:-1].float(), -1)
            pooled.add(it.native_logprobs, lp, it.suffix[1:])
            agree = float(position_agreement(it.native_logprobs, lp).mean())
            row = {"text": i, "f": f, "tokens": tokens, "hide_translated": hide if f else 0,
                   "top1_agreement": agree}  # fmt: skip
            row.update({k: out.info[k] for k in SIGNALS if k in out.info})
            row["recompute_fraction"] = out.info.get("recompute_fraction", 0.0)
            rows.append(row)
        res = pooled.result(heldout.HORIZONS)
        hidden = {"hide_translated": hide if f else 0}
        table.append({"f": f, "selection": rule, "tokens": tokens, **hidden, **res, "texts": len(items)})
    return {"recompute": table, "estimate": estimate_entry(rows, rule), "recompute_rows": rows}


def estimate_entry(rows: list[dict], rule: str) -> dict:
    """The artifact's quality["estimate"] from the recompute stage's per-text rows (f = 0 has no signals):
    one estimate pooled over the stage's settings, and one per setting (length, hiding) in "by_setting",
    each with its own signal, line and left-out Spearman. The relay uses the request's setting's
    (recompute.estimate_model), and the gate trusts it where it ranked that setting's left-out texts
    well. Measured (smollm2 -> gemma3, 24 texts per f): at 4096 without hiding char_mismatch and
    translated_attention ranked texts at -0.58..-0.69 per f in sample, at 2048 hiding 12 layers every
    signal within |0.47|; one pooled choice ranked left-out texts at 0.18, one per setting at 0.46 and 0.05."""
    part = [r for r in rows if r["f"] > 0]
    est = fit_estimate(part)
    if not est:
        return {}
    by = {Setting(n, h).key: fit_estimate([r for r in part if _group(r)[1:] == (n, h)])
          for n, h in sorted({_group(r)[1:] for r in part}, key=hide_last)}  # fmt: skip
    return {**est, "rule": rule, "by_setting": {k: {**v, "rule": rule} for k, v in by.items() if v}}
