"""Several `ctxrelay serve` processes on one Redis serve one conversation (serve/shared_sessions.py).

Two real server processes over the same two tiny models (saved as local HF directories; the
llama -> qwen2 edge passes the gate through an artifact and a cost profile in their cache) and one
local redis-server. Across the processes: a conversation moves between them and between models,
outlives the process that served it, stays with its tenant, runs one turn at a time, and leaves
only plain data in Redis. The module's processes are shared, in file order: the last tests kill A, then Redis.
"""

import json
import re
import signal
import time

import httpx
import openai
import pytest
import redis
from processes import launch, save_chat_model, serve_env
from safetensors.torch import load as load_safetensors
from server_fixture import KEYS, relay_pool

from ctxrelay import zoo
from ctxrelay.relay.store import MemoryStore
from ctxrelay.serve.errors import ApiError
from ctxrelay.serve.sessions import Session
from ctxrelay.serve.shared_sessions import GONE, RedisSessionStore
from local_redis import start_redis

pytestmark = pytest.mark.redis

QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a startup?"}]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def cluster(redis_url, tiny_by_family, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiproc")
    cache = tmp / "cache"
    (cache / "artifacts").mkdir(parents=True)
    dirs = [save_chat_model(tiny_by_family[f], tmp / f"tiny-{f}-chat") for f in ("llama", "qwen2")]
    llama, qwen = (zoo.load(d) for d in dirs)  # as the servers load them: the same hashes
    relay_pool(llama, qwen, cache / "artifacts").profile.save(cache / "profile.json")
    args = ["--models", ",".join(map(str, dirs)), "--store", redis_url, "--quality-threshold", "0"]
    servers = [launch(args, serve_env(cache, KEYS), tmp) for _ in "AB"]  # both load at once
    try:
        a, b = (s.wait_up() for s in servers)
        assert httpx.get(a.url + "/healthz").json()["conversations"] == "redis"  # --sessions auto, a redis store
        yield a, b, redis.Redis.from_url(redis_url), llama.spec.name, qwen.spec.name
    finally:
        for s in servers:
            s.stop(signal.SIGKILL)


def client(url: str, key: str = "k-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def turn(url: str, model: str, messages: list[dict], conversation: str, key: str = "k-acme") -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": 8, "conversation": conversation}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def reply(completion) -> dict:
    return {"role": "assistant", "content": completion.choices[0].message.content}


def built(r: redis.Redis, conv: str) -> dict:
    """A conversation's record once the state its last turn left is built (after the reply) and named."""
    deadline = time.monotonic() + 60
    while (record := json.loads(r.get(f"ctxrelay:conv:acme:{conv}")))["building"] is not None or r.exists(
        f"ctxrelay:conv-build:acme:{conv}"
    ):  # named, then the build's lease ended
        assert time.monotonic() < deadline, "the state was never built"
        time.sleep(0.02)
    return record


def state_key(r: redis.Redis, conv: str) -> str:
    """The Redis key of the state a conversation's record names."""
    return "ctxrelay:state:acme:{content_hash}:{model_hash}".format(**built(r, conv)["state"])


def started(url: str, model: str, messages: list[dict] = QUESTION) -> str:
    """A new conversation with one turn served by `url`; returns its id."""
    r = turn(url, model, messages, "new")
    assert r.status_code == 200, r.text
    return r.json()["ctxrelay"]["conversation"]


def test_a_long_turn_keeps_its_lock_and_only_its_holder_saves_or_releases(redis_url):
    """The lock outlives its expiry while the turn runs (renewed); a turn that lost it saves nothing."""
    r = redis.Redis.from_url(redis_url)
    store = RedisSessionStore(r, MemoryStore(1 << 20, 4096), prefix="ctxrelay-lock-test", lock_ttl_s=0.3)
    try:
        s = store.open("new", "acme")
        store.hold(s)
        lock = store.lock_key("acme", s.id)
        time.sleep(1.0)  # three expiries
        assert r.exists(lock) and 0 < r.pttl(lock) <= 300
        with pytest.raises(ApiError, match="serving another turn"):
            store.hold(Session(s.id, "acme"))  # another request for the same conversation
        store.release(s)
        assert not r.exists(lock)
        # a turn whose lock expired and went to another turn is not saved, and leaves that lock alone
        late = store.open("new", "acme")
        store.hold(late)
        late.messages, late.turns = [{"role": "user", "content": "hi"}], 1
        r.set(store.lock_key("acme", late.id), "another-turn")
        with pytest.raises(ApiError, match="lost its turn lock") as e:
            store.save(late)
        assert e.value.status_code == 409 and not r.exists(store.record_key("acme", late.id))
        store.release(late)
        assert r.get(store.lock_key("acme", late.id)) == b"another-turn"
    finally:
        store.close()


