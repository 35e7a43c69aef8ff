"""/healthz: whether this server can serve, and what it depends on.

The dependencies are the state store's tiers (memory, disk, Redis) and the conversation store
(this process, or Redis). Memory is always there; a disk tier must be writable; a Redis tier or
conversation store must answer PING. Any dependency down makes serving degraded: 503 with a body
that names what is down (a load balancer stops sending here; the turns would fail or lose their
states). The checks that touch the network run in a thread, one at a time (concurrent callers
share the check in flight), bounded by `timeout_s`; without Redis nothing leaves the event loop.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from ctxrelay.relay.store import DiskStore, RedisStore, StateStore, TieredStore
from ctxrelay.serve.metrics import CountedStore
from ctxrelay.serve.sessions import Conversations
from ctxrelay.serve.shared_sessions import RedisSessionStore


def tiers(store: StateStore) -> list[StateStore]:
    """The backends of a state store, outside in (the server's counting wrapper and tiers unwrapped)."""
    if isinstance(store, CountedStore):
        return tiers(store.inner)
    if isinstance(store, TieredStore):
        return [b for t in store.tiers for b in tiers(t)]
    return [store]


def _ping(client: Any) -> str | None:
    try:
        client.ping()
        return None
    except Exception as e:  # redis errors, OSError: whatever it is, the dependency is down
        return f"{type(e).__name__}: {e}"


def _writable(root: Path) -> str | None:
    p = root
    while not p.exists() and p != p.parent:  # the store makes its folders on first write
        p = p.parent
    return None if os.access(p, os.W_OK | os.X_OK) else f"{root} is not writable"


class Health:
    def __init__(self, store: StateStore, sessions: Conversations, timeout_s: float = 1.0):
        self.store, self.sessions, self.timeout_s = store, sessions, timeout_s
        self._running: asyncio.Task | None = None

    def _needs_thread(self) -> bool:
        return isinstance(self.sessions, RedisSessionStore) or any(
            isinstance(t, RedisStore | DiskStore) for t in tiers(self.store)
        )

    def _check(self) -> dict:
        """{"state_store": [{"name", "ok", "error"?}, ...], "conversations": {"kind", "ok", "error"?}} (blocking)."""
        state = []
        for t in tiers(self.store):
            err = None
            if isinstance(t, RedisStore):
                err = _ping(t.client)
            elif isinstance(t, DiskStore):
                err = _writable(t.root)
            state.append({"name": t.name, "ok": err is None, **({"error": err} if err else {})})
        err = _ping(self.sessions.client) if isinstance(self.sessions, RedisSessionStore) else None
        conv = {"kind": self.sessions.kind, "ok": err is None, **({"error": err} if err else {})}
        return {"state_store": state, "conversations": conv}

    async def dependencies(self) -> dict:
        if not self._needs_thread():
            return self._check()
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(asyncio.to_thread(self._check))
        try:
            return await asyncio.wait_for(asyncio.shield(self._running), self.timeout_s)
        except TimeoutError:
            why = {"ok": False, "error": f"no answer within {self.timeout_s:g} s"}
            remote = lambda t: isinstance(t, RedisStore | DiskStore)
            conv_ok = not isinstance(self.sessions, RedisSessionStore)
            return {
                "state_store": [{"name": t.name, **(why if remote(t) else {"ok": True})} for t in tiers(self.store)],
                "conversations": {"kind": self.sessions.kind, **({"ok": True} if conv_ok else why)},
            }


def down(deps: dict) -> list[str]:
    """What is down, in words."""
    out = [f"state store {t['name']}: {t['error']}" for t in deps["state_store"] if not t["ok"]]
    c = deps["conversations"]
    if not c["ok"]:
        out.append(f"conversation store {c['kind']}: {c['error']}")
    return out
