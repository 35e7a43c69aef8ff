"""The server stays responsive whatever its clients do, on a real server
over loopback: a client that goes away stops its turn and frees compute; /healthz, /metrics and
429 answer while compute is held and 100 requests wait; bodies over the limit get 413; a refusal
comes before a stream's first event; /healthz names its dependencies (503 with Redis down); a
malformed body's error says where."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_fixture import KEYS

from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay.serve.app import Settings, create_app
from ctxrelay.serve.auth import load_keys
from ctxrelay.serve.openai_api import Limits
from ctxrelay_bench.harness import serve_app
from local_redis import start_redis

LONG = 3000  # tokens: seconds of decode on a tiny model, far past every bound below
AUTH = {"Authorization": "Bearer k-acme"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pool(tiny_by_family):
    return ModelPool([tiny_by_family["llama"]], artifact_dirs=[], profile=Profile())


def serving(pool, **kw):
    """(url, app, stop): a real server on loopback; the test reaches its engine through app.state."""
    settings = Settings(keys=load_keys(env=KEYS), limits=Limits(max_tokens=LONG), **kw)
    app = create_app(pool, settings)
    url, stop = serve_app(app)
    return url, app, stop


@pytest.fixture(scope="module")
def server(pool):
    url, app, stop = serving(pool, max_body_bytes=1 << 20)
    yield url, app, next(iter(pool.models))
    stop()


def chat(url: str, model: str, timeout: float = 60, **body) -> httpx.Response:
    body = {"model": model, "messages": HI, "max_tokens": 1, **body}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=timeout)


def cancelled(url: str) -> float:
    line = next(ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith("ctxrelay_cancelled_total"))
    return float(line.split()[-1])


def idle_within(url: str, seconds: float) -> bool:
    """Whether the server has no admitted request and nothing computing within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        q = httpx.get(url + "/healthz").json()["queue"]
        if q["depth"] == 0 and not q["computing"]:
            return True
        time.sleep(0.02)
    return False