def test_a_state_whose_builder_went_away_is_not_waited_for(redis_url):
    """A record says `building` under a lease its builder renews; without the lease nobody waits for it, and a
    build that ends after a later turn moved on names nothing."""
    r = redis.Redis.from_url(redis_url)
    store = RedisSessionStore(r, MemoryStore(1 << 20, 4096), prefix="ctxrelay-build-test", lock_ttl_s=0.3)
    try:
        s = store.open("new", "acme")
        store.hold(s)
        s.messages, s.turns, s.model, s.building = [{"role": "user", "content": "hi"}], 1, "m", time.time()
        store.save(s)
        store.release(s)
        other = store.open(s.id, "acme")
        time.sleep(0.5)  # past the lease's expiry: renewed while this process builds
        store.refresh(other)
        assert other.building is not None
        with store._mutex:
            store._builds.clear()  # the builder goes away: nobody renews its lease
        time.sleep(0.5)
        store.refresh(other)
        assert other.building is None and other.state is None and other.no_state == GONE
        assert store.attach(s, 2, None, "late")[1].startswith("a later turn moved on")
    finally:
        store.close()


def test_another_tenants_key_gets_404_on_every_process(cluster):
    a, b, _, llama, _ = cluster
    conv = started(a.url, llama)
    unknown = turn(b.url, llama, QUESTION, "conv-" + "x" * 24, key="k-globex").json()["error"]["message"]
    for url in (a.url, b.url):
        r = turn(url, llama, QUESTION, conv, key="k-globex")
        assert r.status_code == 404 and r.json()["error"]["message"] == unknown.replace("conv-" + "x" * 24, conv)
    owner = turn(b.url, llama, [{"role": "user", "content": "More?"}], conv)
    assert owner.status_code == 200 and owner.json()["ctxrelay"]["turn"] == 2, owner.text  # B sees it, for its tenant


def test_a_turn_lock_held_elsewhere_answers_409_until_it_expires(cluster):
    a, b, r, llama, _ = cluster
    conv = started(a.url, llama)
    lock = f"ctxrelay:conv-lock:acme:{conv}"
    assert not r.exists(lock)  # A released it after its turn
    r.set(lock, "a-process-that-died-mid-turn", px=1500)
    refused = turn(b.url, llama, [{"role": "user", "content": "Next?"}], conv)
    assert refused.status_code == 409 and "serving another turn" in refused.json()["error"]["message"]
    assert r.get(lock) == b"a-process-that-died-mid-turn"  # B neither took nor dropped another's lock
    deadline = time.monotonic() + 10
    while r.exists(lock):
        assert time.monotonic() < deadline, "the lock never expired"
        time.sleep(0.1)
    served = turn(b.url, llama, [{"role": "user", "content": "Next?"}], conv)
    assert served.status_code == 200 and served.json()["ctxrelay"]["turn"] == 2 and not r.exists(lock)


def test_redis_holds_json_records_and_safetensors_states_only(cluster):
    _, b, r, llama, _ = cluster
    conv = started(b.url, llama)
    record = json.loads(r.get(f"ctxrelay:conv:acme:{conv}"))
    assert record["tenant"] == "acme" and record["model"] == llama and record["turns"] == 1
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
    assert r.exists(state_key(r, conv))
    kinds = {}
    for key in map(bytes.decode, r.scan_iter("ctxrelay:*")):
        kind = key.split(":")[1]
        if kind == "conv-lru":
            assert all(m.decode().startswith("ctxrelay:conv:") for m in r.zrange(key, 0, -1))
        elif kind == "conv-prefix":  # the tenant's content index: prefix hash -> a conversation id of that tenant
            entries, tenant = r.hgetall(key).items(), key.split(":")[2]
            assert all(len(h) == 64 and r.exists(f"ctxrelay:conv:{tenant}:{i.decode()}") for h, i in entries)
        elif kind == "conv-state-refs":  # state -> how many records name it
            assert all(r.exists(f"ctxrelay:state:{k.decode()}") and int(n) > 0 for k, n in r.hgetall(key).items())
        else:
            value = r.get(key)
            assert not value.startswith(b"\x80")  # pickle protocol 2+ opens with 0x80
            assert json.loads(value)["version"] == 1 if kind == "conv" else load_safetensors(value)
        kinds[kind] = kinds.get(kind, 0) + 1
    assert set(kinds) == {"conv", "conv-lru", "conv-state-refs", "conv-prefix", "state"}, kinds  # no lock left


