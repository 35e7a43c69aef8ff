"""Reliability of the state stores behind live requests: tenant isolation, injected disk and Redis
faults, crash safety, the memory budget. Each function returns one category's counts (`Count`);
`ctxrelay bench reliability` and tests/reliability run them.

A request is a `ModelPool.prefill` or `continue_from` on a tiny model. It failed when it raised or
answered other tokens than native prefill of the same text does (the store's troubles may change
how a request is served, never what it answers).
"""

from __future__ import annotations

import errno
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxrelay.errors import BindingError, CtxrelayError
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.store import DiskStore, MemoryStore, RedisStore, StateKey, StateStore, StoreFull, TieredStore
from ctxrelay.state import content_hash
from ctxrelay_bench.harness import start_redis
from ctxrelay_bench.reliability import faults
from ctxrelay_bench.reliability.fuzz import edit_manifest

SUFFIX = " Question: what is it about? Answer:"
BASE_TEXT = "Startups are companies designed to grow fast. The quick brown fox jumps over the lazy dog."


@dataclass
class Count:
    """One category's tallies, the columns of the README's reliability table."""

    cases: int = 0
    faults_injected: int = 0
    requests: int = 0
    requests_failed: int = 0
    entries_lost: int = 0
    entries_corrupt: int = 0
    unhandled: int = 0
    details: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few, for the report

    @property
    def clean(self) -> bool:
        """Cases were tried and none failed, crashed, lost or corrupted anything."""
        bad = self.requests_failed + self.unhandled + self.entries_lost + self.entries_corrupt
        return self.cases > 0 and bad == 0

    def fail(self, why: str) -> None:
        self.requests_failed += 1
        if len(self.failures) < 5:
            self.failures.append(why[:300])

    def row(self, category: str) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("details", "failures")}
        return {"category": category, "transport": "any", **out, "details": self.details, "failures": self.failures}


class Requests:
    """Requests against a pool, each checked against native prefill's answer for the same text."""

    def __init__(self, pool: ModelPool, model: str, count: Count, max_new_tokens: int = 4):
        self.pool, self.model, self.count, self.n = pool, model, count, max_new_tokens
        self._reference: dict[str, list[int]] = {}
        self.reasons: dict[str, int] = {}

    def reference(self, text: str) -> list[int]:
        if text not in self._reference:
            self._reference[text] = self.pool.native(self.model, text, SUFFIX, max_new_tokens=self.n).tokens
        return self._reference[text]

    def prefill(self, text: str, tenant: str) -> None:
        self.count.requests += 1
        try:
            self.pool.prefill(self.model, text, tenant)
        except Exception as e:  # noqa: BLE001 - a prefill must survive any store trouble
            self.count.unhandled += not isinstance(e, CtxrelayError)
            self.count.fail(f"prefill raised {type(e).__name__}: {e}")

    def ask(self, text: str, tenant: str) -> str:
        """continue_from by text (the state is looked up in the store); returns what the lookup found:
        "found" (the state: relayed, or natively where the gate preferred it), "missing" or "unavailable"."""
        self.count.requests += 1
        try:
            res = self.pool.continue_from(
                text, self.model, SUFFIX, tenant=tenant, sender=self.model, max_new_tokens=self.n
            )
        except Exception as e:  # noqa: BLE001
            self.count.unhandled += not isinstance(e, CtxrelayError)
            self.count.fail(f"continue_from raised {type(e).__name__}: {e}")
            return "failed"
        if res.tokens != self.reference(text):
            self.count.fail(f"wrong answer via {res.transport} ({res.reason})")
        found = lookup(res.reason)
        key = f"{res.transport}: {res.reason.split(' (')[0][:60]}"
        self.reasons[key] = self.reasons.get(key, 0) + 1
        return found


def lookup(reason: str) -> str:
    """What the pool's store lookup found, from a result's reason (relay/api.py words them)."""
    if reason.startswith("state store unavailable"):
        return "unavailable"
    if reason.startswith("no stored state"):
        return "missing"
    return "found"


# ---- tenant isolation --------------------------------------------------------------------------

TENANT = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)


