"""heterofold's operating points, read from an artifact's calibrated quality: plain translation, then each
(recompute fraction, selection rule, hiding) its faithful stage measured, with the fact recall its fact
stage measured. The gate (relay.gate) judges each request against these.
"""

from __future__ import annotations

from ctxrelay.metrics import nearest_length
from ctxrelay.transports.heterofold.hiding import Hide, hide_code, hide_last, point_label
from ctxrelay.transports.heterofold.recompute.estimate import calibrated_estimates
from ctxrelay.transports.heterofold.recompute.settings import serving_span, stage_setting, with_setting

FACT_FIELDS = ("fact_recall", "native_right", "kept", "cases")  # what an operating point's quality gains from facts


def operating_points(params: dict, quality: dict) -> list[dict]:
    """Plain translation, then each (recompute fraction, rule, hiding) the artifact's faithful stage
    measured; each with its fact recall where the fact stage measured it (the gate checks both) and,
    where the gate acts on the per-request estimate, what it estimated for each calibration text at
    that f (the share it would refuse is a relay paid before native prefill: the gate counts that
    cost). A point measured at several context lengths lists each under "by_tokens" with that
    length's fact recall (the gate reads the request's length: relay.gate.quality_at); its top-level
    fields are the shortest length's. Fact recall measured at several lengths is listed apart
    ("facts_by_tokens"): the gate reads the one nearest the request's length, even where top-1 was
    measured at one length only. A point measured at fewer lengths than the artifact's others
    (e.g. hiding only at 4096 tokens) serves only the requests nearest its lengths ("serves_tokens")."""
    stage = params.get("recompute_stage") or {}
    fact_stage = stage_setting(params.get("facts_stage"), "facts_tokens")
    facts = {"facts": with_setting(quality.get("facts", []), *fact_stage)}
    points = [{"label": "", "options": {}, "quality": {**quality, **facts_at(facts, 0.0)}}]
    rows = with_setting(stage.get("rows", []), *stage_setting(stage))
    table = [q for q in with_setting(quality.get("recompute", []), *stage_setting(stage)) if q["f"] > 0]
    model = quality.get("estimate")
    lengths = sorted({q["tokens"] for q in table})
    by_point: dict[tuple, list[dict]] = {}
    for q in table:
        by_point.setdefault((q["f"], q["selection"], hide_code(q.get("hide_translated", 0))), []).append(q)
    for (f, rule, hide), levels in sorted(by_point.items(), key=lambda kv: hide_last(kv[0])):
        levels = sorted(levels, key=lambda q: q["tokens"])
        ests = [calibrated_estimates(model, rows, f, q["tokens"], hide) for q in levels]
        kept = [facts_at(facts, f, tokens=q["tokens"], hide=hide) for q in levels]
        point_q = {**levels[0], **kept[0], **({"calibrated_estimates": ests[0]} if ests[0] else {})}
        if quality.get("facts") and not kept[0]:
            point_q["facts_missing"] = True  # the stage ran, not at this point: the gate refuses it
        if len(levels) > 1:
            point_q["by_tokens"] = [
                {"tokens": q["tokens"], "top1_agreement": q["top1_agreement"], "calibrated_estimates": e, **k}
                for q, e, k in zip(levels, ests, kept, strict=True)
            ]
        fact_levels = facts_levels(facts, f, hide)
        if len(fact_levels) > 1:  # fact recall by the request's length, apart from top-1's lengths
            point_q["facts_by_tokens"] = fact_levels
        span = serving_span(lengths, [q["tokens"] for q in levels])
        if span != [None, None]:
            point_q["serves_tokens"] = span
        options = {"recompute": f, "selection": rule, **({"hide_translated": hide} if hide else {})}
        points.append({"label": point_label(f, rule, hide), "options": options, "quality": point_q})
    return points


def facts_at(
    quality: dict, f: float, fields: tuple[str, ...] = FACT_FIELDS, tokens: int | None = None, hide: Hide = 0
) -> dict:
    """`fields` of the stage's entry at fraction f measured with hiding `hide` (f = 0 never
    hides), at the measured length nearest `tokens` in log-length (the shortest when None); empty
    where the stage measured no such entry."""
    lengths = {e["tokens"]: e for e in _entries(quality, f, hide)}
    if not lengths:
        return {}
    e = lengths[nearest_length(list(lengths), tokens or min(lengths))]
    return {k: e[k] for k in fields if k in e}


def facts_levels(quality: dict, f: float, hide: Hide = 0) -> list[dict]:
    """Every length the stage measured fraction f with hiding `hide` at: {"tokens", *FACT_FIELDS}
    each, shortest first. The gate reads the one nearest the request's length (relay.gate.quality_at),
    whatever lengths the point's top-1 agreement was measured at."""
    found = sorted(_entries(quality, f, hide), key=lambda e: e["tokens"])
    return [{"tokens": e["tokens"], **{k: e[k] for k in FACT_FIELDS if k in e}} for e in found]


def _entries(quality: dict, f: float, hide: Hide) -> list[dict]:
    found = [e for e in with_setting(quality.get("facts", []), 2048, 0) if abs(float(e["f"]) - f) < 1e-9]
    return [e for e in found if e["hide_translated"] == (hide if f else 0)]
