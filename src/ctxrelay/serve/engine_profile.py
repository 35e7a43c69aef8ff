"""The gate's cost model when receivers decode in vLLM: native prefill is the ENGINE's, not ctxrelay's runner's.

Per served model, on its running engine: the native prefill (time to the first token of a prompt the engine's
prefix cache has not seen: a fresh cache salt each call) and the cost of a relayed request inside the engine
(its connector loading n tokens of K/V from a file and the engine prefilling the rest of the prompt). A relay's
predicted cost is then ctxrelay's own compute for the point (translation and recompute on its runner: the
runner profile, measured where it lacks the point) plus that engine-side cost. Measured once per machine,
engine mode and dtype, kept beside the runner profile (`profile-vllm-<isa>-<mode>-<dtype>.json`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ctxrelay import paths
from ctxrelay.engines.kv_payload import KVPayload
from ctxrelay.engines.vllm_params import cache_salt
from ctxrelay.engines.vllm_server import DTYPES
from ctxrelay.models import runner
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay.graph import NATIVE_KEY, CostModel, Profile
from ctxrelay.relay.profile import PROBE_SUFFIX, profile_pool, profiled_points, unprofiled
from ctxrelay.results import bf16_native

log = logging.getLogger("ctxrelay.serve")
LOAD_KEY = "engine_load_s"  # the engine's side of a relayed request: K/V load and the rest of the prompt


def profile_path(cache_dir: Path, isa: str, mode: str, dtype: str) -> Path:
    return cache_dir / f"profile-vllm-{isa}-{mode}-{dtype}.json"


def relay_profile_path(cache_dir: Path, isa: str, dtype: str) -> Path:
    """Where the runner's relay costs in a precision other than fp32 are kept (fp32's: paths.profile_path)."""
    return cache_dir / f"profile-relay-{isa}-{dtype}.json"


def relay_dtype(engine_dtype: str, isa: str, bf16: bool | None = None) -> torch.dtype:
    """The precision of the relay's own compute for an engine of `engine_dtype`: bf16 where the engine is bf16 and
    the CPU multiplies bf16 natively (the cache it loads is bf16 anyway; on gemma3 at 4096 tokens the recompute
    pass measured 1.7x faster than fp32 on the AVX512-bf16 EPYC), fp32 elsewhere (bf16 emulated is slower)."""
    return torch.bfloat16 if engine_dtype == "bfloat16" and bf16_native(isa, bf16) else torch.float32


def engine_costs(engine, text_for: Callable, lengths: list[int], prof: Profile, repeats: int = 3) -> Profile:
    """Add to `prof` the engine's native prefill and relayed-load cost of each served model it lacks, at
    `lengths` (one warm-up call each length, then the median of `repeats`)."""
    for name in engine.servers:
        m = engine.pool.models[name]
        if _covers(prof.native.get(m.spec.weights_hash), lengths):
            continue
        native, load = [], []
        for n in lengths:
            ids = torch.cat([context_ids(m, text_for(m, n)), suffix_ids(m, PROBE_SUFFIX)]).tolist()
            ctx = len(ids) - len(suffix_ids(m, PROBE_SUFFIX))
            native.append((len(ids), {NATIVE_KEY: _median(engine, name, ids, None, repeats)}))
            with torch.inference_mode():
                cache = runner.forward(m, torch.tensor(ids[:ctx])).cache
            dtype = DTYPES[engine.servers[name].dtype]
            payload = KVPayload.from_cache(cache, ids[:ctx], m.spec.weights_hash, "profile", True, dtype)
            load.append((len(ids), {LOAD_KEY: _median(engine, name, ids, payload, repeats)}))
            log.info("engine costs of %s at %d tokens: native %.2f s, relayed load %.2f s", name, len(ids),
                     native[-1][1][NATIVE_KEY], load[-1][1][LOAD_KEY])  # fmt: skip
        prof.native[m.spec.weights_hash] = CostModel.fit(native)
        prof.edges[f"{LOAD_KEY}@{m.spec.weights_hash}"] = CostModel.fit(load)
    prof.machine = {"engine": "vllm"}
    return prof


def _covers(cost: CostModel | None, lengths: list[int]) -> bool:
    """Whether `cost` was measured near each of `lengths` (a prompt of n context tokens is a few more)."""
    measured = [n for n, _ in cost.samples] if cost is not None else []
    return all(any(abs(m - n) <= 0.1 * n for m in measured) for n in lengths)


def _median(engine, model: str, ids: list[int], payload: KVPayload | None, repeats: int) -> float:
    _ttft(engine, model, ids, payload)  # warm-up
    return sorted(_ttft(engine, model, ids, payload) for _ in range(repeats))[repeats // 2]


def _ttft(engine, model: str, ids: list[int], payload: KVPayload | None) -> float:
    t = time.perf_counter()
    kv = None
    if payload is not None:
        path = engine.payload_dir / f"profile-{time.monotonic_ns()}.safetensors"
        kv = (payload.save(path), payload.tokens)
    salt = cache_salt("profile", str(t))  # a cold prefix cache every call
    res = engine.generate(model, ids, "profile", t, 1, 0.0, None, kv, None, "profile", salt=salt)
    return res.ttft_s


def compose(runner_profile: Profile, engine: Profile, pool) -> Profile:
    """The profile the gate reads with receivers in the engine: the engine's native costs, and each
    connector-servable point's runner cost plus its receiver's engine-side load cost."""
    out = Profile(native=dict(engine.native), machine={**runner_profile.machine, "engine": "vllm"})
    for key, (e, _point) in profiled_points(pool).items():
        cost = runner_profile.edges.get(key)
        load = engine.edges.get(f"{LOAD_KEY}@{e.receiver['weights_hash']}")
        if cost is None or load is None:
            continue
        out.edges[key] = CostModel({**cost.coeffs, **load.coeffs}, cost.samples, cost.artifact)
    return out


def prepare_gate(engine, text_for: Callable, lengths: list[int], path: Path, repeats: int = 3) -> Profile:
    """Measure what the gate lacks (the runner's costs of engine-servable points, the engine's costs, once per
    machine and engine setup) and hand the pool the composed profile."""
    pool = engine.pool
    served = {pool.models[name].spec.weights_hash for name in engine.servers}
    points = profiled_points(pool)
    missing = {k for k in unprofiled(pool) if k in points and points[k][0].receiver["weights_hash"] in served}
    if missing:
        log.info("measuring ctxrelay's relay compute for %d engine-servable points at %s tokens", len(missing), lengths)
        profile_pool(pool, text_for, lengths, repeats=1, merge=True, only=missing)
        if pool.profile_path is not None:
            pool.profile.save(pool.profile_path)
    runner_profile = pool.profile
    # the runner's own native costs (who reads a turn's state, vllm_engine): fp32's profile where the relay
    # computes in another precision (its profile holds only the relay's points)
    fp32 = pool.compute_dtype == torch.float32
    engine.runner_profile = runner_profile if fp32 else Profile.load(paths.profile_path())
    costs = Profile.load(path) if path.exists() else Profile()
    if not all(_covers(costs.native.get(pool.models[name].spec.weights_hash), lengths) for name in engine.servers):
        engine_costs(engine, text_for, lengths, costs, repeats)
        costs.save(path)
    pool.refresh(compose(runner_profile, costs, pool))
    return pool.profile
