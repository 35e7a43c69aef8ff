"""mapflow: attention-map reuse between models that share a tokenizer (DESIGN.md section 1a).

`transport` is what the registry serves:
  capture_plan   the sender's prefill streams its attention probabilities into a block top-p
                 compressor (make_map_capture) that leaves the state part "maps"
  relay_prefill  the receiver's reuse path (reuse.py) over those maps, then the suffix natively
  calibrate      `ctxrelay calibrate --transport mapflow` (data choice in calib_data.py)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ctxrelay.models.capture import CapturePlan
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.base import Transport
from ctxrelay.transports.mapflow.sparse import MapCapture, MapsError

TRANSPORT = "mapflow"
ARTIFACT_VERSION = 1
PART = "maps"  # the ContextState part the capture writes and the reuse path reads
MAP_MODES = ("replace", "guided", "hybrid")  # modes that read the sender's maps

__all__ = [
    "ARTIFACT_VERSION",
    "PART",
    "TRANSPORT",
    "MapsError",
    "calibrate",
    "make_map_capture",
    "map_capture_plan",
    "relay_prefill",
    "transport",
]


def make_map_capture(
    sender: LoadedModel,
    top_p: float = 0.9,
    block: int = 64,
    *,
    layers: list[int] | None = None,
    dtype: torch.dtype = torch.float16,
) -> MapCapture:
    """Streamed block top-p compressor for the sender's prefill (map_capture_plan wraps it)."""
    s = sender.spec
    return MapCapture(s.num_heads, s.num_layers, top_p=top_p, block=block, layers=layers, dtype=dtype, sender=s.name)


def map_capture_plan(
    sender: LoadedModel, top_p: float = 0.9, block: int = 64, *, layers: list[int] | None = None
) -> CapturePlan:
    """A capture plan that compresses the sender's maps of `layers` (None: all) into the state's part."""
    cap = make_map_capture(sender, top_p, block, layers=layers)

    def finish(state) -> None:
        state.set_part(PART, *cap.result())

    return CapturePlan(on_probs=cap.on_probs, prob_chunk=block, prob_layers=set(cap.layers), finish=finish)


def relay_prefill(receiver: LoadedModel, state, artifact, suffix_ids: torch.Tensor):
    from ctxrelay.transports.mapflow import reuse

    return reuse.relay_prefill(receiver, state, artifact, suffix_ids, TRANSPORT, ARTIFACT_VERSION)


def calibrate(sender, receiver, texts_train, texts_heldout, options=None, command="", out=None, resume=True, log=print):
    """Calibrate the pair (see calibration.py) and return its Artifact (saved to `out` when given)."""
    from ctxrelay.transports.mapflow import calibration

    return calibration.calibrate(sender, receiver, texts_train, texts_heldout, options or {}, command, out, resume, log)


class Mapflow(Transport):
    name = TRANSPORT
    artifact_version = ARTIFACT_VERSION
    needs = PART
    color = "tab:blue"

    def capture_plan(self, sender: LoadedModel, edge_params: Sequence[dict]) -> CapturePlan:
        """One capture serves every mapflow edge out of the sender: highest p, union of the layers read."""
        if not edge_params:
            return CapturePlan()
        block = int(edge_params[0].get("block", 64))
        top_p = max(float(p.get("capture_p", p.get("top_p", 0.9))) for p in edge_params)
        layers = sorted(
            {int(s) for p in edge_params for s, mode in zip(p["mapping"], p["modes"], strict=True) if mode in MAP_MODES}
        )
        return map_capture_plan(sender, top_p, block, layers=layers)

    def relay_prefill(self, receiver, state, artifact, suffix_ids, **options):
        if options:
            raise MapsError(f"the mapflow transport takes no relay options (got {sorted(options)})")
        return relay_prefill(receiver, state, artifact, suffix_ids)

    def calibrate(self, sender: str, receiver: str, *, out, resume, options, command) -> Path:
        from ctxrelay.transports.mapflow.calib_data import calibrate_job

        return calibrate_job(sender, receiver, out=out, resume=resume, options=options, command=command)


transport = Mapflow()
