"""Prefill-free KV transfer across model families (HeteroFold, DESIGN.md section 1b).

`transport` is what the registry serves: relay_prefill (transfer.py) builds the receiver's cache from
the sender's pre-RoPE K/V through the calibrated per-layer maps of an artifact; calibrate runs
`ctxrelay calibrate --transport heterofold` (data choice in calib_data.py, fitting in calibrate.py).
"""

from __future__ import annotations

from pathlib import Path

from ctxrelay.transports.base import Transport
from ctxrelay.transports.heterofold.calibrate import METHODS, CalibConfig, calibrate
from ctxrelay.transports.heterofold.facts import facts_at, facts_levels
from ctxrelay.transports.heterofold.hiding import hide_code, hide_last, point_label
from ctxrelay.transports.heterofold.recompute import calibrated_estimates, serving_span, stage_setting, with_setting
from ctxrelay.transports.heterofold.transfer import ARTIFACT_VERSION, TRANSPORT, identity_artifact, relay_prefill


class Heterofold(Transport):
    name = TRANSPORT
    artifact_version = ARTIFACT_VERSION
    needs = "kv"
    color = "tab:orange"

    def operating_points(self, params: dict, quality: dict) -> list[dict]:
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

    def relay_prefill(self, receiver, state, artifact, suffix_ids, **options):
        return relay_prefill(receiver, state, artifact, suffix_ids, **options)

    def calibrate(self, sender: str, receiver: str, *, out, resume, options, command) -> Path:
        from ctxrelay.transports.heterofold.calib_data import calibrate_job

        return calibrate_job(sender, receiver, out=out, resume=resume, options=options, command=command)


transport = Heterofold()

__all__ = [
    "ARTIFACT_VERSION",
    "METHODS",
    "TRANSPORT",
    "CalibConfig",
    "calibrate",
    "identity_artifact",
    "relay_prefill",
    "transport",
]
