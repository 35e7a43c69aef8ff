"""Reuse keyed by content (serve/reuse.py, serve/content_index.py) in one server process on tiny models: a
client that only resends its history continues its conversation's exact state on the same model and relays
it to another, an edited history reuses the common prefix and is never read twice, client-chosen ids are
hints within their tenant, `store: false` opts out, and /metrics counts hits and misses."""

import re

import pytest
import torch
from fastapi.testclient import TestClient
from server_fixture import KEYS, relay_pool

from ctxrelay.models.capture import capture_state
from ctxrelay.serve.app import Settings, create_app
from ctxrelay.serve.auth import load_keys
from ctxrelay.serve.chat import render, transcript
from ctxrelay.serve.content_index import MemoryIndex, prefix_hashes
from ctxrelay.serve.reuse import prefix_state

ACME, GLOBEX = "k-acme", "k-globex"
FIRST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a startup?"}]


@pytest.fixture(scope="module")
def app(tiny_by_family, tmp_path_factory):
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    pool = relay_pool(llama, qwen, tmp_path_factory.mktemp("artifacts"))
    c = TestClient(create_app(pool, Settings(keys=load_keys(env=KEYS))))
    yield c, pool, llama.name, qwen.name
    c.app.state.engine.close()


def chat(c: TestClient, model: str, messages: list[dict], key: str = ACME, headers: dict | None = None, **extra):
    body = {"model": model, "messages": messages, "max_tokens": 6, **extra}
    r = c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}", **(headers or {})})
    assert r.status_code == 200, r.text
    return r.json()


def reply(body: dict) -> dict:
    return {"role": "assistant", "content": body["choices"][0]["message"]["content"]}


def fresh_prompt_tokens(c: TestClient, model: str, messages: list[dict]) -> int:
    """usage.prompt_tokens of the same messages read fresh (store: false: nothing looked up)."""
    body = chat(c, model, messages, store=False)
    assert body["ctxrelay"]["reuse"] == "none" and "conversation" not in body["ctxrelay"]
    return body["usage"]["prompt_tokens"]