def test_conversations_with_one_transcript_share_its_state_until_the_last_moves_on(cluster):
    _, b, r, llama, _ = cluster
    one, two = started(b.url, llama), started(b.url, llama)
    shared = state_key(r, one)
    assert state_key(r, two) == shared  # the same transcript on the same model: one state
    assert turn(b.url, llama, [{"role": "user", "content": "Next?"}], one).json()["ctxrelay"]["turn"] == 2
    assert r.exists(shared)  # `two` still names it
    second = turn(b.url, llama, [{"role": "user", "content": "Other?"}], two).json()["ctxrelay"]
    assert second["transport"] == "self" and second["turn"] == 2, second["reason"]


def test_a_state_gone_from_the_store_means_a_native_turn_that_says_so(cluster):
    _, b, r, llama, _ = cluster
    conv = started(b.url, llama, [{"role": "user", "content": "A question nobody else asks?"}])
    r.delete(state_key(r, conv))  # as Redis eviction or an expiry would
    body = turn(b.url, llama, [{"role": "user", "content": "Next?"}], conv).json()["ctxrelay"]
    assert body["transport"] == "native" and "no longer in the state store" in body["reason"] and body["turn"] == 2


def test_a_resent_history_is_found_by_content_on_any_process(cluster):
    """No id: process B finds the conversation A served by its messages (the content index is in Redis), relays
    it to the other model, and an edited resend branches from the common prefix without reading it twice."""
    a, b, r, llama, qwen = cluster
    ca, cb = client(a.url), client(b.url)
    opening = [{"role": "user", "content": "Which planet is largest?"}]
    first = ca.chat.completions.create(model=llama, messages=opening, max_tokens=8)
    conv = first.ctxrelay["conversation"]
    history = [*opening, reply(first), {"role": "user", "content": "And smallest?"}]
    second = cb.chat.completions.create(model=qwen, messages=history, max_tokens=8)
    r2 = second.ctxrelay
    assert (r2["conversation"], r2["reuse"], r2["reused_messages"], r2["turn"]) == (conv, "content", 2, 2)
    assert r2["transport"] == "heterofold" and r2["relayed_from"] == llama, r2["reason"]
    built(r, conv)
    edited = [*opening, reply(first), {"role": "user", "content": "And smallesT?"}, reply(second),
              {"role": "user", "content": "Why?"}]  # fmt: skip
    branch = ca.chat.completions.create(model=qwen, messages=edited, max_tokens=8)
    fresh = ca.chat.completions.create(model=qwen, messages=edited, max_tokens=8, extra_body={"store": False})
    rb = branch.ctxrelay
    assert (rb["reuse"], rb["reused_messages"], rb["turn"]) == ("content", 2, 1) and rb["conversation"] != conv
    assert branch.usage.prompt_tokens == fresh.usage.prompt_tokens  # the history is never read twice
    assert json.loads(r.get(f"ctxrelay:conv:acme:{conv}"))["messages"] == [*history, reply(second)]  # untouched
    metrics = httpx.get(b.url + "/metrics").text
    assert re.search(r'^ctxrelay_content_reuse_total\{result="hit"\} [1-9]', metrics, re.M)


def test_a_client_chosen_id_names_one_conversation_per_tenant_on_every_process(cluster):
    a, b, r, llama, _ = cluster
    opening = [{"role": "user", "content": "Remember the word tulip."}]
    first = turn(a.url, llama, opening, "my-chat-1")
    assert first.status_code == 200 and first.json()["ctxrelay"]["conversation"] == "my-chat-1", first.text
    said = {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}
    history = [*opening, said, {"role": "user", "content": "Which word?"}]
    headers = {"Authorization": "Bearer k-acme", "X-Session-ID": "my-chat-1"}
    body = {"model": llama, "messages": history, "max_tokens": 8}
    second = httpx.post(b.url + "/v1/chat/completions", json=body, headers=headers, timeout=120).json()["ctxrelay"]
    assert (second["conversation"], second["turn"], second["reuse"], second["transport"]) == (
        "my-chat-1", 2, "id", "self"), second["reason"]  # fmt: skip
    other = turn(b.url, llama, history, "my-chat-1", key="k-globex").json()["ctxrelay"]
    assert (other["turn"], other["reuse"]) == (1, "none")  # globex's own my-chat-1, and acme's content unseen
    assert json.loads(r.get("ctxrelay:conv:globex:my-chat-1"))["tenant"] == "globex"
    assert json.loads(r.get("ctxrelay:conv:acme:my-chat-1"))["turns"] == 2


