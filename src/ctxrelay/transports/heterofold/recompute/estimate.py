"""The per-request estimate: the predicted top-1 agreement of THIS relayed request with the receiver's
native prefill, from the signal the calibration chose (calibration/fractions.py fits it), and whether
the gate may act on it (trusts: how it ranked calibration texts left out of its fit).
"""

from __future__ import annotations

from ctxrelay.metrics import log_length_weight, nearest_length
from ctxrelay.transports.heterofold.hiding import Hide, hide_code
from ctxrelay.transports.heterofold.recompute.settings import Setting, row_tokens

# the gate acts on a per-request estimate only where it ranked calibration texts left out of its fit at
# least this well (Spearman at a fixed f; faithful.left_out_spearman). Measured: kv_change at 0.33 in sample
# ranked held-out requests at -0.11..0.05 (qwen-1.5b -> gemma3, 20 per f) and sent 4 of 10 to native after
# paying a relay; translated_attention at -0.53 in sample (qwen-1.5b -> qwen-0.5b) was 0.21 left out
MIN_ESTIMATE_RHO = 0.5


def estimate(model: dict | None, info: dict) -> float | None:
    """Predicted top-1 agreement of THIS request (faithful.fit_estimate): the calibrated mean at the
    request's fraction, length and hiding plus the slope times how far its signal lies from that mean.
    Where the stage ran at several settings (model["lengths"], keyed by Setting.key), both means come
    from the settings with the request's hiding, interpolated linearly in log-length between the
    calibrated lengths around the request's context_tokens (the nearest outside them). None where the
    artifact has no estimate or the signal was not measured. Where the stage fitted one estimate per
    setting (model["by_setting"]), the request's own setting's is used (estimate_model)."""
    model = estimate_model(model, info.get("context_tokens"), hide_code(info.get("hide_translated", 0)))
    if not model or "centres" not in model or model.get("signal") not in info or "requested_fraction" not in info:
        return None
    f = float(info["requested_fraction"])
    mean_signal, mean_top1 = _centre(model["centres"], f)
    settings = model.get("lengths")
    if settings and info.get("context_tokens"):
        # artifacts made before settings had a hiding key all settings by length alone: all of them
        same = _by_length(settings, hide_code(info.get("hide_translated", 0))) or _by_length(settings)
        mean_signal, mean_top1 = _centre_at(same, f, int(info["context_tokens"]))
    return float(min(1.0, max(0.0, mean_top1 + model["slope"] * (float(info[model["signal"]]) - mean_signal))))


def estimate_model(model: dict | None, tokens: int | None, hide: Hide = 0) -> dict | None:
    """The estimate that judges a request of `tokens` context tokens hiding `hide` layers. Where the stage
    fitted one per setting (model["by_setting"], keyed by Setting.key): that of the request's hiding at
    the calibrated length nearest its own in log-length (the gate's nearest-length rule; the shortest
    when no length is given), None where its hiding has none. Otherwise the one pooled estimate."""
    if not model or "by_setting" not in model:
        return model
    same = _by_length(model["by_setting"], hide_code(hide))
    return same[nearest_length(list(same), int(tokens or min(same)))] if same else None


def _centre(centres: dict, f: float) -> list[float]:
    return centres[min(centres, key=lambda k: abs(float(k) - f))]


def _by_length(settings: dict, hide: Hide | None = None) -> dict:
    """Per-setting entries (keyed by Setting.key) of one hiding (None: all), keyed by their length."""
    parsed = {k: Setting.parse(k) for k in settings}
    return {parsed[k].tokens: v for k, v in settings.items() if hide is None or parsed[k].hide == hide}


def _centre_at(by_len: dict, f: float, n: int) -> tuple[float, float]:
    """(mean signal, mean top-1) at fraction f for a context of n tokens, from centres per length."""
    a, b, w = log_length_weight(list(by_len), n)
    ca, cb = _centre(by_len[a], f), _centre(by_len[b], f)
    return (1 - w) * ca[0] + w * cb[0], (1 - w) * ca[1] + w * cb[1]


def calibrated_estimates(
    model: dict | None, rows: list[dict], f: float, tokens: int | None = None, hide: Hide | None = None
) -> list[float]:
    """What a trusted estimate said of each calibration text at fraction f (the recompute stage's rows;
    only those calibrated at `tokens` context tokens and with `hide` hidden layers when given); empty
    where the gate does not act on the estimate."""
    if not trusts(model, tokens, hide or 0):
        return []
    part = [r for r in rows if abs(float(r["f"]) - f) < 1e-9 and (tokens is None or row_tokens(r) == tokens)]
    part = [r for r in part if hide is None or hide_code(r.get("hide_translated", 0)) == hide]
    ests = (estimate(model, {**r, "requested_fraction": f, "context_tokens": row_tokens(r)}) for r in part)
    return [e for e in ests if e is not None]


def trusts(model: dict | None, tokens: int | None = None, hide: Hide = 0) -> bool:
    """Whether the artifact's estimate ranks requests well enough for the gate to act on it: by how it
    ranked calibration texts it was not fitted on (cv_spearman), never by its in-sample fit; per setting
    where the stage fitted one per setting (estimate_model: the one for `tokens` and `hide`). An estimate
    calibrated before cv_spearman existed is not acted on (`ctxrelay calibrate ... --set stage=refit`
    adds it from the stored rows)."""
    model = estimate_model(model, tokens, hide)
    return bool(model) and float(model.get("cv_spearman") or 0.0) >= MIN_ESTIMATE_RHO