def counted(c: TestClient, result: str) -> float:
    m = re.search(rf'^ctxrelay_content_reuse_total{{result="{result}"}} (\S+)$', c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_resent_history_continues_its_conversation_on_either_model(app):
    c, pool, llama, qwen = app
    hits, misses = counted(c, "hit"), counted(c, "miss")
    first = chat(c, llama, FIRST)
    r1 = first["ctxrelay"]
    assert r1["reuse"] == "none" and r1["turn"] == 1 and r1["next_state"] == "prefill", r1["reuse_reason"]
    conv = r1["conversation"]
    # turn 2 resends the history, no id: the same model continues its own state of it (exact)
    history = [*FIRST, reply(first)]
    ask = [{"role": "user", "content": "And a company?"}]
    second = chat(c, llama, [*history, *ask])
    r2 = second["ctxrelay"]
    assert (r2["reuse"], r2["reused_messages"], r2["conversation"], r2["turn"]) == ("content", 3, conv, 2)
    assert r2["transport"] == "self" and 0 < r2["prefilled_tokens"] < second["usage"]["prompt_tokens"]
    m = pool.models[llama]
    native = pool.native(llama, transcript(history), render(m, ask, after_context=True), max_new_tokens=6)
    assert second["choices"][0]["message"]["content"] == native.text  # the state read is the history, exactly
    assert second["usage"]["prompt_tokens"] == fresh_prompt_tokens(c, llama, [*history, *ask])
    # turn 3 on the other model: relayed through the gate from llama's state of the history
    history += [*ask, reply(second)]
    third = chat(c, qwen, [*history, {"role": "user", "content": "Shorter."}])
    r3 = third["ctxrelay"]
    assert (r3["reuse"], r3["reused_messages"], r3["conversation"]) == ("content", 5, conv)
    assert r3["transport"] == "heterofold" and r3["relayed_from"] == llama, r3["reason"]
    assert counted(c, "hit") == hits + 2 and counted(c, "miss") == misses + 1


def test_a_relayed_turn_leaves_an_exact_state_and_only_that_is_reused(app):
    c, pool, llama, qwen = app
    opening = [{"role": "user", "content": "Name a fast animal."}]
    first = chat(c, llama, opening)
    history = [*opening, reply(first), {"role": "user", "content": "Another?"}]
    second = chat(c, qwen, history)  # relayed: qwen's cache of the history is approximate
    assert second["ctxrelay"]["transport"] == "heterofold" and second["ctxrelay"]["reuse"] == "content"
    history.append(reply(second))
    session = c.app.state.sessions.open(second["ctxrelay"]["conversation"], "acme")
    c.app.state.engine.states.settle(session, None)  # built after the reply
    # what the conversation keeps, and content matching serves, is qwen's own prefill of the transcript
    exact = capture_state(pool.models[qwen], transcript(history), "acme")
    assert session.model == qwen and session.state.text == exact.text
    assert torch.equal(session.state.tokens, exact.tokens)
    assert (session.state.keys_pre_rope - exact.keys_pre_rope).abs().max() < 1e-4
    third = chat(c, qwen, [*history, {"role": "user", "content": "Why?"}])["ctxrelay"]
    assert third["transport"] == "self" and third["reuse"] == "content" and third["reused_messages"] == 4


def test_an_edited_history_reuses_the_common_prefix_and_is_never_read_twice(app):
    c, pool, llama, _ = app
    opening = [{"role": "user", "content": "Tell me about rivers."}]
    first = chat(c, llama, opening)
    conv = first["ctxrelay"]["conversation"]
    history = [*opening, reply(first), {"role": "user", "content": "And lakes?"}]
    history.append(reply(chat(c, llama, history)))
    edited = [*history[:2], {"role": "user", "content": "And lakez?"}, history[3]]  # one character changed
    ask = [*edited[2:], {"role": "user", "content": "And seas?"}]
    body = chat(c, llama, [*edited[:2], *ask])
    r = body["ctxrelay"]
    # the first two messages come from the conversation's state, cut there; the rest is prefilled once
    assert (r["reuse"], r["reused_messages"], r["transport"]) == ("content", 2, "self"), r["reuse_reason"]
    assert r["conversation"] != conv and r["turn"] == 1  # a branch of its own; the original is untouched
    assert body["usage"]["prompt_tokens"] == fresh_prompt_tokens(c, llama, [*edited[:2], *ask])
    m = pool.models[llama]
    native = pool.native(llama, transcript(edited[:2]), render(m, ask, after_context=True), max_new_tokens=6)
    assert body["choices"][0]["message"]["content"] == native.text  # the cut state is exact
    # the original conversation still continues from its whole history
    again = chat(c, llama, [*history, {"role": "user", "content": "And seas?"}])["ctxrelay"]
    assert (again["conversation"], again["reused_messages"], again["turn"]) == (conv, 4, 3)


def test_a_named_conversation_resent_with_an_edit_continues_from_the_common_prefix(app):
    c, _, llama, _ = app
    opening = [{"role": "user", "content": "Describe a forest."}]
    first = chat(c, llama, opening, conversation="new")
    conv = first["ctxrelay"]["conversation"]
    history = [*opening, reply(first), {"role": "user", "content": "In winter?"}]
    history.append(reply(chat(c, llama, history, conversation=conv)))
    edited = [*history[:2], {"role": "user", "content": "In summer?"}]
    body = chat(c, llama, edited, conversation=conv)
    r = body["ctxrelay"]
    assert (r["reuse"], r["reused_messages"], r["conversation"], r["turn"]) == ("id", 2, conv, 3), r["reuse_reason"]
    assert r["transport"] == "self" and body["usage"]["prompt_tokens"] == fresh_prompt_tokens(c, llama, edited)
    # the conversation now holds the edited history; the next turn resends it and continues
    nxt = chat(c, llama, [*edited, reply(body), {"role": "user", "content": "Why?"}], conversation=conv)
    assert (nxt["ctxrelay"]["reuse"], nxt["ctxrelay"]["reused_messages"]) == ("id", 4)


def test_client_chosen_ids_are_hints_within_their_tenant(app):
    c, _, llama, _ = app
    secret = [{"role": "user", "content": "The vault code is 9191."}]
    body = chat(c, llama, secret, conversation_id="chat-7")
    first = body["ctxrelay"]
    assert (first["conversation"], first["turn"], first["reuse"]) == ("chat-7", 1, "none")
    history = [*secret, reply(body), {"role": "user", "content": "Repeat it."}]
    second = chat(c, llama, history, headers={"X-Session-ID": "chat-7"})["ctxrelay"]
    assert (second["conversation"], second["turn"], second["reuse"], second["reused_messages"]) == (
        "chat-7", 2, "id", 2)  # fmt: skip
    # a reply the server never gave: nothing stored covers the history, the conversation starts again
    made_up = [*secret, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Repeat it."}]
    third = chat(c, llama, made_up, conversation="chat-7")["ctxrelay"]
    assert (third["conversation"], third["turn"], third["reuse"], third["transport"]) == (
        "chat-7", 3, "none", "native")  # fmt: skip
    history = made_up
    # another tenant choosing the same id, with the same messages, gets a conversation of its own and no state
    other = chat(c, llama, history, key=GLOBEX, conversation="chat-7")["ctxrelay"]
    assert (other["conversation"], other["turn"], other["reuse"]) == ("chat-7", 1, "none")
    assert c.app.state.sessions.open("chat-7", "acme").messages[0] == secret[0]
    bad = c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}", "X-Session-ID": "a:b"},
                 json={"model": llama, "messages": secret})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "conversation"
    both = c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}", "X-Session-ID": "one"},
                  json={"model": llama, "messages": secret, "conversation_id": "two"})  # fmt: skip
    assert both.status_code == 400 and "different conversations" in both.json()["error"]["message"]
    issued = c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}"},
                    json={"model": llama, "messages": secret, "conversation": "conv-" + "x" * 24})  # fmt: skip
    assert issued.status_code == 404  # the server's own ids are never created by naming them


