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
from ctxrelay.transports.heterofold.recompute import calibrated_estimates
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
        share it would refuse is a relay paid before native prefill: the gate counts that cost)."""
        points = [{"label": "", "options": {}, "quality": {**quality, **facts_at(quality, 0.0)}}]
        rows = (params.get("recompute_stage") or {}).get("rows", [])
        for q in sorted(quality.get("recompute", []), key=lambda q: q["f"]):
            if q["f"] > 0:
                opts = {"recompute": q["f"], "selection": q["selection"]}
                label = f"f={q['f']:.2f} {q['selection']}"
                ests = calibrated_estimates(quality.get("estimate"), rows, q["f"])
                extra = {"calibrated_estimates": ests} if ests else {}
                points.append({"label": label, "options": opts, "quality": {**q, **facts_at(quality, q["f"]), **extra}})
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
