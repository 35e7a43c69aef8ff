"""Prefill-free KV transfer across model families (HeteroFold, DESIGN.md section 1b).

`transport` is what the registry serves: relay_prefill (transfer.py) builds the receiver's cache from
the sender's pre-RoPE K/V through the calibrated per-layer maps of an artifact; calibrate runs
`ctxrelay calibrate --transport heterofold` (data choice in calib_data.py, fitting in calibrate.py).
"""

from __future__ import annotations

from pathlib import Path

from ctxrelay.transports.base import Transport
from ctxrelay.transports.heterofold.calibrate import METHODS, CalibConfig, calibrate
from ctxrelay.transports.heterofold.facts import facts_at
from ctxrelay.transports.heterofold.recompute import calibrated_estimates, row_tokens
from ctxrelay.transports.heterofold.transfer import ARTIFACT_VERSION, TRANSPORT, identity_artifact, relay_prefill


class Heterofold(Transport):
    name = TRANSPORT
    artifact_version = ARTIFACT_VERSION
    needs = "kv"
    color = "tab:orange"

    def operating_points(self, params: dict, quality: dict) -> list[dict]:
        """Plain translation, then each recompute fraction the artifact's faithful stage measured; each
        with its fact recall where the fact stage measured it (the gate checks both) and, where the gate
        acts on the per-request estimate, what it estimated for each calibration text at that f (the
        share it would refuse is a relay paid before native prefill: the gate counts that cost). A
        fraction measured at several context lengths lists each under "by_tokens" (the gate reads the
        request's length: relay.gate.quality_at); its top-level fields are the shortest length's."""
        points = [{"label": "", "options": {}, "quality": {**quality, **facts_at(quality, 0.0)}}]
        rows = (params.get("recompute_stage") or {}).get("rows", [])
        model = quality.get("estimate")
        by_f: dict[tuple, list[dict]] = {}
        for q in quality.get("recompute", []):
            if q["f"] > 0:
                by_f.setdefault((q["f"], q["selection"]), []).append(q)
        for (f, rule), levels in sorted(by_f.items()):
            levels = sorted(levels, key=row_tokens)
            ests = [calibrated_estimates(model, rows, f, row_tokens(q)) for q in levels]
            point_q = {**levels[0], **facts_at(quality, f), **({"calibrated_estimates": ests[0]} if ests[0] else {})}
            if len(levels) > 1:
                point_q["by_tokens"] = [
                    {"tokens": row_tokens(q), "top1_agreement": q["top1_agreement"], "calibrated_estimates": e}
                    for q, e in zip(levels, ests, strict=True)
                ]
            options = {"recompute": f, "selection": rule}
            hide = int(levels[0].get("hide_translated", 0))  # the stage measured the point with it
            if hide:
                options["hide_translated"] = hide
            points.append({"label": f"f={f:.2f} {rule}", "options": options, "quality": point_q})
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
