"""Prefill-free KV transfer across model families (HeteroFold; docs/heterofold.md).

`transport` is what the registry serves: relay_prefill (transfer.py) builds the receiver's cache from
the sender's pre-RoPE K/V through the calibrated per-layer maps of an artifact (kv_maps.py), with the
faithful mode's selective recompute (recompute.py); operating_points (points.py) reads what the
artifact's calibration measured. `calibrate` runs `ctxrelay calibrate --transport heterofold`: everything
it needs lives in calibration/ (the data and the job in job.py, the translator's fit in fit.py), which
serving never imports.
"""

from __future__ import annotations

from pathlib import Path

from ctxrelay.transports.base import Transport, TuningKey
from ctxrelay.transports.heterofold.points import operating_points
from ctxrelay.transports.heterofold.transfer import ARTIFACT_VERSION, TRANSPORT, identity_artifact, relay_prefill


class Heterofold(Transport):
    name = TRANSPORT
    artifact_version = ARTIFACT_VERSION
    needs = "kv"
    color = "tab:orange"

    def operating_points(self, params: dict, quality: dict) -> list[dict]:
        return operating_points(params, quality)

    def engine_servable(self, options: dict) -> bool:
        # hiding translated entries from the question needs ctxrelay's own attention (KVCache.hide)
        return not options.get("hide_translated")

    def relay_prefill(self, receiver, state, artifact, suffix_ids, **options):
        return relay_prefill(receiver, state, artifact, suffix_ids, **options)

    def calibrate(self, sender: str, receiver: str, *, out, resume, options, command) -> Path:
        from ctxrelay.transports.heterofold.calibration.job import calibrate_job

        return calibrate_job(sender, receiver, out=out, resume=resume, options=options, command=command)

    def tuning_keys(self) -> list[TuningKey]:
        """The `--set` keys of `ctxrelay calibrate --transport heterofold` (declared by its calibration job)."""
        from ctxrelay.transports.heterofold.calibration.job import tuning_keys

        return tuning_keys()


transport = Heterofold()

__all__ = [
    "ARTIFACT_VERSION",
    "TRANSPORT",
    "identity_artifact",
    "relay_prefill",
    "transport",
]
