"""How a vLLM engine is told about ctxrelay's connector, without importing vLLM (the router runs in a venv
without it): the engine's `kv_transfer_config`, a request's `kv_transfer_params`, the CPU build's
environment, and the prefix-cache salt that keeps tenants and approximate K/V apart."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CONNECTOR_MODULE = "ctxrelay.engines.vllm_connector"
PARAM = "ctxrelay_kv"  # the kv_transfer_params key naming the K/V file
CAPTURE = "ctxrelay_capture"  # the kv_transfer_params key naming where a relay source's K/V is left


def transfer_config(weights_hash: str) -> dict:
    """vLLM's `kv_transfer_config` that loads the connector for a model of these weights; a load that fails
    is recomputed by the engine."""
    return {
        "kv_connector": "CtxrelayConnector", "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"weights_hash": weights_hash},
    }  # fmt: skip


def transfer_params(path: str | Path, tokens: int, tenant: str) -> dict:
    """`SamplingParams.extra_args` of a request whose first `tokens` prompt tokens come from the file at `path`."""
    return {"kv_transfer_params": kv_params(path, tokens, tenant)}


def kv_params(path: str | Path, tokens: int, tenant: str) -> dict:
    """A request's `kv_transfer_params` (the OpenAI server's request field of that name)."""
    return {PARAM: str(path), "tokens": tokens, "tenant": tenant}


def capture_params(path: str | Path, tenant: str) -> dict:
    """A request's `kv_transfer_params` asking the engine to leave its prompt's K/V at `path` (a relay
    source: the router builds the sender's state of it)."""
    return {CAPTURE: str(path), "tenant": tenant}


def cache_salt(tenant: str, relay: str = "") -> str:
    """The engine's prefix-cache salt: per tenant, so another tenant's identical prompt never hits its blocks,
    and per relay where the K/V is approximate, so it never satisfies a later exact lookup."""
    return hashlib.sha256(f"ctxrelay\0{tenant}\0{relay}".encode()).hexdigest()[:32]


def cpu_engine_env(kv_space_gib: float, env: dict | None = None) -> dict:
    """What vLLM's CPU build needs on a small machine, unless set already: the paged cache's size, and its
    OpenMP threads bound to every core (auto binding reserves cores for the scheduler). Sets `env`
    (os.environ by default) and returns it."""
    env = os.environ if env is None else env
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_space_gib:g}")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
    env.setdefault("CTXRELAY_ENGINE_IDLE_SPIN_S", "0.05")  # engines/vllm_idle.py: the worker's idle spin, capped
    return env
