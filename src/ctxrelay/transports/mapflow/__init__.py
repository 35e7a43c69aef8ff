"""mapflow: attention-map reuse between models that share a tokenizer (docs/mapflow.md).

`transport` is what the registry serves:
  capture_plan   the sender's prefill leaves the state part "maps": by default (edges whose layers
                 are guided or hybrid) a pattern estimated from sampled query rows beside fused
                 SDPA (sampled_capture.py, capture "sampled"); where a layer replaces its attention, the
                 exact block top-p compressor of every row's probabilities (make_map_capture,
                 capture "exact", eager attention on the sender)
  relay_prefill  the receiver's reuse path (reuse.py) over those maps, then the suffix natively
  calibrate      `ctxrelay calibrate --transport mapflow` (calibration/: data choice in job.py)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ctxrelay.errors import UsageError
from ctxrelay.models.capture import CapturePlan
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.base import Transport, TuningKey
from ctxrelay.transports.mapflow.sampled_capture import SampledMapCapture
from ctxrelay.transports.mapflow.sparse import SOURCES, MapCapture, MapsError

TRANSPORT = "mapflow"
ARTIFACT_VERSION = 1
PART = "maps"  # the ContextState part the capture writes and the reuse path reads
MAP_MODES = ("replace", "guided", "hybrid")  # modes that read the sender's maps
TILE_MODES = ("replace",)  # modes that read the maps' probabilities, not only their pattern
CAPTURES = SOURCES  # the `capture` edge parameter: "exact" (every row, eager) or "sampled" (beside SDPA)
SAMPLE_ROWS = 16  # sampled query rows per block (the `sample_rows` edge parameter; 16 of 64 kept top-1 as exact)

__all__ = [
    "ARTIFACT_VERSION",
    "CAPTURES",
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
    sender: LoadedModel,
    top_p: float = 0.9,
    block: int = 64,
    *,
    layers: list[int] | None = None,
    capture: str = "exact",
    sample_rows: int = SAMPLE_ROWS,
) -> CapturePlan:
    """A capture plan that leaves the sender's maps of `layers` (None: all) in the state's part.

    capture="exact": every row's probabilities, block-compressed (eager attention on the sender);
    capture="sampled": the pattern from `sample_rows` rows per query block (at most all `block` of
    them), beside fused SDPA.
    The part's meta says which ("source").
    """
    if capture == "exact":
        cap = make_map_capture(sender, top_p, block, layers=layers)
        plan = CapturePlan(on_probs=cap.on_probs, prob_chunk=block, prob_layers=set(cap.layers))
    elif capture == "sampled":
        s = sender.spec
        rows = min(sample_rows, block)
        cap = SampledMapCapture(
            s.num_heads, s.num_layers, top_p=top_p, block=block, rows=rows, layers=layers, sender=s.name
        )
        plan = CapturePlan(on_qk=cap.on_qk, qk_layers=set(cap.layers))
    else:
        raise UsageError(f"unknown mapflow capture {capture!r}: use one of {', '.join(CAPTURES)}")

    def finish(state) -> None:
        state.set_part(PART, *cap.result())

    plan.finish = finish
    return plan


def edge_capture(params: dict) -> str:
    """The capture an edge asks for: its `capture` parameter, else sampled unless a layer reads tiles."""
    reads_tiles = any(m in TILE_MODES for m in params["modes"])
    if "capture" not in params:
        return "exact" if reads_tiles else "sampled"
    capture = str(params["capture"])
    if capture not in CAPTURES:
        raise UsageError(f"unknown mapflow capture {capture!r}: use one of {', '.join(CAPTURES)}")
    if capture == "sampled" and reads_tiles:
        raise UsageError("a mapflow edge with replace layers needs capture='exact': replace applies the map itself")
    return capture


def relay_prefill(receiver: LoadedModel, state, artifact, suffix_ids: torch.Tensor):
    from ctxrelay.transports.mapflow import reuse

    return reuse.relay_prefill(receiver, state, artifact, suffix_ids, TRANSPORT, ARTIFACT_VERSION)


def calibrate(sender, receiver, texts_train, texts_heldout, options=None, command="", out=None, resume=True, log=print):
    """Calibrate the pair (see calibration/fit.py) and return its Artifact (saved to `out` when given)."""
    from ctxrelay.transports.mapflow.calibration import fit as calibration

    return calibration.calibrate(sender, receiver, texts_train, texts_heldout, options or {}, command, out, resume, log)


class Mapflow(Transport):
    name = TRANSPORT
    artifact_version = ARTIFACT_VERSION
    needs = PART
    color = "tab:blue"

    def capture_plan(self, sender: LoadedModel, edge_params: Sequence[dict]) -> CapturePlan:
        """One capture serves every mapflow edge out of the sender: highest p, union of the layers read,
        exact if any edge asks for it (replace mode reads tiles), most sampled rows asked for."""
        if not edge_params:
            return CapturePlan()
        block = int(edge_params[0].get("block", 64))
        top_p = max(float(p.get("capture_p", p.get("top_p", 0.9))) for p in edge_params)
        layers = sorted(
            {int(s) for p in edge_params for s, mode in zip(p["mapping"], p["modes"], strict=True) if mode in MAP_MODES}
        )
        captures = {edge_capture(p) for p in edge_params}
        capture = "exact" if "exact" in captures else captures.pop()
        rows = max(int(p.get("sample_rows", SAMPLE_ROWS)) for p in edge_params)
        return map_capture_plan(sender, top_p, block, layers=layers, capture=capture, sample_rows=rows)

    def engine_servable(self, options: dict) -> bool:
        # the receiver attends with the sender's attention maps: an engine's fused attention takes none
        return False

    def relay_prefill(self, receiver, state, artifact, suffix_ids, **options):
        if options:
            raise MapsError(f"the mapflow transport takes no relay options (got {sorted(options)})")
        return relay_prefill(receiver, state, artifact, suffix_ids)

    def calibrate(self, sender: str, receiver: str, *, out, resume, options, command) -> Path:
        from ctxrelay.transports.mapflow.calibration.job import calibrate_job

        return calibrate_job(sender, receiver, out=out, resume=resume, options=options, command=command)

    def tuning_keys(self) -> list[TuningKey]:
        """The `--set` keys of `ctxrelay calibrate --transport mapflow` (declared by its calibration job)."""
        from ctxrelay.transports.mapflow.calibration.job import tuning_keys

        return tuning_keys()


transport = Mapflow()
