"""ctxrelay's KV connector for vLLM (its CPU build): a request that names a ctxrelay K/V file gets the
receiver cache ctxrelay built (a relay through any transport, or a model's own exact K/V) written into
vLLM's paged cache, and vLLM computes only the rest of the prompt.

Load it from outside vLLM, `LLM(model=..., kv_transfer_config=transfer_config(weights_hash))` (ctxrelay's
hash of these weights), and send `SamplingParams(extra_args=transfer_params(path, tokens, tenant))` with a
`cache_salt` derived from tenant and relay, so that approximate K/V never satisfies a later exact lookup
of the engine's prefix cache. Scheduler side: claim the file's tokens, whole blocks only and never the
prompt's last token (vLLM computes at least one). Worker side: write them through the engine's own
cache-write op (`cpu_attn_reshape_and_cache`: on AMX machines the cache rows are packed for the AMX
kernel, so the cache is never indexed directly). A file that is missing, foreign, of another model or
tenant, or of other tokens is reported through `get_block_ids_with_load_errors` (per request where the model
has several KV cache groups), and with `kv_load_failure_policy="recompute"` vLLM computes those tokens
itself: never a wrong answer.

A request marked for capture (`capture_params`: a relay source) leaves its prompt's K/V in a sealed file
for the router (engines/kv_capture.py): the scheduler side tells the worker which prompt positions each
step computes and in which blocks; the worker's attention layers hand their new keys and values to the
recorder on the way into the cache (the backend's `do_kv_cache_update`, wrapped once per layer).

`transfer_config`, `transfer_params` and `cpu_engine_env` (vllm_params.py) are re-exported here.
This module imports vLLM; the rest of ctxrelay never imports it (an install without vLLM loses nothing).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError as e:  # the one module of ctxrelay that needs the engine
    raise ImportError(f"ctxrelay's vLLM connector needs vLLM: pip install 'ctxrelay[vllm]' or `make vllm` ({e})") from e

from ctxrelay.engines.kv_capture import CaptureStep, Recorder
from ctxrelay.engines.kv_payload import KVPayload
from ctxrelay.engines.paged import NULL_BLOCK, claimable, slot_mapping
from ctxrelay.engines.vllm_idle import cap_idle_spin
from ctxrelay.engines.vllm_params import CAPTURE, PARAM, cpu_engine_env, transfer_config, transfer_params
from ctxrelay.errors import CtxrelayError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
__all__ = ["CtxrelayConnector", "cpu_engine_env", "transfer_config", "transfer_params"]
LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    req_id: str
    path: str
    tenant: str
    token_ids: list[int]
    start: int  # first position to write (the prefix cache may hold the ones before)
    end: int  # one past the last claimed position
    block_ids: list[list[int]]  # per KV cache group (one, or a full and a sliding-window group under HMA)
    per_request: bool = False  # loaded while the request waits; success or failure reported per request


@dataclass
class CtxrelayMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    captures: list[CaptureStep] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)  # requests that ended: the worker drops their partial capture


@dataclass
class _Capturing:
    """Scheduler side: a capture request still reading its prompt."""

    params: dict
    token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group
    first: int


def _groups(block_ids: Any) -> list[list[int]]:
    return [list(b) for b in block_ids or ()]


class CtxrelayConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager (HMA): a model with sliding-window layers (gemma3) keeps one
    block table per KV cache group, and positions a sliding window has left hold the null block."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.weights_hash = str(extra.get("weights_hash", ""))
        self._claimed: dict[str, tuple[dict, int, int]] = {}  # scheduler: req id -> (params, start, end)
        self._load_errors: set[int] = set()  # worker: blocks whose load failed
        self._capture_params: dict[str, dict] = {}  # scheduler: req id -> params, until its first schedule
        self._capturing: dict[str, _Capturing] = {}
        self._recorder = Recorder(self.weights_hash, self.block_size)  # worker
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self._group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        # Block ids are unique only within a group: with several groups vLLM cannot take failed blocks
        # (`get_block_ids_with_load_errors` would stop the engine), only failed requests of asynchronous
        # loads. So there the request waits one step while the worker loads, and a failed load is recomputed.
        self._per_request = len(groups) > 1
        self._waiting_loads: list[Load] = []  # scheduler: per-request loads to send with the next step
        self._load_failed: set[str] = set()  # scheduler: requests whose load failed: the engine computes them
        self._received: set[str] = set()  # worker: per-request loads done this step
        self._failed: set[str] = set()  # worker: per-request loads that failed this step
        self._wrapped = False
        cap = cap_idle_spin()  # in the worker's process: its idle spin would take a core from the router
        if cap is not None:
            log.info("ctxrelay: vLLM's idle spin capped at %g s (%s)", cap, role)

    # ---- scheduler side ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if params.get(CAPTURE):
            self._capture_params[request.request_id] = params
        if not params.get(PARAM) or request.request_id in self._load_failed:
            return 0, False
        end = claimable(int(params.get("tokens", 0)), len(request.prompt_token_ids or []), self.block_size)
        if end <= num_computed_tokens:
            return 0, False
        self._claimed[request.request_id] = (params, num_computed_tokens, end)
        return end - num_computed_tokens, self._per_request

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._claimed.pop(request.request_id, None)
        elif self._per_request and request.request_id in self._claimed:
            self._waiting_loads.append(
                self._load(request.request_id, request.prompt_token_ids, blocks.get_block_ids(), per_request=True)
            )

    def _load(self, rid: str, prompt: Any, block_ids: Any, per_request: bool = False) -> Load:
        params, start, end = self._claimed.pop(rid)
        tenant = str(params.get("tenant", ""))
        return Load(rid, str(params[PARAM]), tenant, list(prompt or []), start, end, _groups(block_ids), per_request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = CtxrelayMetadata(loads=self._waiting_loads)
        self._waiting_loads = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._claimed:
                meta.loads.append(self._load(new.req_id, new.prompt_token_ids, new.block_ids))
        self._capture_steps(scheduler_output, meta)
        meta.finished = set(scheduler_output.finished_req_ids)
        return meta

    def _capture_steps(self, out: SchedulerOutput, meta: CtxrelayMetadata) -> None:
        """Which prompt positions of each capture request this step computes, and its blocks so far."""
        for new in out.scheduled_new_reqs:
            params = self._capture_params.pop(new.req_id, None)
            if params is not None:
                prompt, blocks = list(new.prompt_token_ids or []), _groups(new.block_ids)
                self._capturing[new.req_id] = _Capturing(params, prompt, blocks, new.num_computed_tokens)
                self._capture_step(new.req_id, new.num_computed_tokens, out, meta)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            c = self._capturing.get(rid)
            if c is None:
                continue
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted, blocks freed: read again from where it resumes
                c.block_ids, c.first = _groups(blocks), cached.num_computed_tokens[i]
            elif blocks:
                added = _groups(blocks)
                c.block_ids = [a + b for a, b in zip(c.block_ids or [[] for _ in added], added, strict=True)]
            self._capture_step(rid, cached.num_computed_tokens[i], out, meta)

    def _capture_step(self, rid: str, start: int, out: SchedulerOutput, meta: CtxrelayMetadata) -> None:
        c = self._capturing[rid]
        n = min(out.num_scheduled_tokens.get(rid, 0), len(c.token_ids) - start)
        if n > 0:
            meta.captures.append(
                CaptureStep(rid, str(c.params[CAPTURE]), str(c.params.get("tenant", "")), c.token_ids, c.first, start,
                            n, [list(b) for b in c.block_ids])
            )  # fmt: skip
        if start + n >= len(c.token_ids):
            del self._capturing[rid]

    def update_connector_output(self, connector_output: Any) -> None:
        self._load_failed |= set(connector_output.failed_recving or ())  # never claimed again: computed instead

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._load_failed.discard(request.request_id)
        self._claimed.pop(request.request_id, None)
        self._capture_params.pop(request.request_id, None)
        self._capturing.pop(request.request_id, None)
        return False, None  # loads and captures are done within the steps: blocks are freed at once

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # ---- worker side ---------------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before each step's forward: the recorder learns the step's captures (wrapping the layers' cache
        updates the first time a capture comes, so an engine that never captures runs vLLM's code as is)."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, CtxrelayMetadata):
            if connector_metadata.captures and not self._wrapped:
                self._wrap_cache_updates(self._vllm_config.compilation_config.static_forward_context)
            self._recorder.begin(connector_metadata.captures, connector_metadata.finished)

    def _wrap_cache_updates(self, layers: dict[str, Any]) -> None:
        """Each attention layer hands its new keys and values to the recorder on the way into the cache. The
        backend's cache update runs eagerly inside a custom op (never traced), so compiled mode is captured."""
        for name, layer in layers.items():
            impl, found = getattr(layer, "impl", None), LAYER_INDEX.search(name)
            update = getattr(impl, "do_kv_cache_update", None)
            if update is None or found is None or getattr(impl, "_ctxrelay_wrapped", False):
                continue

            def wrapped(
                layer, key, value, kv_cache, slots, *a, _update=update, _i=int(found.group(1)),
                _g=self._group_of.get(name, 0), **kw,
            ):  # fmt: skip
                if self._recorder.active:
                    self._recorder.record(_i, key, value, slots, _g)
                return _update(layer, key, value, kv_cache, slots, *a, **kw)

            impl.do_kv_cache_update = wrapped
            impl._ctxrelay_wrapped = True
        self._wrapped = True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CtxrelayMetadata)
        for load in meta.loads:
            try:
                payload = KVPayload.load(load.path, load.token_ids, self.weights_hash, load.tenant)
                self._write(forward_context, load, payload)
                if load.per_request:
                    self._received.add(load.req_id)
            except (CtxrelayError, OSError, KeyError, IndexError, ValueError) as e:
                log.warning("ctxrelay K/V for request %s not loaded (%s): the engine computes it", load.req_id, e)
                if load.per_request:
                    self._failed.add(load.req_id)
                    continue
                first, last = load.start // self.block_size, (load.end - 1) // self.block_size
                self._load_errors.update(load.block_ids[0][first : last + 1])

    def _write(self, forward_context: ForwardContext, load: Load, payload: KVPayload) -> None:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        # per KV cache group, once: its slots and which positions have a real block (a sliding-window group
        # holds the null block where the window has passed: nothing is written there)
        by_group = []
        for blocks in load.block_ids:
            slots = slot_mapping(blocks, load.start, load.end, self.block_size)
            live = slots // self.block_size != NULL_BLOCK
            by_group.append((slots[live], live))
        for name, layer in forward_context.no_compile_layers.items():
            kv_cache = getattr(layer, "kv_cache", None)
            found = LAYER_INDEX.search(name)
            if kv_cache is None or found is None:
                continue
            if isinstance(kv_cache, list | tuple):
                kv_cache = kv_cache[0]
            i = int(found.group(1))
            num_blocks, kv_heads, block_size, fused = kv_cache.shape
            key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, block_size * 2, fused // 2).chunk(2, dim=2)
            slots, live = by_group[self._group_of.get(name, 0)]
            k = payload.keys[i][load.start : load.end][live].to(kv_cache.dtype)
            v = payload.values[i][load.start : load.end][live].to(kv_cache.dtype)
            isa = getattr(layer, "isa", None) or _get_attn_isa(kv_cache.dtype, block_size, fused // 2)
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        self._recorder.finish()  # after the step's forward: captures whose prompt was read to its end are written

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Per-request loads of this step: a failed one is also finished (vLLM then recomputes its tokens)."""
        done, failed = self._received | self._failed, self._failed
        self._received, self._failed = set(), set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
