"""A sender's K/V captured inside a serving engine while it prefills: what the relay's transports read,
without ctxrelay's runner prefilling the same text again.

Worker side (`Recorder`, no engine imported): the engine hands every attention layer's new keys and
values of a step, with the cache slots they go to (vLLM: the attention backend's `do_kv_cache_update`,
called eagerly between compiled pieces, so compiled mode is captured too). For each request marked for
capture the recorder keeps the rows of its prompt positions, found by their slots: the step's batch
order is the engine's business and never assumed. When a request's prompt is read to its end, its keys
(after the family's k-norm and RoPE, as the engine's attention reads them) and values are written as a
sealed `CapturedKV` file, on a thread of its own so the step that ends the prefill is not held by the
write. The engine's prefix cache may have served the first positions: the file then starts at `start`
and the router joins it to the state it already holds of those tokens.

Router side: `CapturedKV.load` checks owner (seal), weights, tenant and tokens; `capture.state_of_kv`
turns it into a ContextState (keys back to pre-RoPE).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctxrelay import tensorfile
from ctxrelay.engines.kv_payload import read_bound, token_digest
from ctxrelay.engines.paged import slot_mapping
from ctxrelay.errors import BindingError

log = logging.getLogger(__name__)
FORMAT = "ctxrelay-engine-capture"
VERSION = 1


@dataclass
class CapturedKV:
    """Keys (after k-norm and RoPE) and values of prompt positions start..end-1, per layer [T, kv_heads, d]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int
    token_ids: list[int]  # the prompt's first `end` tokens (positions 0..end-1)
    weights_hash: str
    tenant: str

    @property
    def end(self) -> int:
        return len(self.token_ids)

    def save(self, path: str | Path) -> Path:
        tensors = {f"k.{i}": k for i, k in enumerate(self.keys)} | {f"v.{i}": v for i, v in enumerate(self.values)}
        manifest = {
            "format": FORMAT, "version": VERSION, "layers": len(self.keys), "start": self.start, "end": self.end,
            "token_digest": token_digest(self.token_ids), "weights_hash": self.weights_hash, "tenant": self.tenant,
        }  # fmt: skip
        return tensorfile.write(path, tensors, manifest, durable=False)  # lives until the router has read it

    @staticmethod
    def load(path: str | Path, token_ids: list[int], weights_hash: str, tenant: str) -> CapturedKV:
        """The capture at `path`, refused unless it is this owner's, of these weights and tenant, and of
        exactly `token_ids` (the prompt the router sent)."""
        keys, values, m = read_bound(path, FORMAT, VERSION, "engine capture", weights_hash, tenant)
        if int(m["end"]) != len(token_ids) or token_digest(list(token_ids)) != m["token_digest"]:
            raise BindingError(f"{path} captured other tokens than the {len(token_ids)} of this prompt")
        return CapturedKV(keys, values, int(m["start"]), list(token_ids), m["weights_hash"], m["tenant"])


def wait_for_file(path: Path, timeout_s: float) -> None:
    """The engine answers before its writer thread has renamed the file into place (atomic: whole or absent)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the engine left no capture at {path} within {timeout_s:g} s")
        time.sleep(0.005)


@dataclass
class CaptureStep:
    """One request's part of one engine step: prompt positions start..start+n-1 are computed in it."""

    req_id: str
    path: str
    tenant: str
    token_ids: list[int]  # the whole prompt
    first: int  # the first prompt position the engine computes for this request (its prefix cache has the rest)
    start: int
    n: int
    block_ids: list[list[int]]  # per KV cache group (a sliding-window group has a block table of its own)

    @property
    def last_step(self) -> bool:
        return self.start + self.n >= len(self.token_ids)


@dataclass
class _Pending:
    step: CaptureStep
    layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


