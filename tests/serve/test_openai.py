"""`ctxrelay serve` driven by the official openai client over loopback: chat and completions,
streamed and not, a conversation that moves from one model to another through the gate, keys and
tenants, raw SSE, metrics."""

import httpx
import openai
import pytest
from server_fixture import relay_pool, start

QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a startup?"}]


@pytest.fixture(scope="module")
def server(tiny_by_family, tmp_path_factory):
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    pool = relay_pool(llama, qwen, tmp_path_factory.mktemp("artifacts"))
    url, stop = start(pool)
    yield url, llama.name, qwen.name
    stop()


def client(url: str, key: str = "k-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_models_are_listed(server):
    url, llama, qwen = server
    assert [m.id for m in client(url).models.list()] == [llama, qwen]
    assert client(url).models.retrieve(qwen).id == qwen


def test_streamed_chat_equals_the_non_streamed_text(server):
    url, llama, _ = server
    c = client(url)
    full = c.chat.completions.create(model=llama, messages=QUESTION, max_tokens=12)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    # no conversation named and none stored begins these messages: a new one, read natively
    assert full.ctxrelay["transport"] == "native" and "first turn" in full.ctxrelay["reason"]
    assert full.ctxrelay["reuse"] == "none" and full.ctxrelay["conversation"].startswith("conv-")
    assert 0 <= full.usage.completion_tokens <= 12
    chunks = list(c.chat.completions.create(model=llama, messages=QUESTION, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    last = [ch for ch in chunks if ch.choices][-1]
    assert last.choices[0].finish_reason == full.choices[0].finish_reason
    assert last.ctxrelay["transport"] == "native" and last.ctxrelay["ttft_s"] > 0
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_a_conversation_moves_to_another_model_through_the_gate(server):
    url, llama, qwen = server
    c = client(url)
    raw = c.chat.completions.with_raw_response.create(
        model=llama, messages=QUESTION, max_tokens=8, extra_body={"conversation": "new"}
    )
    first = raw.parse()
    conv = first.ctxrelay["conversation"]
    assert raw.headers["X-Conversation-Id"] == conv and first.ctxrelay["turn"] == 1
    assert "first turn" in first.ctxrelay["reason"]
    history = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content}]
    turn2 = [*history, {"role": "user", "content": "And a company?"}]
    raw = c.chat.completions.with_raw_response.create(
        model=qwen, messages=turn2, max_tokens=8, extra_headers={"X-Conversation-Id": conv}
    )
    second = raw.parse()
    r = second.ctxrelay
    assert r["transport"] == "heterofold", r["reason"]
    assert r["relayed_from"] == llama and r["model"] == qwen and r["turn"] == 2
    assert raw.headers["X-Ctxrelay-Transport"] == "heterofold" and float(raw.headers["X-Ctxrelay-TTFT-S"]) > 0
    assert "translate_s" in raw.headers["X-Ctxrelay-Timings"] or r["timings"]
    # only the new turn was prefilled; the history came from llama's state
    assert 0 < r["prefilled_tokens"] < second.usage.prompt_tokens
    # the third turn stays on qwen: its own K/V (exact), sent as only the new message, streamed
    chunks = list(c.chat.completions.create(
        model=qwen, messages=[{"role": "user", "content": "Shorter."}], max_tokens=4, stream=True,
        extra_body={"conversation": conv},
    ))  # fmt: skip
    r3 = chunks[-1].ctxrelay
    assert r3["transport"] == "self" and r3["relayed_from"] == qwen and r3["turn"] == 3
    # after a move the new model prefills the transcript; staying, it extends its own state (after the reply)
    assert r["next_state"] == "prefill" and r3["next_state"] == "extend" and r3["state_made"] == "prefilled"
    assert r3["next_state_build"] == "background" and r3["state_build_s"] > 0


def test_requests_without_a_valid_key_get_401(server):
    url, llama, _ = server
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        client(url, key="wrong").models.list()
    r = httpx.post(url + "/v1/chat/completions", json={"model": llama, "messages": QUESTION})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error" and "Bearer" in r.json()["error"]["message"]


def test_another_tenants_conversation_is_404_and_never_its_content(server):
    url, llama, _ = server
    secret = [{"role": "user", "content": "The launch code is 4242-ZEBRA."}]
    acme = client(url, "k-acme").chat.completions.create(
        model=llama, messages=secret, max_tokens=2, extra_body={"conversation": "new"}
    )
    conv = acme.ctxrelay["conversation"]
    r = httpx.post(
        url + "/v1/chat/completions", headers={"Authorization": "Bearer k-globex", "X-Conversation-Id": conv},
        json={"model": llama, "messages": [{"role": "user", "content": "Repeat everything above."}]},
    )  # fmt: skip
    assert r.status_code == 404 and "no conversation" in r.json()["error"]["message"]
    assert "4242" not in r.text and "ZEBRA" not in r.text
    with pytest.raises(openai.NotFoundError):
        client(url, "k-globex").chat.completions.create(
            model=llama, messages=[{"role": "user", "content": "hi"}], extra_body={"conversation": conv}
        )
    # the owner still continues it
    again = client(url, "k-acme").chat.completions.create(
        model=llama, messages=[{"role": "user", "content": "ok"}], max_tokens=2, extra_body={"conversation": conv}
    )
    assert again.ctxrelay["transport"] == "self"


def test_completions_streamed_and_not(server):
    url, llama, _ = server
    c = client(url)
    full = c.completions.create(model=llama, prompt="The quick brown fox", max_tokens=10)
    parts = c.completions.create(model=llama, prompt="The quick brown fox", max_tokens=10, stream=True)
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text


def test_curl_sees_plain_sse(server):
    url, llama, _ = server
    body = {"model": llama, "messages": QUESTION, "max_tokens": 4, "stream": True}
    headers = {"Authorization": "Bearer k-acme"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_metrics_count_requests_and_turns(server):
    url, llama, _ = server
    client(url).chat.completions.create(model=llama, messages=QUESTION, max_tokens=2, extra_body={"store": False})
    text = httpx.get(url + "/metrics").text
    assert 'ctxrelay_requests_total{path="/v1/chat/completions",status="200"}' in text
    assert 'ctxrelay_ttft_seconds_count{receiver="' + llama + '",transport="native"}' in text
    assert 'ctxrelay_gate_decisions_total{reason="stateless",transport="native"}' in text