def tenant_isolation(pool: ModelPool, model: str, root: Path, cases: int = 200, pool_cases: int = 30) -> Count:
    """Random tenants and texts in every backend: no read of another tenant's state through any call."""
    c = Count()
    cross = {"reads_refused": 0, "own_lookups_empty": 0, "violations": 0}
    req = Requests(pool, model, c)
    kept = pool.store
    stores: list[Callable[[], StateStore]] = [
        lambda: MemoryStore(1 << 20, 4096),
        lambda: DiskStore(root / f"t{c.cases}"),
        lambda: TieredStore([MemoryStore(1 << 20, 4096), DiskStore(root / f"tt{c.cases}")]),
    ]

    @settings(max_examples=cases, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(
        tenants=st.lists(TENANT, min_size=2, max_size=4, unique=True),
        texts=st.lists(st.text(min_size=1, max_size=24), min_size=1, max_size=3),
        which=st.integers(0, len(stores) - 1),
    )
    def one(tenants, texts, which) -> None:
        c.cases += 1
        store = stores[which]()
        owned = {}
        for i, text in enumerate(texts):
            owner = tenants[i % len(tenants)]
            owned[(owner, content_hash(text))] = store.put(faults.make_state(text, owner, tokens=4))
        for (owner, h), key in owned.items():
            for other in tenants:
                if other == owner:
                    continue
                try:
                    store.get(key, other)
                    cross["violations"] += 1
                except BindingError:
                    cross["reads_refused"] += 1
                mine = store.get(StateKey(other, h, key.model_hash), other)
                if mine is None:
                    cross["own_lookups_empty"] += 1
                elif mine.binding.tenant != other:
                    cross["violations"] += 1
                if any(k.tenant != other for k in store.keys(other)):
                    cross["violations"] += 1
        if c.cases <= pool_cases:  # through the pool: another tenant's text finds nothing of theirs
            pool.store = MemoryStore(1 << 20, 4096)
            text = f"{texts[0]} {BASE_TEXT}"
            req.prefill(text, tenants[0])
            if req.ask(text, tenants[1]) == "found":
                cross["violations"] += 1
            try:
                state = pool.prefill(model, text, tenants[0], store=False)
                pool.continue_from(state, model, SUFFIX, tenant=tenants[1], max_new_tokens=1)
                cross["violations"] += 1
            except BindingError:
                cross["reads_refused"] += 1

    try:
        one()
    finally:
        pool.store = kept
    c.details = {**cross, "backends": ["memory", "disk", "memory+disk"], "pool_cases": min(cases, pool_cases)}
    c.requests_failed += cross["violations"]
    return c


# ---- disk faults behind requests ---------------------------------------------------------------


def disk_faults(pool: ModelPool, model: str, root: Path) -> Count:
    """Each errno at each write call, under live requests: the request is served (native where the
    state could not be stored), the entry already there survives intact, no temporary is left."""
    c = Count()
    req = Requests(pool, model, c)
    kept = pool.store
    try:
        for fault, err in faults.ERRORS.items():
            for stage in faults.STAGES:
                c.cases += 1
                where = root / "disk-faults" / f"{fault}-{stage}"
                pool.store = DiskStore(where)
                old, new = f"{fault} {stage} old. {BASE_TEXT}", f"{fault} {stage} new. {BASE_TEXT}"
                old_key = StateKey.of(pool.prefill(model, old, "acme", store=False))
                req.prefill(old, "acme")
                with faults.os_fault(stage, err) as hits:
                    req.prefill(new, "acme")  # cannot be stored: the request still gets its state
                    req.prefill(old, "acme")  # an overwrite that fails keeps the old entry
                    served_new, served_old = req.ask(new, "acme"), req.ask(old, "acme")
                c.faults_injected += hits.n
                a = faults.audit(where)
                c.entries_corrupt += a.corrupt + a.debris
                c.entries_lost += DiskStore(where).get(old_key, "acme") is None
                if served_new != "missing" or served_old != "found":
                    c.fail(f"{fault} at {stage}: served {served_new} / {served_old}")
    finally:
        pool.store = kept
    kinds = [f"disk {k.replace('_', ' ')} ({errno.errorcode[e]})" for k, e in faults.ERRORS.items()]
    c.details = {"kinds": kinds, "stages": list(faults.STAGES), "served": req.reasons}
    return c


def tampered_entries(pool: ModelPool, model: str, root: Path, cases: int = 6) -> Count:
    """A disk entry edited to claim another tenant or model: never served, the request goes native."""
    c = Count()
    req = Requests(pool, model, c)
    kept = pool.store
    try:
        pool.store = store = DiskStore(root / "tampered")
        for i in range(cases):
            c.cases += 1
            text = f"tampered {i}. {BASE_TEXT}"
            req.prefill(text, "acme")
            key = StateKey.of(pool.prefill(model, text, "acme", store=False))
            path = store._path(key)
            forged = store._path(StateKey("globex", key.content_hash, key.model_hash))
            forged.parent.mkdir(parents=True, exist_ok=True)
            forged.write_bytes(edit_manifest(path.read_bytes(), lambda m: m["binding"].update(tenant="globex")))
            c.faults_injected += 1
            if req.ask(text, "globex") != "unavailable":
                c.fail("a forged entry was served")
            if req.ask(text, "acme") != "found":
                c.fail("the owner's entry was not served")
    finally:
        pool.store = kept
    c.details = {"kinds": ["entry edited to claim another tenant"], "served": req.reasons}
    return c


def sigkill_mid_write(root: Path, kills: int = 20) -> Count:
    rep = faults.kill_mid_write(root, kills=kills)
    c = Count(cases=rep.kills, faults_injected=rep.kills, entries_lost=rep.lost, entries_corrupt=rep.corrupt)
    c.details = {"kinds": ["SIGKILL mid-write"], **rep.as_dict()}
    return c


def same_key_race(root: Path, writes: int = 30) -> Count:
    r = faults.race_same_key(root, writes=writes)
    c = Count(cases=1, requests=r["reads"] + r["torn_reads"], requests_failed=r["torn_reads"] + r["failed_writers"],
              entries_corrupt=r["corrupt"], entries_lost=int(not r["final_verifies"]))  # fmt: skip
    c.details = r
    return c


# ---- the memory budget -------------------------------------------------------------------------


def memory_budget(contexts: int = 300, budget_states: int = 12, seed: int = 0) -> Count:
    """Hundreds of contexts through a budget of a dozen: pages never exceed it, LRU order is kept,
    a pinned state is never evicted, every state read back is the one written."""
    rng = random.Random(seed)
    states = [faults.make_state(f"context {i}", tokens=rng.randrange(16, 128)) for i in range(contexts)]
    size = max(len(s.to_bytes()) for s in states)
    store = MemoryStore(budget_bytes=budget_states * size, page_bytes=4096)
    c = Count(cases=contexts)
    pinned_ok = lru_ok = 0
    keys: list[StateKey] = []
    text_of = {s.content_hash: s.text for s in states}
    with _pins(store) as pin:
        for s in states:
            try:
                keys.append(store.put(s))
            except StoreFull:  # only when pins hold the whole budget: refused, never an eviction of a pin
                c.details["refused_full"] = c.details.get("refused_full", 0) + 1
                continue
            acc = store.accounting()
            if acc["pages_used"] > acc["pages_total"]:
                c.entries_corrupt += 1
            if rng.random() < 0.05 and len(pin.keys) < budget_states // 3:
                pin(keys[-1])
            if rng.random() < 0.3 and len(keys) > 1:  # read an older one back
                k = rng.choice(keys[:-1])
                got = store.get(k, k.tenant)
                if got is not None and got.text != text_of[k.content_hash]:
                    c.entries_corrupt += 1
            for k in pin.keys:  # a pinned state is always there
                pinned_ok += store.get(k, k.tenant) is not None
                c.entries_lost += store.get(k, k.tenant) is None
        recent = keys[-3:]
        lru_ok = sum(store.get(k, k.tenant) is not None for k in recent)
    acc = store.accounting()
    c.details = {"budget_states": budget_states, "evictions": acc["evictions"], "pinned_checks": pinned_ok,
                 "most_recent_kept": lru_ok, "states_held": acc["states"]}  # fmt: skip
    c.entries_lost += len(recent) - lru_ok  # the most recently written are never the ones evicted
    return c


@contextmanager
def _pins(store: MemoryStore) -> Iterator:
    """`pin(key)` holds `store.using(key)` (a request in flight) until the block ends."""
    with ExitStack() as stack:

        def pin(key: StateKey) -> None:
            stack.enter_context(store.using(key, key.tenant))
            pin.keys.append(key)

        pin.keys = []
        yield pin


# ---- redis: a real server, killed, paused, slowed, full ---------------------------------------


@contextmanager
def redis_server(root: Path) -> Iterator[tuple[subprocess.Popen, str] | None]:
    """A throwaway redis-server (None where it is not installed), killed (and resumed first) at the end."""
    started = start_redis(root)
    try:
        yield started
    finally:
        if started is not None:
            proc = started[0]
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()


REDIS_FAULTS = ("maxmemory", "slowed", "slowed_past_timeout", "paused", "killed")


def redis_faults(pool: ModelPool, model: str, root: Path) -> Count:
    """Redis at maxmemory, slowed, paused (SIGSTOP) and killed under live requests: each request is
    served (native with the store's reason where Redis cannot answer), nothing wrong is answered."""
    c = Count()
    with redis_server(root / "redis") as srv:
        if srv is None:
            c.details = {"skipped": "redis-server is not installed"}
            return c
        proc, url = srv
        req = Requests(pool, model, c)
        kept = pool.store
        pool.store = store = RedisStore(url, timeout_s=0.5)
        try:
            text = f"redis. {BASE_TEXT}"
            req.prefill(text, "acme")
            served = {"healthy": req.ask(text, "acme")}
            store.client.config_set("maxmemory-policy", "noeviction")
            store.client.config_set("maxmemory", "1")  # full: every write refused
            req.prefill(f"too big. {BASE_TEXT}", "acme")
            served["maxmemory"] = req.ask(f"too big. {BASE_TEXT}", "acme")  # its write was refused
            served["maxmemory_read"] = req.ask(text, "acme")  # what was there is still read
            store.client.config_set("maxmemory", "0")
            with _paused(url, 0.2):  # slowed: an answer within the timeout
                served["slowed"] = req.ask(text, "acme")
            with _paused(url, 1.5):  # longer than the client's timeout
                served["slowed_past_timeout"] = req.ask(text, "acme")
            proc.send_signal(signal.SIGSTOP)
            served["paused"] = req.ask(text, "acme")
            req.prefill(f"while paused. {BASE_TEXT}", "acme")
            proc.send_signal(signal.SIGCONT)
            served["resumed"] = req.ask(text, "acme")
            proc.kill()
            proc.wait()
            served["killed"] = req.ask(text, "acme")
            req.prefill(f"while dead. {BASE_TEXT}", "acme")
            c.faults_injected = sum(k in REDIS_FAULTS for k in served)
            c.cases = len(served)
            want = {"healthy": "found", "maxmemory": "missing", "maxmemory_read": "found", "slowed": "found",
                    "resumed": "found",
                    "slowed_past_timeout": "unavailable", "paused": "unavailable", "killed": "unavailable"}  # fmt: skip
            for k, v in served.items():
                if v != want[k]:
                    c.fail(f"redis {k}: served by {v}, expected {want[k]}")
        finally:
            pool.store = kept
        c.details = {"kinds": [f"redis {k}" for k in REDIS_FAULTS if k in served], "served": served,
                     "reasons": req.reasons}  # fmt: skip
    return c


@contextmanager
def _paused(url: str, seconds: float) -> Iterator[None]:
    """CLIENT PAUSE: the server holds every client's commands for `seconds` (a slow server); the
    block ends after the pause has."""
    import redis

    admin = redis.Redis.from_url(url)
    admin.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
    end = time.monotonic() + seconds
    try:
        yield
    finally:
        time.sleep(max(0.0, end - time.monotonic()) + 0.05)
        admin.close()
