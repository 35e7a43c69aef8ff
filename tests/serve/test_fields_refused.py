"""What the server refuses (a 400 naming the field), /v1/models' context length, /tokenize and /detokenize
as vLLM has them, and usage.prompt_tokens counting the receiver's own prompt whatever the transport."""

import copy
import dataclasses

import httpx
import pytest
from fastapi.testclient import TestClient
from server_fixture import TEMPLATE, relay_pool, start

from ctxrelay.serve.app import Settings, create_app
from ctxrelay.serve.fields import REFUSED

QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a startup?"}]
KEY = {"Authorization": "Bearer k-acme"}


@pytest.fixture(scope="module")
def server(tiny_by_family, tmp_path_factory):
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    url, stop = start(relay_pool(llama, qwen, tmp_path_factory.mktemp("artifacts")))
    yield url, llama
    stop()


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=KEY if headers is None else headers, timeout=60)


# a value that asks for something, for every field fields.REFUSED names (the test below checks it is every one)
ASKING = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "response_format": {"type": "json_object"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "best_of": 2,
    "echo": True,
    "suffix": "end",
    "repetition_penalty": 1.2,
    "min_p": 0.1,
    "use_beam_search": True,
    "prompt_logprobs": 1,
    "stop_token_ids": [5],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "allowed_token_ids": [1, 2],
    "bad_words": ["fox"],
    "skip_special_tokens": False,
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"json": {"type": "object"}},
}
CHAT_REFUSED = [*ASKING.items(), ("n", 2)]
COMPLETION_REFUSED = [("best_of", 2), ("echo", True), ("suffix", "end"), ("n", 3)]


def test_every_refused_field_is_tested():
    assert set(ASKING) == set(REFUSED)


OUT_OF_BOUNDS = [
    ("top_p", 1.5),
    ("top_logprobs", 21),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("seed", "x"),
    ("min_tokens", 99),  # above max_tokens
    ("logit_bias", {"999999": 5}),  # outside the vocabulary
    ("logit_bias", {"eos": 5}),  # not a token id
    ("top_logprobs", 2),  # without logprobs: true
    ("stop", [""]),
]


@pytest.mark.parametrize(("field", "value"), CHAT_REFUSED + OUT_OF_BOUNDS)
def test_a_chat_field_not_served_is_a_400_naming_it(server, field, value):
    url, m = server
    r = post(url, "/v1/chat/completions", {"model": m.name, "messages": QUESTION, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value"), COMPLETION_REFUSED)
def test_a_completion_field_not_served_is_a_400_naming_it(server, field, value):
    url, m = server
    r = post(url, "/v1/completions", {"model": m.name, "prompt": "The quick", "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_defaults_of_refused_fields_and_harmless_vendor_fields_pass(server):
    url, m = server
    harmless = {"response_format": {"type": "text"}, "tool_choice": "none", "user": "u-1", "metadata": {"a": "b"},
                "parallel_tool_calls": False, "reasoning_effort": "low", "best_of": 1,
                "some_vendor_field": 1}  # fmt: skip
    r = post(url, "/v1/chat/completions", {"model": m.name, "messages": QUESTION, "max_tokens": 2, **harmless})
    assert r.status_code == 200, r.text


def test_models_say_their_context_window(server):
    url, m = server
    data = httpx.get(url + "/v1/models", headers=KEY).json()["data"]
    assert [(d["id"], d["root"], d["max_model_len"]) for d in data][0] == (m.name, m.name, 4096)
    assert m.spec.context_window == 4096
    one = httpx.get(url + f"/v1/models/{m.name}", headers=KEY).json()
    assert one["max_model_len"] == 4096


def test_tokenize_and_detokenize_round_trip(server):
    url, m = server
    text = "The quick brown fox, 東京 🙂"
    tok = post(url, "/tokenize", {"model": m.name, "prompt": text, "return_token_strs": True}).json()
    assert tok["tokens"] == m.tokenizer(text)["input_ids"] and tok["count"] == len(tok["tokens"]) > 3
    assert tok["max_model_len"] == 4096 and len(tok["token_strs"]) == tok["count"]
    assert post(url, "/detokenize", {"model": m.name, "tokens": tok["tokens"]}).json() == {"prompt": text}
    # a chat's tokens are what usage.prompt_tokens counts, and the generation prompt is the only difference
    chat = post(url, "/tokenize", {"model": m.name, "messages": QUESTION}).json()
    usage = post(url, "/v1/chat/completions", {"model": m.name, "messages": QUESTION, "max_tokens": 2}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    bare = post(url, "/tokenize", {"model": m.name, "messages": QUESTION, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]


def test_tokenize_refusals(server):
    url, m = server
    assert post(url, "/tokenize", {"model": m.name, "prompt": "x"}, headers={}).status_code == 401
    assert post(url, "/detokenize", {"model": m.name, "tokens": [1]}, headers={}).status_code == 401
    assert post(url, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    r = post(url, "/detokenize", {"model": m.name, "tokens": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = post(url, "/tokenize", {"model": m.name})
    assert r.status_code == 400 and "prompt or messages" in r.json()["error"]["message"]
    r = post(url, "/tokenize", {"model": m.name, "messages": QUESTION, "chat_template": "{{ x }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = post(url, "/tokenize", {"prompt": "x"})  # two models served: which one?
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_relayed_and_native_turns_count_the_same_prompt_tokens(tiny_by_family, tmp_path):
    """The receiver has a chat template, so the relayed turn (history in transcript form + the new turn in
    the template) reads other tokens than its own rendering; usage counts the latter either way."""
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    tok = copy.deepcopy(qwen.tokenizer)
    tok.chat_template = TEMPLATE
    templated = dataclasses.replace(qwen, tokenizer=tok)
    c = TestClient(create_app(relay_pool(llama, templated, tmp_path), Settings()))
    ask = lambda model, msgs, **kw: c.post("/v1/chat/completions", json={
        "model": model, "messages": msgs, "max_tokens": 8, **kw}).json()  # fmt: skip
    first = ask(llama.name, QUESTION, conversation="new")
    turn2 = [*QUESTION, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And a company?"}]  # fmt: skip
    relayed = ask(qwen.name, turn2, conversation=first["ctxrelay"]["conversation"])
    native = ask(qwen.name, turn2, store=False)  # nothing looked up: read fresh, natively
    r = relayed["ctxrelay"]
    assert r["transport"] == "heterofold" and native["ctxrelay"]["transport"] == "native", r["reason"]
    assert relayed["usage"]["completion_tokens"] > 1  # a decoded answer is not counted as prompt
    own = c.post("/tokenize", json={"model": qwen.name, "messages": turn2}).json()["count"]
    assert relayed["usage"]["prompt_tokens"] == native["usage"]["prompt_tokens"] == own
    assert r["context_tokens"] + r["prefilled_tokens"] != own  # what the relayed turn read: another rendering
