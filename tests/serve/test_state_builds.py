"""The state a turn leaves is built after its reply (serve/state_builder.py): a stream's [DONE] never waits
for it, the next turn reads it and answers as the synchronous path did, a failed build makes the next
turn native with its reason, `store: false` leaves none, and the engine's close stops pending builds."""

import json
import re
import threading
import time

import httpx
import pytest
from server_fixture import relay_pool, start

from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay.serve.chat import render, transcript
from ctxrelay.serve.compute import ComputeLock
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.sessions import SessionStore
from ctxrelay.serve.state_builder import GAVE_WAY, NOT_STORED, StateBuilder

AUTH = {"Authorization": "Bearer k-acme"}
FIRST = [{"role": "user", "content": "Tell me about startups and how they grow."}]
NEXT = [{"role": "user", "content": "And companies?"}]


@pytest.fixture(scope="module")
def served(tiny_by_family):
    pool = ModelPool([tiny_by_family["llama"]], artifact_dirs=[], profile=Profile())
    url, stop = start(pool)
    yield url, pool, tiny_by_family["llama"].name
    stop()


def post(url: str, model: str, messages: list[dict], conversation: str, **extra) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 8, "conversation": conversation, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def healthz_builds(url: str) -> int:
    return httpx.get(url + "/healthz").json()["queue"]["state_builds"]


def gated(monkeypatch, pool: ModelPool) -> tuple[threading.Event, list]:
    """pool.prefill (the state build) waits for the returned event; its calls are listed."""
    gate, calls, real = threading.Event(), [], pool.prefill

    def prefill(*a, **kw):
        calls.append(kw)
        assert gate.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(pool, "prefill", prefill)
    return gate, calls


def test_a_streamed_first_turn_ends_before_its_state_is_built(served, monkeypatch):
    url, pool, llama = served
    gate, calls = gated(monkeypatch, pool)
    body = {"model": llama, "messages": FIRST, "max_tokens": 8, "conversation": "new", "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    report = json.loads(events[-2])["ctxrelay"]
    assert report["next_state"] == "prefill" and report["next_state_build"] == "background"
    assert healthz_builds(url) == 1 and not gate.is_set()  # the reply ended; its state is still being built
    gate.set()
    reply = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if '"choices"' in e)
    nxt = post(url, llama, [*FIRST, {"role": "assistant", "content": reply}, *NEXT], report["conversation"])
    r2 = nxt["ctxrelay"]
    assert r2["transport"] == "self" and r2["state_made"] == "prefilled" and r2["turn"] == 2, r2["reason"]
    assert len(calls) >= 1 and healthz_builds(url) in (0, 1)  # turn 2's own build may be running


def test_the_next_turn_answers_as_the_synchronous_path_did(served):
    url, pool, llama = served
    first = post(url, llama, FIRST, "new")
    conv, reply = first["ctxrelay"]["conversation"], first["choices"][0]["message"]["content"]
    second = post(url, llama, NEXT, conv)
    third = post(url, llama, [{"role": "user", "content": "Shorter."}], conv)
    r2, r3 = second["ctxrelay"], third["ctxrelay"]
    assert r2["transport"] == "self" and r2["state_made"] == "prefilled" and r2["next_state"] == "extend"
    assert r3["transport"] == "self" and r3["state_made"] == "extended", r3["reason"]
    assert r3["state_build_s"] > 0 and r3["state_wait_s"] >= 0
    # what the server did before: prefill the transcript inside the turn, then relay the next turn from it
    m = pool.models[llama]
    history = [*FIRST, {"role": "assistant", "content": reply}]
    state = pool.prefill(llama, transcript(history), "acme", store=False)
    sync = pool.continue_from(state, llama, render(m, NEXT, after_context=True), tenant="acme", max_new_tokens=8)
    assert second["choices"][0]["message"]["content"] == sync.text
    # and the extended state answers turn 3 as native prefill of the whole transcript does
    history += [*NEXT, {"role": "assistant", "content": sync.text}]
    shorter = render(m, [{"role": "user", "content": "Shorter."}], after_context=True)
    assert third["choices"][0]["message"]["content"] == pool.native(llama, transcript(history), shorter,
                                                                     max_new_tokens=8).text  # fmt: skip


