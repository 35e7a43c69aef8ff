"""The universal relay layer: transport graph, gate, state store and the Python API."""

from ctxrelay.relay.api import ModelPool, RelayResult
from ctxrelay.relay.store import DiskStore, MemoryStore, RedisStore, StateKey, StoreUnavailable, TieredStore

__all__ = [
    "DiskStore",
    "MemoryStore",
    "ModelPool",
    "RedisStore",
    "RelayResult",
    "StateKey",
    "StoreUnavailable",
    "TieredStore",
]
