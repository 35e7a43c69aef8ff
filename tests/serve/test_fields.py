"""The OpenAI sampling fields over a real server, through the official openai client: logprobs (values
against the log-softmax of the model's own logits), stop sequences (streamed and not), seed, top_p,
penalties, min_tokens and logit_bias."""

import openai
import pytest
import torch
from server_fixture import relay_pool, start

from ctxrelay.models import runner
from ctxrelay.models.tokens import context_ids
from ctxrelay.serve.chat import prompt_ids

QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a startup?"}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_by_family, tmp_path_factory):
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    url, stop = start(relay_pool(llama, qwen, tmp_path_factory.mktemp("artifacts")))
    yield url, llama
    stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k-acme", max_retries=0, timeout=120)


def greedy_rows(m, ids: list[int], n: int) -> list[tuple[int, torch.Tensor]]:
    """Greedy decode by full forwards, independent of decode: (chosen token, log-softmax of its row)."""
    out = []
    for _ in range(n):
        row = torch.log_softmax(runner.forward(m, torch.tensor(ids), logits="all").logits[-1].float(), -1)
        t = int(row.argmax())
        out.append((t, row))
        ids = [*ids, t]
    return out


def test_chat_logprobs_are_the_log_softmax_of_the_raw_logits(server):
    url, m = server
    r = client(url).chat.completions.create(
        model=m.name, messages=QUESTION, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    for entry, (t, row) in zip(content, greedy_rows(m, prompt_ids(m, QUESTION), len(content)), strict=True):
        assert entry.token == m.tokenizer.decode([t]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(row[t]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [x.token for x in entry.top_logprobs] == [m.tokenizer.decode([i]) for i in top.indices.tolist()]
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = client(url).chat.completions.create(model=m.name, messages=QUESTION, max_tokens=8)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_streamed_chat_logprobs_equal_the_non_streamed(server):
    url, m = server
    kw = dict(model=m.name, messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=2)
    full = client(url).chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client(url).chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in full]


def test_completion_logprobs_have_the_legacy_shape(server):
    url, m = server
    r = client(url).completions.create(model=m.name, prompt=PROMPT, max_tokens=8, logprobs=2)
    lp = r.choices[0].logprobs
    rows = greedy_rows(m, context_ids(m, PROMPT).tolist(), len(lp.tokens))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens > 0
    ids = [t for t, _ in rows]
    assert lp.tokens == [m.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([float(row[t]) for t, row in rows], abs=1e-4)
    for d, (_, row) in zip(lp.top_logprobs, rows, strict=True):
        top = torch.topk(row, 2)
        want = {m.tokenizer.decode([i]): v for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)}
        assert d == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [len(m.tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]


def test_stop_ends_the_text_before_it_streamed_or_not(server):
    url, m = server
    c = client(url)
    full = c.chat.completions.create(model=m.name, messages=QUESTION, max_tokens=30)
    text = full.choices[0].message.content
    assert len(text) > 12, text
    stop = text[6:10]  # four characters: on this small vocabulary they span a token boundary
    cut = text.find(stop)
    kw = dict(model=m.name, messages=QUESTION, max_tokens=30, stop=[stop, "never-said-zzz"])
    r = c.chat.completions.create(**kw)
    assert r.choices[0].message.content == text[:cut] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < full.usage.completion_tokens
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text[:cut]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    # completions, one stop string as a plain string
    whole = c.completions.create(model=m.name, prompt=PROMPT, max_tokens=30).choices[0].text
    s = whole[5:8]
    one = c.completions.create(model=m.name, prompt=PROMPT, max_tokens=30, stop=s).choices[0]
    parts = c.completions.create(model=m.name, prompt=PROMPT, max_tokens=30, stop=s, stream=True)
    assert one.text == whole[: whole.find(s)] == "".join(p.choices[0].text for p in parts)
    assert one.finish_reason == "stop"


def test_seed_makes_sampling_repeatable(server):
    url, m = server
    ask = lambda seed: client(url).chat.completions.create(
        model=m.name, messages=QUESTION, max_tokens=12, temperature=1.5, seed=seed
    ).choices[0].message.content  # fmt: skip
    first = ask(11)
    assert ask(11) == first
    assert any(ask(s) != first for s in (12, 13, 14))


def test_a_tiny_top_p_picks_the_greedy_token(server):
    url, m = server
    c = client(url)
    greedy = c.chat.completions.create(model=m.name, messages=QUESTION, max_tokens=10).choices[0].message.content
    for seed in (1, 2, 3):
        r = c.chat.completions.create(
            model=m.name, messages=QUESTION, max_tokens=10, temperature=1.5, top_p=1e-6, seed=seed
        )
        assert r.choices[0].message.content == greedy


def test_penalties_lower_repeats(server):
    url, m = server

    def most_repeated(**kw) -> int:
        r = client(url).completions.create(model=m.name, prompt=PROMPT, max_tokens=40, logprobs=0, **kw)
        tokens = r.choices[0].logprobs.tokens
        return max(tokens.count(t) for t in tokens)

    plain = most_repeated()
    assert most_repeated(frequency_penalty=2.0) < plain
    assert most_repeated(presence_penalty=2.0) < plain


def test_min_tokens_holds_end_of_text_back_and_logit_bias_moves_tokens(server):
    url, m = server
    c = client(url)
    eos = {str(m.tokenizer.eos_token_id): 100}  # end-of-text would be chosen first
    at_once = c.completions.create(model=m.name, prompt=PROMPT, max_tokens=10, logit_bias=eos)
    assert at_once.choices[0].text == "" and at_once.usage.completion_tokens == 0
    assert at_once.choices[0].finish_reason == "stop"
    held = c.completions.create(model=m.name, prompt=PROMPT, max_tokens=10, logit_bias=eos,
                                extra_body={"min_tokens": 5})  # fmt: skip
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    forced = c.completions.create(model=m.name, prompt=PROMPT, max_tokens=4, logit_bias={"17": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [m.tokenizer.decode([17])] * 4
    assert forced.choices[0].finish_reason == "length"
