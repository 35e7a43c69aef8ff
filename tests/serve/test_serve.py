"""The relay's own JSON API on tiny models (prefill, continue; tenants from keys, bad input), and
the server's settings: keys, the open mode's loopback rule, the queue bound."""

import pytest
from fastapi.testclient import TestClient

from conftest import SAMPLE_TEXT
from ctxrelay.errors import UsageError
from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay.serve.app import Settings, create_app
from ctxrelay.serve.auth import OPEN_TENANT, check_exposure, load_keys
from ctxrelay.serve.chat import transcript

ACME, GLOBEX = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}


@pytest.fixture(scope="module")
def pool(tiny_by_family):
    return ModelPool([tiny_by_family["llama"], tiny_by_family["qwen2"]], artifact_dirs=[], profile=Profile())


@pytest.fixture(scope="module")
def client(pool):
    return TestClient(create_app(pool, Settings(keys=load_keys(env="k1:acme,k2:globex")))), pool


def test_prefill_then_continue(client):
    c, pool = client
    llama, qwen = list(pool.models)
    r = c.post("/prefill", json={"sender": llama, "text": SAMPLE_TEXT}, headers=ACME)
    assert r.status_code == 200 and r.json()["tokens"] > 10 and "kv" in r.json()["captured"]
    assert r.json()["tenant"] == "acme"
    body = {"sender": llama, "receiver": llama, "text": SAMPLE_TEXT, "suffix": " Answer:", "max_new_tokens": 3}
    r = c.post("/continue", json=body, headers=ACME)
    assert r.status_code == 200 and r.json()["transport"] == "self" and len(r.json()["tokens"]) == 3
    r = c.post("/continue", json=dict(body, receiver=qwen), headers=ACME)
    assert r.json()["transport"] == "native" and "no calibrated artifact" in r.json()["reason"]
    metrics = c.get("/metrics").text
    assert 'ctxrelay_store_reads_total{result="hit"}' in metrics
    assert "ctxrelay_store_written_bytes_total 0.0" not in metrics


def test_one_turn_at_a_time_per_conversation(client):
    c, pool = client
    chat = {"model": next(iter(pool.models)), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    first = c.post("/v1/chat/completions", json={**chat, "conversation": "new"}, headers=ACME).json()
    conv = first["ctxrelay"]
    session = c.app.state.sessions.open(conv["conversation"], "acme")
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    c.app.state.engine.states.settle(session, None)  # built after the reply: wait as the next turn would
    # what the next turn relays: the serving model's state of the messages' content, its reply included
    assert session.state.text == transcript([*chat["messages"], reply]) and session.model == chat["model"]
    with session.busy:  # a turn of it is running
        r = c.post("/v1/chat/completions", json={**chat, "conversation": conv["conversation"]}, headers=ACME)
    assert r.status_code == 409 and "serving another turn" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={**chat, "conversation": conv["conversation"]}, headers=ACME)
    assert r.status_code == 200 and r.json()["ctxrelay"]["turn"] == 2


def test_other_tenant_gets_no_state(client):
    c, pool = client
    llama = next(iter(pool.models))
    c.post("/prefill", json={"sender": llama, "text": SAMPLE_TEXT}, headers=ACME)
    body = {"sender": llama, "receiver": llama, "text": SAMPLE_TEXT, "suffix": " Answer:", "max_new_tokens": 1}
    r = c.post("/continue", json=body, headers={**GLOBEX, "X-Tenant": "acme"})  # the key decides, not a header
    assert r.status_code == 200 and r.json()["transport"] == "native" and "no stored state" in r.json()["reason"]


def test_bad_requests_are_clear(client):
    c, pool = client
    llama = next(iter(pool.models))
    error = lambda r: r.json()["error"]["message"]
    r = c.post("/prefill", json={"sender": "gpt-99", "text": "x"}, headers=ACME)
    assert r.status_code == 404 and "not served here" in error(r)
    r = c.post("/prefill", json={"sender": llama, "text": ""}, headers=ACME)
    assert r.status_code == 400 and "text" in error(r)
    assert c.post("/prefill", json={"sender": llama, "text": "x"}).status_code == 401  # no key
    body = {"sender": llama, "receiver": llama, "text": "x", "transport": "telepathy"}
    r = c.post("/continue", json=body, headers=ACME)
    assert r.status_code == 400 and "transport must be one of" in error(r)
    assert c.get("/graph", headers=ACME).json()["edges"] == []
    chat = {"model": llama, "messages": [{"role": "wizard", "content": "hi"}]}
    r = c.post("/v1/chat/completions", json=chat, headers=ACME)
    assert r.status_code == 400 and "role must be one of" in error(r)
    r = c.post("/v1/chat/completions", json={**chat, "messages": [], "n": 2}, headers=ACME)
    assert r.status_code == 400 and "n must be 1" in error(r)
    r = c.post("/v1/chat/completions", json={**chat, "model": "gpt-99"}, headers=ACME)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_full_queue_answers_429_with_retry_after(pool):
    c = TestClient(create_app(pool, Settings(max_queue=0)))  # open mode: every request is tenant "local"
    chat = {"model": next(iter(pool.models)), "messages": [{"role": "user", "content": "hi"}]}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "ctxrelay_queue_rejected_total 1.0" in c.get("/metrics").text


def test_keys_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# operator keys\nsecret-a acme\nsecret-b:globex\n\n")
    keys = load_keys(f, env="secret-c:initech")
    assert sorted(keys.values()) == ["acme", "globex", "initech"] and "secret-a" not in keys  # digests only
    with pytest.raises(UsageError, match="KEY:TENANT"):
        load_keys(env="justakey")
    with pytest.raises(UsageError, match="does not exist"):
        load_keys(tmp_path / "missing", env="")


def test_no_keys_serves_only_loopback():
    check_exposure("127.0.0.1", {})
    check_exposure("localhost", {})
    check_exposure("0.0.0.0", {"digest": "acme"})
    with pytest.raises(UsageError, match="refusing to serve on 0.0.0.0"):
        check_exposure("0.0.0.0", {})
    assert OPEN_TENANT == "local"


def test_a_stream_that_cannot_get_compute_ends_with_an_error_event(pool):
    app = create_app(pool, Settings(request_timeout_s=0.2))
    c = TestClient(app)
    chat = {"model": next(iter(pool.models)), "messages": [{"role": "user", "content": "hi"}], "stream": True}
    engine = app.state.engine
    engine.compute.acquire()  # another turn holds the models
    try:
        r = c.post("/v1/chat/completions", json={**chat, "conversation": "new"})
    finally:
        engine.compute.release()
    events = [e for e in r.text.split("\n\n") if e]
    assert '"code": 503' in events[-2] and "waiting for compute" in events[-2] and events[-1] == "data: [DONE]"
    assert len(app.state.sessions) == 0  # the conversation whose first turn never ran is gone
    r = c.post("/v1/chat/completions", json={**chat, "stream": False})
    assert r.status_code == 200 and engine._depth == 0
