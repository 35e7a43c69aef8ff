"""Prefill-free KV transfer across model families (HeteroFold, DESIGN.md section 1b).

The relay layer calls `relay_prefill(receiver, state, artifact, suffix_ids)`; artifacts come from
`calibrate(...)` (driven by `ctxrelay calibrate --transport heterofold`).
"""

from ctxrelay.heterofold.calibrate import METHODS, CalibConfig, calibrate
from ctxrelay.heterofold.transfer import ARTIFACT_VERSION, TRANSPORT, identity_artifact, relay_prefill

__all__ = [
    "ARTIFACT_VERSION",
    "METHODS",
    "TRANSPORT",
    "CalibConfig",
    "calibrate",
    "identity_artifact",
    "relay_prefill",
]
