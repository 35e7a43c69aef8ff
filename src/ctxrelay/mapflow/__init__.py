"""mapflow: attention-map reuse between models that share a tokenizer (DESIGN.md section 1a).

The contract the relay layer calls:
  make_map_capture(sender, top_p, block)  -> .on_probs for runner.Capture, .result() -> (maps, maps_meta)
  relay_prefill(receiver, state, artifact, suffix_ids) -> RelayOutput
  calibrate(sender, receiver, texts_train, texts_heldout, options, command, out, resume) -> Artifact
(predict_cost is not provided: the relay fits its cost model from measured timings.)
"""

from __future__ import annotations

import torch

from ctxrelay.mapflow.sparse import MapCapture, MapsError
from ctxrelay.models.spec import LoadedModel

TRANSPORT = "mapflow"
ARTIFACT_VERSION = 1

__all__ = [
    "ARTIFACT_VERSION",
    "TRANSPORT",
    "MapsError",
    "calibrate",
    "make_map_capture",
    "relay_prefill",
]


def make_map_capture(
    sender: LoadedModel,
    top_p: float = 0.9,
    block: int = 64,
    *,
    layers: list[int] | None = None,
    dtype: torch.dtype = torch.float16,
) -> MapCapture:
    """Streamed block top-p compressor for the sender's prefill.

    Use: cap = make_map_capture(m); runner.Capture(on_probs=cap.on_probs, prob_chunk=block);
    after the prefill, state.maps, state.maps_meta = cap.result().
    """
    s = sender.spec
    return MapCapture(s.num_heads, s.num_layers, top_p=top_p, block=block, layers=layers, dtype=dtype, sender=s.name)


def relay_prefill(receiver: LoadedModel, state, artifact, suffix_ids: torch.Tensor):
    from ctxrelay.mapflow import reuse

    return reuse.relay_prefill(receiver, state, artifact, suffix_ids, TRANSPORT, ARTIFACT_VERSION)


def calibrate(sender, receiver, texts_train, texts_heldout, options=None, command="", out=None, resume=True, log=print):
    """Calibrate the pair (see calibration.py) and return its Artifact (saved to `out` when given)."""
    from ctxrelay.mapflow import calibration

    return calibration.calibrate(sender, receiver, texts_train, texts_heldout, options or {}, command, out, resume, log)