def test_a_failed_build_makes_the_next_turn_native_with_its_reason(served, monkeypatch):
    url, pool, llama = served

    def fails(*a, **kw):
        raise RuntimeError("the build broke")

    monkeypatch.setattr(pool, "prefill", fails)
    conv = post(url, llama, FIRST, "new")["ctxrelay"]["conversation"]
    r2 = post(url, llama, NEXT, conv)["ctxrelay"]
    assert r2["transport"] == "native" and r2["turn"] == 2
    assert "could not be built (RuntimeError: the build broke): native prefill of the transcript" in r2["reason"]
    failures = re.search(r"^ctxrelay_state_build_failures_total (\S+)$", httpx.get(url + "/metrics").text, re.M)
    assert float(failures.group(1)) >= 1  # turn 2's own build fails too


def test_store_false_leaves_no_state(served, monkeypatch):
    url, pool, llama = served
    _, calls = gated(monkeypatch, pool)
    first = post(url, llama, FIRST, "new", store=False)["ctxrelay"]
    assert first["next_state"] == "none" and first["next_state_build"] is None
    assert healthz_builds(url) == 0 and calls == []
    r2 = post(url, llama, NEXT, first["conversation"], store=False)["ctxrelay"]
    assert r2["transport"] == "native" and r2["reason"] == f"{NOT_STORED}: native prefill of the transcript"
    assert calls == []


def test_close_stops_a_build_waiting_for_compute(tiny_by_family):
    pool = ModelPool([tiny_by_family["llama"]], artifact_dirs=[], profile=Profile())
    lock, sessions = ComputeLock(), SessionStore()
    lock.acquire()  # a turn computes: the build waits for it

    class Computing:
        def __init__(self, cancel):
            self.cancel = cancel

        def __enter__(self):
            lock.acquire(cancel=self.cancel)

        def __exit__(self, *exc):
            lock.release()

    builder = StateBuilder(pool, Computing, sessions, Metrics(), 60.0)
    s = sessions.open("new", "acme")
    name = tiny_by_family["llama"].name
    assert builder.leave(s, name, "acme", FIRST, "a reply", store=True) == "prefill"
    assert builder.pending == 1
    t = time.perf_counter()
    builder.close()
    assert time.perf_counter() - t < 5 and builder.pending == 0
    facts = builder.settle(s, None)
    assert s.state is None and "could not be built (Cancelled" in s.no_state and facts["state_made"] is None


def test_a_relayed_turn_leaves_its_own_models_prefill(tiny_by_family, tmp_path):
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    url, stop = start(relay_pool(llama, qwen, tmp_path))
    try:
        conv = post(url, llama.name, FIRST, "new")["ctxrelay"]["conversation"]
        r2 = post(url, qwen.name, NEXT, conv)["ctxrelay"]
        assert r2["relayed_from"] == llama.name and r2["next_state"] == "prefill"  # approximate: never extended
    finally:
        stop()


def test_the_first_turn_end_check_times_both_kinds_of_turn(served):
    """The serving check's mechanics on a tiny model (its ratio is a real model's number: not judged here)."""
    from ctxrelay_bench.serving_checks.first_turn import end_ratio_check

    url, _, llama = served
    opts = {"first_turn_tokens": 256, "first_turn_max_tokens": 4, "end_ratio_max": 1.10}
    row, detail = end_ratio_check(url, llama, AUTH, opts, 1)
    assert row["check"] == "first_turn_end_ratio" and row["value"] > 0
    assert detail["next_state"] == {"state": "prefill", "no_state": "none"}
    assert abs(detail["prompt_tokens"] - 256) <= 8 and len(detail["state_built_after_end_s"]) == 1