def test_another_tenants_history_is_never_matched(app):
    c, _, llama, _ = app
    opening = [{"role": "user", "content": "Our launch date is May 4."}]
    first = chat(c, llama, opening)
    history = [*opening, reply(first), {"role": "user", "content": "When is it?"}]
    r = chat(c, llama, history, key=GLOBEX)["ctxrelay"]
    assert r["reuse"] == "none" and r["conversation"] != first["ctxrelay"]["conversation"] and r["turn"] == 1


def test_store_false_neither_reuses_nor_stores(app):
    c, _, llama, _ = app
    opening = [{"role": "user", "content": "Count to three."}]
    first = chat(c, llama, opening)
    held = len(c.app.state.sessions)
    hits, misses = counted(c, "hit"), counted(c, "miss")
    r = chat(c, llama, [*opening, reply(first), {"role": "user", "content": "Again."}], store=False)["ctxrelay"]
    assert r["reuse"] == "none" and "conversation" not in r and r["next_state"] == "none"
    assert len(c.app.state.sessions) == held and (counted(c, "hit"), counted(c, "miss")) == (hits, misses)


def test_a_prefix_state_cut_from_a_longer_one_equals_its_own_prefill(tiny_by_family, app):
    _, pool, _, _ = app
    for family in ("llama", "qwen2"):
        m = tiny_by_family[family]
        head = transcript([{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi!"}])
        whole = capture_state(m, head + transcript([{"role": "user", "content": "More?"}]), "acme")
        cut, own = prefix_state(pool, whole, head), capture_state(m, head, "acme")
        assert cut is not None and torch.equal(cut.tokens, own.tokens) and torch.equal(cut.offsets, own.offsets)
        assert (cut.keys_pre_rope - own.keys_pre_rope).abs().max() < 1e-4
        assert (cut.values - own.values).abs().max() < 1e-4
        assert prefix_state(pool, whole, "not a prefix") is None


def test_the_index_keys_replies_by_tenant_and_exact_content():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert [k for k, _ in prefix_hashes("acme", msgs)] == [2]  # only where a reply ends the list
    assert prefix_hashes("acme", msgs) != prefix_hashes("globex", msgs)
    assert prefix_hashes("acme", msgs) != prefix_hashes("acme", [{**msgs[0], "content": "A"}, *msgs[1:]])
    index = MemoryIndex()
    index.put("acme", "one", msgs[:2])
    assert index.find("acme", msgs, 2) == [("one", 2)] and index.find("globex", msgs, 2) == []
    assert index.find("acme", msgs, 1) == []  # a request keeps at least one message of its own
    index.put("acme", "one", [{"role": "user", "content": "x"}, msgs[1]])  # rewound: its old entry goes
    assert index.find("acme", msgs, 2) == [] and len(index) == 1
    index.remove("acme", "one")
    assert len(index) == 0


def test_a_conversation_without_an_id_builds_its_state_only_when_the_server_is_idle(tiny_by_family):
    """Stateless traffic under load is not read twice: the engine is idle with only the caller admitted, busy
    with a second request in."""
    from ctxrelay.relay import ModelPool
    from ctxrelay.serve.engine import Engine
    from ctxrelay.serve.metrics import Metrics

    engine = Engine(ModelPool([tiny_by_family["llama"]], store="memory"), Metrics())
    try:
        first = engine.admit()
        assert engine.idle()
        second = engine.admit()
        assert not engine.idle()
        second()
        assert engine.idle()
        first()
    finally:
        engine.close()
