"""What every transport returns to the relay layer, so relay/ can treat them alike.

A transport's `relay_prefill(receiver, state, artifact, suffix_ids)` builds the receiver's cache for
the shared context from the sender's ContextState, runs the suffix (question / new turn) natively
and returns a RelayOutput. Its timings split the end-to-end time into named components that must
add up to it (no unattributed gap).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ctxrelay.models.runner import KVCache

TIMING_KEYS = ("translate_s", "copy_s", "assemble_s", "first_token_s")


@dataclass
class RelayOutput:
    cache: KVCache  # receiver cache over context + suffix, ready for decoding
    logits: torch.Tensor  # [1, V] next-token logits after the suffix (first token = argmax)
    timings: dict[str, float] = field(default_factory=dict)  # subset of TIMING_KEYS, seconds
    info: dict = field(default_factory=dict)  # transport-specific facts (mode, r, kept blocks ...)

    @property
    def components_s(self) -> float:
        return sum(self.timings.get(k, 0.0) for k in TIMING_KEYS)


class Stopwatch:
    """Accumulates wall time into named components: `with sw("translate_s"): ...`."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0
