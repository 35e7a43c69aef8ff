"""Conversations and prompts without a network: chat templates, the transcript, the state budget,
the CLI's refusal to serve an open port."""

import copy
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from server_fixture import TEMPLATE
from typer.testing import CliRunner

from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay.serve.app import Settings, create_app
from ctxrelay.serve.chat import GENERATION_PROMPT, render, render_turn, transcript
from ctxrelay.serve.errors import ApiError

TURN = [{"role": "user", "content": " Hi there "}]


def test_without_a_template_the_turn_is_in_transcript_form(tiny_by_family):
    m = tiny_by_family["llama"]
    assert transcript(TURN) == "user: Hi there\n\n"
    assert render(m, TURN, after_context=False) == "user: Hi there\n\n" + GENERATION_PROMPT


def test_a_tokenizers_own_template_renders_the_turn_without_a_second_bos(tiny_by_family):
    def templated(family):
        tok = copy.deepcopy(tiny_by_family[family].tokenizer)
        tok.chat_template = TEMPLATE
        return SimpleNamespace(tokenizer=tok, spec=SimpleNamespace(name="tiny-templated"))

    gemma, llama = templated("gemma3"), templated("llama")  # gemma's tokenizer adds <bos>, llama's does not
    turn = "<|user|> Hi there <|end|><|assistant|>"
    assert render(gemma, TURN, after_context=False) == turn
    assert render(llama, TURN, after_context=False) == "<bos>" + turn
    assert render(llama, TURN, after_context=True) == turn  # never a BOS mid-sequence
    with pytest.raises(ApiError, match="chat template of tiny-templated refused"):
        render(gemma, [{"role": "assistant", "content": "x"}], after_context=False)


# SmolLM2's and Qwen2.5's shape: a default system prompt where the messages open without one
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|system|> Be brief. <|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_new_turn_after_the_history_gets_no_second_default_system_prompt(tiny_by_family):
    tok = copy.deepcopy(tiny_by_family["gemma3"].tokenizer)
    tok.chat_template = DEFAULT_SYSTEM
    m = SimpleNamespace(tokenizer=tok, spec=SimpleNamespace(name="tiny-templated"))
    history = [*TURN, {"role": "assistant", "content": "Hello."}]
    new = [{"role": "user", "content": "And now?"}]
    assert render(m, new, after_context=True).startswith("<|system|> Be brief.")  # rendered alone it would
    assert render_turn(m, history, new) == "<|user|> And now? <|end|><|assistant|>"
    assert render_turn(m, [], new) == render(m, new, after_context=False)
    plain = tiny_by_family["llama"]  # no template: the transcript form, as before
    assert render_turn(plain, history, new) == render(plain, new, after_context=True)


@pytest.fixture(scope="module")
def llama_pool(tiny_by_family):
    return ModelPool([tiny_by_family["llama"]], artifact_dirs=[], profile=Profile())


def test_a_conversation_whose_state_was_dropped_continues_natively(llama_pool):
    c = TestClient(create_app(llama_pool, Settings(max_state_bytes=0)))
    name = next(iter(llama_pool.models))
    body = {"model": name, "messages": TURN, "max_tokens": 2, "conversation": "new"}
    first = c.post("/v1/chat/completions", json=body).json()["ctxrelay"]
    second = c.post("/v1/chat/completions", json={**body, "conversation": first["conversation"]}).json()
    assert second["ctxrelay"]["transport"] == "native" and "state was dropped" in second["ctxrelay"]["reason"]
    assert second["ctxrelay"]["turn"] == 2
    assert "ctxrelay_conversation_state_bytes 0.0" in c.get("/metrics").text


def test_the_cli_refuses_an_open_port_without_keys(monkeypatch):
    from ctxrelay.cli import app

    monkeypatch.delenv("CTXRELAY_API_KEYS", raising=False)
    r = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--models", "never-loaded"])
    assert r.exit_code == 1 and "refusing to serve on 0.0.0.0" in r.output


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_extending_a_state_equals_capturing_the_whole_text(tiny_by_family, family):
    from conftest import SAMPLE_TEXT
    from ctxrelay.models.capture import capture_state, extend_state

    m = tiny_by_family[family]
    head, tail = SAMPLE_TEXT[:120], "\n\nassistant: a reply\n\n"  # sliding windows (gemma3: 8) span the seam
    ext = extend_state(m, capture_state(m, head, "acme"), head + tail)
    full = capture_state(m, head + tail, "acme")
    assert ext is not None and ext.meta["extended_from"] > 0 and torch.equal(ext.tokens, full.tokens)
    assert (ext.keys_pre_rope - full.keys_pre_rope).abs().max() < 1e-4
    assert (ext.values - full.values).abs().max() < 1e-4
    assert extend_state(m, capture_state(m, head, "acme"), "another text") is None


def test_a_seam_that_retokenizes_is_captured_whole(tiny_by_family):
    from ctxrelay.models.capture import capture_state, extend_state

    m = tiny_by_family["llama"]
    state = capture_state(m, "The quick bro", "acme")
    assert extend_state(m, state, "The quick brown fox") is None  # "bro" + "wn" re-splits as "brown"


def test_where_conversations_live_follows_the_state_store():
    from ctxrelay.errors import UsageError
    from ctxrelay.relay.store import MemoryStore, RedisStore, TieredStore
    from ctxrelay.serve.sessions import SessionStore
    from ctxrelay.serve.shared_sessions import RedisSessionStore, open_sessions

    bounds = dict(max_sessions=10, max_state_bytes=1 << 20, lock_ttl_s=30.0)
    memory, redis_tier = MemoryStore(1 << 20, 4096), RedisStore("redis://127.0.0.1:1/0")  # never connected
    shared = open_sessions("auto", TieredStore([memory, redis_tier]), **bounds)
    assert isinstance(shared, RedisSessionStore) and shared.client is redis_tier.client
    shared.close()
    assert isinstance(open_sessions("auto", memory, **bounds), SessionStore)
    assert isinstance(open_sessions("memory", redis_tier, **bounds), SessionStore)
    with pytest.raises(UsageError, match="use --store redis://"):
        open_sessions("redis://127.0.0.1:1/0", memory, **bounds)
    with pytest.raises(UsageError, match="unknown conversation store 'disk:/x'"):
        open_sessions("disk:/x", redis_tier, **bounds)