def read_then_close(url: str, body: dict, events: int = 3) -> None:
    """Stream a turn, read its first content events, then close the connection mid-decode."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += '"content": "' in line and '"content": ""' not in line
            if seen >= events:
                break
    # leaving the block closes the connection: the server sees the disconnect


def test_a_client_that_leaves_mid_stream_frees_compute_for_the_next_at_once(server):
    url, _, model = server
    before = cancelled(url)
    read_then_close(url, {"model": model, "messages": HI, "max_tokens": LONG})
    nxt = chat(url, model)  # sent at once: behind a decode for nobody it would wait seconds
    assert nxt.status_code == 200
    assert nxt.json()["ctxrelay"]["queue_wait_s"] < 1.0
    assert cancelled(url) == before + 1 and idle_within(url, 2.0)


def test_a_non_streamed_client_that_leaves_is_cancelled_too(server):
    url, _, model = server
    before = cancelled(url)
    with pytest.raises(httpx.ReadTimeout):
        chat(url, model, timeout=0.5, max_tokens=LONG)  # the client gives up and closes the connection
    assert idle_within(url, 2.0) and cancelled(url) == before + 1


def test_a_cancelled_turn_leaves_the_conversation_as_it_was(server):
    url, app, model = server
    first = chat(url, model, max_tokens=4, conversation="new").json()
    conv = first["ctxrelay"]["conversation"]
    history = [*HI, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    turn2 = [*history, {"role": "user", "content": "and then?"}]
    read_then_close(url, {"model": model, "messages": turn2, "max_tokens": LONG, "conversation": conv})
    assert idle_within(url, 2.0)
    session = app.state.sessions.open(conv, "acme")
    assert session.turns == 1 and session.messages == history  # nothing of the cancelled turn
    again = chat(url, model, messages=turn2, max_tokens=2, conversation=conv).json()["ctxrelay"]
    assert again["turn"] == 2 and again["transport"] == "self"  # from turn 1's state, intact


def test_healthz_metrics_and_429_answer_while_compute_is_held_and_100_wait(pool):
    url, app, stop = serving(pool, max_queue=100)
    engine, model = app.state.engine, next(iter(pool.models))
    engine.compute.acquire()  # a turn that never ends, as far as the waiting requests can tell
    held = True
    try:
        with ThreadPoolExecutor(100) as waiting:
            futures = [waiting.submit(chat, url, model) for _ in range(100)]
            deadline = time.monotonic() + 60
            while httpx.get(url + "/healthz").json()["queue"]["depth"] < 100:
                assert time.monotonic() < deadline, "the 100 requests were not all admitted"
                time.sleep(0.05)
            for path in ("/healthz", "/metrics"):
                t = time.perf_counter()
                r = httpx.get(url + path, timeout=5)
                assert r.status_code == 200 and time.perf_counter() - t < 1.0, path
            queue = httpx.get(url + "/healthz").json()["queue"]
            assert queue == {"depth": 100, "max": 100, "computing": True, "state_builds": 0}
            t = time.perf_counter()
            full = chat(url, model, timeout=5)
            assert full.status_code == 429 and time.perf_counter() - t < 1.0
            engine.compute.release()
            held = False
            assert [f.result().status_code for f in futures] == [200] * 100
    finally:
        if held:
            engine.compute.release()
        stop()


def test_bodies_over_the_limit_get_413_before_they_are_parsed(server):
    url, _, model = server
    big = {"model": model, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = httpx.post(url + "/v1/chat/completions", json=big, headers=AUTH, timeout=60)  # with Content-Length
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]
    data = httpx.Request("POST", url, json=big).content
    chunks = (data[i : i + 65536] for i in range(0, len(data), 65536))  # no Content-Length: counted as read
    r = httpx.post(url + "/v1/chat/completions", content=chunks, headers=AUTH, timeout=60)
    assert r.status_code == 413 and "over this server's limit" in r.json()["error"]["message"]
    assert chat(url, model).status_code == 200


def test_a_stream_over_the_window_is_refused_before_its_first_event(server):
    url, _, model = server
    long = [{"role": "user", "content": "word " * 5000}]  # over the tiny model's 4096 positions
    r = chat(url, model, messages=long, max_tokens=8, stream=True)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert "reads at most 4096 tokens" in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"
    client = openai.OpenAI(base_url=url + "/v1", api_key="k-acme", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="reads at most"):
        client.chat.completions.create(model=model, messages=long, max_tokens=8, stream=True)
    with pytest.raises(openai.BadRequestError, match="reads at most"):  # max_tokens counts against the window
        client.completions.create(model=model, prompt="word " * 1500, max_tokens=LONG, stream=True)


def test_a_malformed_body_says_line_and_column(server):
    url, _, model = server
    body = b'{"model": "%s",\n  "messages": [}' % model.encode()
    for path in ("/v1/chat/completions", "/prefill"):
        r = httpx.post(url + path, content=body, headers={**AUTH, "Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] is None, path
        assert "at line 2, column 16 (character" in err["message"] and "not valid JSON" in err["message"], path


def test_healthz_names_its_dependencies(server):
    url, _, _ = server
    h = httpx.get(url + "/healthz").json()
    assert h["ok"] and h["status"] == "ok" and h["down"] == []
    assert h["dependencies"] == {"state_store": [{"name": "memory", "ok": True}],
                                 "conversations": {"kind": "memory", "ok": True}}  # fmt: skip


@pytest.mark.redis
def test_healthz_is_503_while_the_redis_store_is_down(tiny_by_family, tmp_path):
    proc, redis_url = start_redis(tmp_path / "redis")
    pool = ModelPool([tiny_by_family["llama"]], store=f"memory+{redis_url}", artifact_dirs=[], profile=Profile())
    url, _, stop = serving(pool)  # sessions "auto": conversations in the same Redis
    try:
        h = httpx.get(url + "/healthz")
        assert h.status_code == 200 and h.json()["conversations"] == "redis"
        proc.kill()
        proc.wait()
        h = httpx.get(url + "/healthz", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "degraded"
        down = h.json()["down"]
        assert any(d.startswith("state store redis:") for d in down)
        assert any(d.startswith("conversation store redis:") for d in down)
        assert h.json()["dependencies"]["state_store"][0] == {"name": "memory", "ok": True}
    finally:
        proc.kill()
        stop()
