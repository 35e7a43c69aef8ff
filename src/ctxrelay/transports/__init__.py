"""Transports: how a receiver gets the shared context from a sender's state.

The contract and the registry are in base.py; each transport is one module or package here:
self_kv (a model continuing from its own K/V), mapflow (attention-map reuse), heterofold
(cross-family KV translation).
"""

from ctxrelay.transports.base import (
    TIMING_KEYS,
    CapturePlan,
    RelayOutput,
    Transport,
    UnknownTransport,
    check_edge,
    get,
    loaded,
    names,
    register,
    unregister,
)

__all__ = [
    "TIMING_KEYS",
    "CapturePlan",
    "RelayOutput",
    "Transport",
    "check_edge",
    "UnknownTransport",
    "get",
    "loaded",
    "names",
    "register",
    "unregister",
]