def test_the_edited_history_check_counts_an_edited_resend_as_a_fresh_send(served):
    """The serving check on a tiny model through a real server: the edit keeps the first question and reply,
    which are reused from the stored state, and the count equals the fresh one."""
    from ctxrelay_bench.serving_checks.edited_history import edited, edited_history_check

    url, _, llama = served
    assert edited("And lakes?") == "And lakex?"
    row, detail = edited_history_check(url, llama, AUTH, max_tokens=4)
    assert row == {"check": "edited_history_prompt_tokens_equal", "value": 0, "passed": True}, detail
    assert (detail["reuse"], detail["reused_messages"], detail["fresh_reuse"]) == ("content", 2, "none")
    assert detail["prefilled_tokens"] < detail["fresh_prompt_tokens"]  # the reused prefix was not read again


def deferred(url: str) -> float:
    m = re.search(r"^ctxrelay_state_builds_deferred_total (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1))


@pytest.fixture
def idle_engine(tiny_by_family):
    from ctxrelay.serve.engine import Engine

    engine = Engine(ModelPool([tiny_by_family["llama"]], artifact_dirs=[], profile=Profile()), Metrics())
    yield engine, tiny_by_family["llama"].name
    engine.close()


def test_a_build_made_only_because_the_server_was_idle_waits_while_requests_keep_it_busy(idle_engine, monkeypatch):
    """It never reads while requests keep coming; its conversation's next turn ends the wait at once."""
    engine, name = idle_engine
    engine.states.quiet_s = 0.02
    busy = [True]
    engine.states.idle = lambda: not busy[0]
    gate, calls = gated(monkeypatch, engine.pool)
    gate.set()
    s = SessionStore().open("new", "acme")
    assert engine.states.leave(s, name, "acme", FIRST, "a reply", store=True, gives_way=True) == "prefill"
    for _ in range(10):
        engine.states.give_way(None)  # other requests begin, one after another
        time.sleep(0.02)
    assert calls == [] and engine.states.pending == 1
    assert engine.metrics.state_builds_deferred._value.get() == 1
    engine.states.give_way(s)  # the conversation's own next turn
    engine.states.settle(s, None)
    assert s.state is not None and len(calls) == 1


def test_a_build_that_gives_way_stops_inside_the_runners_read_and_reads_again_once_idle(idle_engine, monkeypatch):
    """A request that begins while the runner reads the transcript stops it before its next layer (the compute
    lock free again at once); the build reads again once the server is idle."""
    engine, name = idle_engine
    engine.states.quiet_s = 0.02
    real, layers, tries = engine.pool.prefill, [], []

    def prefill(*a, check, **kw):
        tries.append(1)
        if len(tries) == 1:
            engine.states.give_way(None)  # a completion begins after the read began

        def counted() -> None:
            layers.append(len(tries))
            check()

        return real(*a, check=counted, **kw)

    monkeypatch.setattr(engine.pool, "prefill", prefill)
    s = SessionStore().open("new", "acme")
    engine.states.leave(s, name, "acme", FIRST, "a reply", store=True, gives_way=True)
    engine.states._pending[(s.tenant, s.id)].future.result(30)  # not settle: a next turn would hurry it
    engine.states.settle(s, None)
    n = engine.pool.models[name].spec.num_layers
    assert s.state is not None and layers == [1] + [2] * n and not engine.compute.held


def test_builds_kept_waiting_by_a_burst_read_one_at_a_time_once_it_ends(idle_engine, monkeypatch):
    """A burst of stateless requests leaves many waiting builds; when it ends they read one after another, never
    together (with an engine each read is a prefill in it: together they would flood the next burst)."""
    engine, name = idle_engine
    engine.states.quiet_s = 0.02
    busy = [True]
    engine.states.idle = lambda: not busy[0]
    real, inside, most = engine.pool.prefill, [0], [0]

    def prefill(*a, **kw):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        try:
            return real(*a, **kw)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(engine.pool, "prefill", prefill)
    convs = [SessionStore().open("new", "acme") for _ in range(5)]
    futures = []
    for s in convs:
        engine.states.leave(s, name, "acme", FIRST, "a reply", store=True, gives_way=True)
        futures.append(engine.states._pending[(s.tenant, s.id)].future)
    time.sleep(0.1)
    busy[0] = False  # the burst ends
    assert all(f.result(30)[0] is not None for f in futures)
    assert most[0] == 1 and inside[0] == 0


def test_a_build_kept_waiting_past_the_request_timeout_is_dropped_with_its_reason(tiny_by_family, monkeypatch):
    from ctxrelay.serve.engine import Engine

    engine = Engine(ModelPool([tiny_by_family["llama"]], artifact_dirs=[], profile=Profile()), Metrics(),
                    request_timeout_s=0.3)  # fmt: skip
    try:
        engine.states.quiet_s, engine.states.idle = 0.02, lambda: False  # never idle
        _, calls = gated(monkeypatch, engine.pool)
        s = SessionStore().open("new", "acme")
        engine.states.leave(s, tiny_by_family["llama"].name, "acme", FIRST, "a reply", store=True, gives_way=True)
        engine.states._pending[(s.tenant, s.id)].future.result(10)
        engine.states.settle(s, None)
        assert s.state is None and s.no_state == GAVE_WAY and calls == []
        assert engine.metrics.state_builds_given_way._value.get() == 1
    finally:
        engine.close()


def test_builds_that_do_not_give_way_and_idle_ones_left_alone_are_built(idle_engine):
    engine, name = idle_engine
    engine.states.quiet_s = 0.05
    named, idle = SessionStore().open("new", "acme"), SessionStore().open("new", "acme")
    engine.states.leave(named, name, "acme", FIRST, "a reply", store=True)
    engine.states.give_way(None)  # a request comes in: the named conversation's build is not held back
    engine.states.settle(named, None)
    engine.states.leave(idle, name, "acme", FIRST, "a reply", store=True, gives_way=True)
    engine.states.settle(idle, None)  # no request came: built after the quiet time
    assert named.state is not None and idle.state is not None and idle.state.num_tokens == named.state.num_tokens


def test_back_to_back_stateless_requests_do_not_wait_for_each_others_state(served):
    """One client sending requests without a conversation id one after another: the state of each (kept for
    reuse by content, built because the server is idle) waits while the next request is in."""
    url, _, llama = served
    before = deferred(url)
    for text in ("First question, no id.", "Second question, no id.", "Third question, no id."):
        body = {"model": llama, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["ctxrelay"]["next_state"] == "prefill", r.text
    deadline = time.monotonic() + 10  # a build notices it was kept waiting at the end of its quiet time
    while deferred(url) - before < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert deferred(url) - before >= 2  # the first two waited for the request after them


def test_a_build_starts_once_its_reply_has_left(idle_engine, monkeypatch):
    """An engine's read of the transcript takes the cores the reply's last chunks are sent on: it waits for
    them (the response's end), unless the conversation's next turn asks for the state first."""
    engine, name = idle_engine
    gate, calls = gated(monkeypatch, engine.pool)
    gate.set()
    sent, asked = threading.Event(), threading.Event()
    s, t = SessionStore().open("new", "acme"), SessionStore().open("new", "acme")
    engine.states.leave(s, name, "acme", FIRST, "a reply", store=True, sent=sent)
    future = engine.states._pending[(s.tenant, s.id)].future
    time.sleep(0.3)
    assert calls == [] and not future.done()
    sent.set()  # the response's last byte left
    assert future.result(30)[0] is not None and len(calls) == 1
    engine.states.leave(t, name, "acme", FIRST, "a reply", store=True, sent=asked)
    engine.states.settle(t, None)  # its next turn came before the reply's end was seen: built at once
    assert t.state is not None and len(calls) == 2
