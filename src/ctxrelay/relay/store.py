"""Where context states live between the sender's prefill and a receiver's request.

One interface, three backends:
- `MemoryStore`: in-process paged pool (default). States are serialised into fixed-size pages of
  one preallocated-on-demand arena; byte budget, LRU eviction, reference counts pin states in use.
- `DiskStore`: safetensors files, atomic writes, checksummed, survives restart.
- `RedisStore`: a real Redis server, so processes and machines share states.
`TieredStore` chains them (read the fastest tier that has it, write to all), tolerating tier failures.

Keys are tenant + content hash + sender weights hash. A tenant can never read another tenant's
state: the key carries the tenant and the state's own binding is checked on every read. Store
failures raise `StoreUnavailable`; the relay turns them into native prefill, never into an error.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxrelay import tensorfile
from ctxrelay.errors import CtxrelayError, UsageError
from ctxrelay.state import BindingError, ContextState


class StoreUnavailable(CtxrelayError, RuntimeError):
    """The backend cannot serve right now (server down, disk full, corrupt entry)."""


class StoreFull(StoreUnavailable):
    pass


@dataclass(frozen=True)
class StateKey:
    tenant: str
    content_hash: str
    model_hash: str

    @staticmethod
    def of(state: ContextState) -> StateKey:
        b = state.binding
        return StateKey(b.tenant, state.content_hash, b.weights_hash)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.content_hash[:16]}/{self.model_hash[:16]}"

    @property
    def slug(self) -> str:
        return f"{self.content_hash}-{self.model_hash}"


def _checked(state: ContextState, key: StateKey, tenant: str) -> ContextState:
    if tenant != key.tenant or state.binding.tenant != tenant:
        raise BindingError(f"tenant {tenant!r} may not read state {key} (owned by {state.binding.tenant!r})")
    if StateKey.of(state) != key:
        raise StoreUnavailable(f"store entry {key} holds a different state; treating it as corrupt")
    return state


def _refuse_cross_tenant(key: StateKey, tenant: str) -> None:
    if tenant != key.tenant:
        raise BindingError(f"tenant {tenant!r} may not read state {key} (owned by {key.tenant!r})")


class StateStore:
    """Interface. `get` returns None on a miss; raises StoreUnavailable when it cannot tell."""

    name = "store"

    def put(self, state: ContextState) -> StateKey:
        raise NotImplementedError

    def get(self, key: StateKey, tenant: str) -> ContextState | None:
        raise NotImplementedError

    def delete(self, key: StateKey) -> None:
        raise NotImplementedError

    def keys(self, tenant: str) -> list[StateKey]:
        raise NotImplementedError

    @contextmanager
    def using(self, key: StateKey, tenant: str):
        """Read and pin a state for the duration of a request (only the memory pool pins)."""
        yield self.get(key, tenant)


# ---- memory: paged pool -----------------------------------------------------------------------


@dataclass
class _Entry:
    pages: list[int]
    nbytes: int
    refs: int = 0


class MemoryStore(StateStore):
    """Serialised states in fixed-size pages of one arena; LRU eviction of unpinned states."""

    name = "memory"

    def __init__(self, budget_bytes: int = 4 << 30, page_bytes: int = 1 << 20):
        self.page_bytes = page_bytes
        self.num_pages = max(1, budget_bytes // page_bytes)
        self._arena: torch.Tensor | None = None  # allocated on first put
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._entries: OrderedDict[StateKey, _Entry] = OrderedDict()  # LRU order: oldest first
        self._lock = threading.RLock()
        self.evictions = 0

    @property
    def arena(self) -> torch.Tensor:
        if self._arena is None:
            self._arena = torch.empty(self.num_pages, self.page_bytes, dtype=torch.uint8)
        return self._arena

    def _evict_for(self, pages_needed: int) -> None:
        for key in list(self._entries):
            if len(self._free) >= pages_needed:
                return
            if self._entries[key].refs == 0:
                self._release(key)
                self.evictions += 1
        if len(self._free) < pages_needed:
            raise StoreFull(
                f"memory store needs {pages_needed} pages but only {len(self._free)} are free "
                f"and the rest are pinned by requests in use (budget {self.num_pages * self.page_bytes >> 20} MiB)"
            )

    def _release(self, key: StateKey) -> None:
        entry = self._entries.pop(key)
        self._free.extend(reversed(entry.pages))

    def put(self, state: ContextState) -> StateKey:
        key = StateKey.of(state)
        data = torch.frombuffer(bytearray(state.to_bytes()), dtype=torch.uint8)
        need = -(-data.numel() // self.page_bytes)
        if need > self.num_pages:
            raise StoreFull(f"state of {data.numel() >> 20} MiB exceeds the memory store budget")
        with self._lock:
            if key in self._entries:
                self._release(key)
            self._evict_for(need)
            pages = [self._free.pop() for _ in range(need)]
            for i, p in enumerate(pages):
                chunk = data[i * self.page_bytes : (i + 1) * self.page_bytes]
                self.arena[p, : chunk.numel()] = chunk
            self._entries[key] = _Entry(pages, data.numel())
        return key

    def _read(self, key: StateKey) -> ContextState | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            data = self.arena[entry.pages].reshape(-1)[: entry.nbytes].numpy().tobytes()
        return ContextState.from_bytes(data, f"memory store entry {key}")

    def get(self, key: StateKey, tenant: str) -> ContextState | None:
        _refuse_cross_tenant(key, tenant)
        state = self._read(key)
        return None if state is None else _checked(state, key, tenant)

    @contextmanager
    def using(self, key: StateKey, tenant: str):
        _refuse_cross_tenant(key, tenant)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.refs += 1
        try:
            yield self.get(key, tenant)
        finally:
            with self._lock:
                if entry is not None:
                    entry.refs -= 1

    def delete(self, key: StateKey) -> None:
        with self._lock:
            if key in self._entries:
                if self._entries[key].refs:
                    raise StoreUnavailable(f"state {key} is in use by a request; not deleted")
                self._release(key)

    def keys(self, tenant: str) -> list[StateKey]:
        with self._lock:
            return [k for k in self._entries if k.tenant == tenant]

    def accounting(self) -> dict:
        with self._lock:
            used = self.num_pages - len(self._free)
            return {
                "backend": "memory",
                "page_bytes": self.page_bytes,
                "pages_total": self.num_pages,
                "pages_used": used,
                "bytes_stored": sum(e.nbytes for e in self._entries.values()),
                "states": len(self._entries),
                "pinned": sum(1 for e in self._entries.values() if e.refs),
                "evictions": self.evictions,
                "internal_fragmentation": 1
                - sum(e.nbytes for e in self._entries.values()) / max(1, used * self.page_bytes),
            }


# ---- disk -------------------------------------------------------------------------------------


class DiskStore(StateStore):
    """One sealed file per state; a write goes to a temporary file renamed into place (tensorfile.write),
    so a reader sees the old entry or the new one. Temporaries a killed writer left are never read as
    entries; opening the store removes those older than `sweep_after_s` (None: keep them)."""

    name = "disk"

    def __init__(self, root: str | Path, sweep_after_s: float | None = 3600.0):
        self.root = Path(root)
        if sweep_after_s is not None:
            self.sweep(sweep_after_s)

    def sweep(self, older_than_s: float) -> int:
        """Delete the temporaries of writes that never finished (older than `older_than_s`); returns how many."""
        now, removed = time.time(), 0
        for p in self.root.glob("*/.*.tmp") if self.root.is_dir() else []:
            try:
                if now - p.stat().st_mtime >= older_than_s:
                    p.unlink()
                    removed += 1
            except OSError:
                continue  # another process finished or removed it
        return removed

    def _path(self, key: StateKey) -> Path:
        if "/" in key.tenant or key.tenant.startswith("."):
            raise UsageError(f"tenant name {key.tenant!r} may not contain '/' or start with '.'")
        return self.root / key.tenant / f"{key.slug}.safetensors"

    def put(self, state: ContextState) -> StateKey:
        key = StateKey.of(state)
        try:
            tensorfile.write(self._path(key), *state.to_tensors())
        except OSError as e:  # disk full, permissions: the old file (if any) is untouched
            raise StoreUnavailable(f"disk store cannot write {key}: {e}") from None
        return key

    def get(self, key: StateKey, tenant: str) -> ContextState | None:
        _refuse_cross_tenant(key, tenant)
        path = self._path(key)
        if not path.exists():
            return None
        try:
            state = ContextState.load(path, mapped=True)  # entries are only ever replaced whole (put)
        except (tensorfile.TensorFileError, OSError) as e:
            raise StoreUnavailable(f"disk store entry {key} is unreadable: {e}") from None
        return _checked(state, key, tenant)

    def delete(self, key: StateKey) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self, tenant: str) -> list[StateKey]:
        d = self.root / tenant
        out = []
        for p in sorted(d.glob("*.safetensors")) if d.exists() else []:
            content, sep, model = p.stem.partition("-")
            if sep:  # anything else in the folder is not an entry
                out.append(StateKey(tenant, content, model))
        return out


# ---- redis ------------------------------------------------------------------------------------


class RedisStore(StateStore):
    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "ctxrelay:state",
        ttl_s: int | None = None,
        timeout_s: float = 2.0,
    ):
        import redis

        self._redis_errors = (redis.exceptions.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix, self.ttl_s = prefix, ttl_s

    def _k(self, key: StateKey) -> str:
        return f"{self.prefix}:{key.tenant}:{key.content_hash}:{key.model_hash}"

    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except self._redis_errors as e:
            raise StoreUnavailable(f"redis store cannot {what}: {e}") from None

    def put(self, state: ContextState) -> StateKey:
        key = StateKey.of(state)
        self._call("write", self.client.set, self._k(key), state.to_bytes(), ex=self.ttl_s)
        return key

    def get(self, key: StateKey, tenant: str) -> ContextState | None:
        _refuse_cross_tenant(key, tenant)
        data = self._call("read", self.client.get, self._k(key))
        if data is None:
            return None
        try:
            state = ContextState.from_bytes(data, f"redis entry {key}")
        except tensorfile.TensorFileError as e:
            raise StoreUnavailable(str(e)) from None
        return _checked(state, key, tenant)

    def delete(self, key: StateKey) -> None:
        self._call("delete", self.client.delete, self._k(key))

    def keys(self, tenant: str) -> list[StateKey]:
        out = []
        for raw in self._call("scan", lambda: list(self.client.scan_iter(f"{self.prefix}:{tenant}:*"))):
            _, _, t, content, model = raw.decode().split(":")
            out.append(StateKey(t, content, model))
        return out


# ---- tiers ------------------------------------------------------------------------------------


class TieredStore(StateStore):
    """Write to every tier that works; read the first tier that has the state.

    A failing tier is skipped (and reported in `errors`); only when every tier fails does a call
    raise StoreUnavailable. A state found in a slower tier is copied into the faster ones.
    """

    name = "tiered"

    def __init__(self, tiers: list[StateStore]):
        self.tiers = tiers
        self.errors: list[str] = []

    def put(self, state: ContextState) -> StateKey:
        ok = None
        for t in self.tiers:
            try:
                ok = t.put(state)
            except StoreUnavailable as e:
                self.errors.append(f"{t.name}: {e}")
        if ok is None:
            raise StoreUnavailable("no store tier accepted the state: " + "; ".join(self.errors[-len(self.tiers) :]))
        return ok

    def get(self, key: StateKey, tenant: str) -> ContextState | None:
        _refuse_cross_tenant(key, tenant)
        failures = 0
        for i, t in enumerate(self.tiers):
            try:
                state = t.get(key, tenant)
            except StoreUnavailable as e:
                self.errors.append(f"{t.name}: {e}")
                failures += 1
                continue
            if state is not None:
                for faster in self.tiers[:i]:
                    try:
                        faster.put(state)
                    except StoreUnavailable as e:
                        self.errors.append(f"{faster.name}: {e}")
                return state
        if failures == len(self.tiers):
            raise StoreUnavailable("every store tier failed: " + "; ".join(self.errors[-failures:]))
        return None

    def delete(self, key: StateKey) -> None:
        for t in self.tiers:
            try:
                t.delete(key)
            except StoreUnavailable as e:
                self.errors.append(f"{t.name}: {e}")

    def keys(self, tenant: str) -> list[StateKey]:
        seen: dict[StateKey, None] = {}
        for t in self.tiers:
            try:
                seen.update(dict.fromkeys(t.keys(tenant)))
            except StoreUnavailable as e:
                self.errors.append(f"{t.name}: {e}")
        return list(seen)


def open_store(spec: str) -> StateStore:
    """'memory', 'memory:4GiB', 'disk:/path', 'redis://host:port/db', or several joined by '+'."""
    parts = spec.split("+")
    if len(parts) > 1:
        return TieredStore([open_store(p) for p in parts])
    if spec == "memory" or spec.startswith("memory:"):
        budget = spec.split(":", 1)[1] if ":" in spec else "4GiB"
        return MemoryStore(budget_bytes=_parse_bytes(budget))
    if spec.startswith("disk:"):
        return DiskStore(spec[5:])
    if spec.startswith("redis://"):
        return RedisStore(spec)
    raise UsageError(f"unknown store {spec!r}: use memory[:SIZE], disk:PATH, redis://HOST:PORT/DB, joined by '+'")


def _parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(t)
