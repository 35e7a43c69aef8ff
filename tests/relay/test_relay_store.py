"""State stores: paged memory pool, disk, a real Redis server (killed mid-run), tiers, tenants."""

import pytest
import torch

from ctxrelay.relay.store import (
    DiskStore,
    MemoryStore,
    RedisStore,
    StateKey,
    StoreFull,
    StoreUnavailable,
    TieredStore,
    open_store,
)
from ctxrelay.state import BindingError, ContextState
from ctxrelay_bench.reliability import faults
from local_redis import start_redis


def make_state(text: str, tenant: str = "acme", kv_tokens: int = 64) -> ContextState:
    return faults.make_state(text, tenant, tokens=kv_tokens)


def same(a: ContextState, b: ContextState) -> bool:
    return a.text == b.text and torch.equal(a.keys_pre_rope, b.keys_pre_rope) and torch.equal(a.values, b.values)


def test_memory_pool_round_trip_and_accounting():
    store = MemoryStore(budget_bytes=1 << 20, page_bytes=4096)
    s = make_state("doc one")
    key = store.put(s)
    assert same(store.get(key, "acme"), s)
    acc = store.accounting()
    assert acc["states"] == 1 and acc["pages_used"] == -(-acc["bytes_stored"] // 4096)
    assert store.get(StateKey("acme", "0" * 64, "w" * 64), "acme") is None


def test_memory_pool_evicts_lru_but_never_pinned():
    s1, s2, s3 = (make_state(f"doc {i}", kv_tokens=200) for i in range(3))
    size = len(s1.to_bytes())
    store = MemoryStore(budget_bytes=2 * size + 4096, page_bytes=1024)
    k1, k2 = store.put(s1), store.put(s2)
    store.get(k1, "acme")  # k1 is now most recently used -> k2 is evicted first
    k3 = store.put(s3)
    assert store.get(k2, "acme") is None and same(store.get(k1, "acme"), s1) and same(store.get(k3, "acme"), s3)
    assert store.accounting()["evictions"] == 1
    with store.using(k1, "acme") as pinned, store.using(k3, "acme"):
        assert same(pinned, s1)
        with pytest.raises(StoreFull, match="pinned"):
            store.put(make_state("doc 4", kv_tokens=200))
        with pytest.raises(StoreUnavailable, match="in use"):
            store.delete(k1)
    assert same(store.get(k1, "acme"), s1)  # nothing pinned was lost


def test_cross_tenant_read_is_refused(tmp_path):
    for store in (MemoryStore(1 << 20, 4096), DiskStore(tmp_path)):
        key = store.put(make_state("secret plan", tenant="acme"))
        with pytest.raises(BindingError, match="globex"):
            store.get(key, "globex")
        forged = StateKey("globex", key.content_hash, key.model_hash)
        assert store.get(forged, "globex") is None  # globex has no such state of its own
        assert store.keys("globex") == [] and store.keys("acme") == [key]


def test_disk_store_survives_restart_and_reports_corruption(tmp_path):
    s = make_state("persistent doc")
    key = DiskStore(tmp_path).put(s)
    assert same(DiskStore(tmp_path).get(key, "acme"), s)  # a new process (new object) reads it back
    path = next(tmp_path.rglob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreUnavailable, match="unreadable"):
        DiskStore(tmp_path).get(key, "acme")


def test_disk_store_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    s = make_state("doc")
    key = store.put(s)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ctxrelay.tensorfile.os.replace", disk_full)
    with pytest.raises(StoreUnavailable, match="No space"):
        store.put(s)
    monkeypatch.undo()
    assert same(store.get(key, "acme"), s)
    assert not list(tmp_path.rglob("*.tmp"))  # no half-written leftovers


def test_open_store_specs(tmp_path):
    assert isinstance(open_store("memory:64MiB"), MemoryStore)
    assert isinstance(open_store(f"memory+disk:{tmp_path}"), TieredStore)
    with pytest.raises(ValueError, match="unknown store"):
        open_store("s3://bucket")


# ---- redis: a real server ----------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path):
    proc, url = start_redis(tmp_path)
    yield proc, url
    proc.kill()
    proc.wait()


@pytest.mark.redis
def test_redis_store_shares_states_between_clients(redis_server):
    _, url = redis_server
    s = make_state("shared doc")
    key = RedisStore(url).put(s)
    other_process_client = RedisStore(url)
    assert same(other_process_client.get(key, "acme"), s)
    assert other_process_client.keys("acme") == [key]
    with pytest.raises(BindingError):
        other_process_client.get(key, "globex")


@pytest.mark.redis
def test_killing_redis_degrades_without_losing_disk_states(redis_server, tmp_path):
    proc, url = redis_server
    disk_dir = tmp_path / "disk"
    store = TieredStore([RedisStore(url), DiskStore(disk_dir)])
    states = [make_state(f"doc {i}") for i in range(3)]
    keys = [store.put(s) for s in states]
    proc.kill()
    proc.wait()
    with pytest.raises(StoreUnavailable):
        RedisStore(url).get(keys[0], "acme")
    for k, s in zip(keys, states, strict=True):  # served from disk; the failure is recorded, not raised
        assert same(store.get(k, "acme"), s)
    assert any("redis" in e for e in store.errors)
    k4 = store.put(make_state("written while redis is down"))
    assert DiskStore(disk_dir).get(k4, "acme") is not None
    only_redis = TieredStore([RedisStore(url)])
    with pytest.raises(StoreUnavailable, match="every store tier failed"):
        only_redis.get(keys[0], "acme")