def test_the_content_index_forgets_a_conversation_dropped_past_max_sessions(redis_url):
    r = redis.Redis.from_url(redis_url)
    store = RedisSessionStore(r, MemoryStore(1 << 20, 4096), prefix="ctxrelay-index-test", max_sessions=1)
    first = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        old = store.open("new", "acme")
        store.hold(old)
        old.messages, old.turns = first, 1
        store.save(old)
        store.release(old)
        ask = [*first, {"role": "user", "content": "more"}]
        assert store.find("acme", ask, 2) == [(old.id, 2)] and store.find("globex", ask, 2) == []
        new = store.open("new", "acme")
        store.hold(new)
        new.messages, new.turns = [{"role": "user", "content": "other"}, {"role": "assistant", "content": "x"}], 1
        store.save(new)  # past max_sessions: `old` goes, and its index entries with it
        store.release(new)
        assert store.find("acme", ask, 2) == [] and r.hlen("ctxrelay-index-test:conv-prefix:acme") == 1
    finally:
        store.close()


def test_a_conversation_moves_between_processes_and_models_and_outlives_a_killed_one(cluster):
    a, b, r, llama, qwen = cluster
    ca, cb = client(a.url), client(b.url)
    first = ca.chat.completions.create(model=llama, messages=QUESTION, max_tokens=8, extra_body={"conversation": "new"})
    conv = first.ctxrelay["conversation"]
    history = [*QUESTION, reply(first), {"role": "user", "content": "And a company?"}]
    # turn 2 on B with the other model: relayed through the gate from the state A left in Redis
    second = cb.chat.completions.create(model=qwen, messages=history, max_tokens=8, extra_body={"conversation": conv})
    r2 = second.ctxrelay
    assert r2["transport"] == "heterofold" and r2["relayed_from"] == llama and r2["turn"] == 2, r2["reason"]
    assert 0 < r2["prefilled_tokens"] < second.usage.prompt_tokens  # only the new turn was prefilled
    # turn 3 back on A: qwen again, from the state B left (its own K/V: exact)
    history += [reply(second), {"role": "user", "content": "Shorter."}]
    third = ca.chat.completions.create(model=qwen, messages=history, max_tokens=8, extra_body={"conversation": conv})
    assert third.ctxrelay["transport"] == "self" and third.ctxrelay["turn"] == 3, third.ctxrelay["reason"]
    built(r, conv)  # A stored the state its turn left (after the reply): a kill after that loses nothing
    assert a.stop(signal.SIGKILL) == -signal.SIGKILL
    # turn 4 on B: A is gone, what it saved is not; B extends the state A left by the new turn
    fourth = cb.chat.completions.create(
        model=qwen, messages=[{"role": "user", "content": "Again."}], max_tokens=8, extra_body={"conversation": conv}
    )
    r4 = fourth.ctxrelay
    assert r4["transport"] == "self" and r4["relayed_from"] == qwen and r4["turn"] == 4, r4["reason"]
    assert r4["state_made"] == "extended" and r4["next_state"] == "extend"  # A extended its state; B extends A's
    record = json.loads(r.get(f"ctxrelay:conv:acme:{conv}"))
    assert record["messages"] == [*history, reply(third), {"role": "user", "content": "Again."}, reply(fourth)]
    assert record["turns"] == 4 and record["model"] == qwen


def test_without_redis_a_turn_answers_503_with_the_reason(cluster, redis_url):
    _, b, r, llama, _ = cluster
    conv = started(b.url, llama)
    r.shutdown(nosave=True)
    refused = turn(b.url, llama, [{"role": "user", "content": "Next?"}], conv)
    assert refused.status_code == 503 and "conversation store (redis) is unavailable" in refused.text
    assert turn(b.url, llama, QUESTION, "").status_code == 200  # a turn without a conversation still serves