class Recorder:
    """The worker's capture: rows of marked requests, per layer, across the steps of a (chunked) prefill."""

    def __init__(self, weights_hash: str, block_size: int):
        self.weights_hash, self.block_size = weights_hash, block_size
        self._steps: list[CaptureStep] = []
        self._pending: dict[str, _Pending] = {}
        # rows per capture, per (slot tensor ptr, its length, KV cache group): layers of a group share the slots
        self._rows: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._writers: list[threading.Thread] = []

    def begin(self, steps: list[CaptureStep], finished: set[str] = frozenset()) -> None:
        """This step's captures (the scheduler's metadata); requests that ended drop what they held."""
        for rid in finished:
            self._pending.pop(rid, None)
        self._steps, self._rows = steps, {}
        for s in steps:
            p = self._pending.get(s.req_id)
            if p is None or s.start == s.first:  # a new capture, or a preempted one started over
                self._pending[s.req_id] = _Pending(s)

    @property
    def active(self) -> bool:
        return bool(self._steps)

    def record(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, group: int = 0) -> None:
        """One attention layer's new keys/values of the step ([tokens, kv_heads, d]) and their cache slots in
        the block table of the layer's KV cache group."""
        rows = self._rows_of(slots, group)
        for s, r in zip(self._steps, rows, strict=True):
            # indexing by rows copies: the engine reuses its key/value buffers next step
            self._pending[s.req_id].layers.setdefault(layer, []).append((key[r], value[r]))

    def _rows_of(self, slots: torch.Tensor, group: int) -> list[torch.Tensor]:
        """Batch rows of each capture's positions this step (once per step and group)."""
        key = (slots.data_ptr(), slots.numel(), group)
        if key in self._rows:
            return self._rows[key]
        slots = slots.to(torch.long).cpu()
        wanted = [slot_mapping(s.block_ids[group], s.start, s.start + s.n, self.block_size) for s in self._steps]
        top = int(max([int(slots.max()) if slots.numel() else -1, *(int(w.max()) for w in wanted if w.numel())]))
        row_of = torch.full((top + 1,), -1, dtype=torch.long)
        ok = slots >= 0  # padding slots are negative
        row_of[slots[ok]] = torch.arange(slots.numel())[ok]
        rows = [row_of[w] for w in wanted]
        for s, r in zip(self._steps, rows, strict=True):
            if bool((r < 0).any()):
                raise BindingError(f"capture of request {s.req_id}: positions not in this step's batch")
        self._rows[key] = rows
        return rows

    def finish(self) -> None:
        """After the step's forward: requests whose prompt was read to its end are written (on a thread)."""
        for s in self._steps:
            if not s.last_step:
                continue
            p = self._pending.pop(s.req_id, None)
            if p is None or not p.layers:
                continue
            t = threading.Thread(target=self._write, args=(p, s), name="ctxrelay-capture", daemon=True)
            t.start()
            self._writers.append(t)
        self._steps, self._rows = [], {}
        self._writers = [t for t in self._writers if t.is_alive()]

    def _write(self, p: _Pending, last: CaptureStep) -> None:
        try:
            layers = sorted(p.layers)
            keys = [torch.cat([k for k, _ in p.layers[i]]) for i in layers]
            values = [torch.cat([v for _, v in p.layers[i]]) for i in layers]
            want = len(last.token_ids) - p.step.first
            if layers != list(range(len(layers))) or any(k.shape[0] != want for k in keys):
                raise BindingError(f"captured {[k.shape[0] for k in keys][:3]} rows per layer, expected {want}")
            CapturedKV(keys, values, p.step.first, list(last.token_ids), self.weights_hash, last.tenant).save(last.path)
        except Exception as e:  # the router times out on the missing file and falls back to its own prefill
            log.warning("ctxrelay: capture of request %s not written (%s: %s)", last.req_id, type(e).__name__, e)

    def join(self, timeout_s: float = 30.0) -> None:
        for t in self._writers:
            t.join(timeout_s)
