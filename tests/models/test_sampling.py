"""The sampling rule (models/sampling.py) on its own and through runner.decode on the tiny models."""

import pytest
import torch

from conftest import SAMPLE_TEXT
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.sampling import Sampler, Sampling, StopText
from ctxrelay.models.tokens import context_ids

V = 50


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def _decode(m, n: int = 24, **fields) -> runner.Generation:
    ids = context_ids(m, SAMPLE_TEXT[:120])
    out = runner.forward(m, ids)
    return runner.decode(m, out.cache, out.logits[-1], 0.0, n, sampling=Sampling(**fields) if fields else None)


def test_defaults_are_the_old_decode_draw_for_draw():
    steps = [_logits(i) for i in range(12)]
    greedy = Sampler(Sampling(), V, set())
    assert [greedy.choose(x, i) for i, x in enumerate(steps)] == [int(x.argmax()) for x in steps]
    sampled = Sampler(Sampling(temperature=0.8, seed=3), V, set())
    gen = torch.Generator().manual_seed(3)
    old = [int(torch.multinomial(torch.softmax(x.float() / 0.8, -1), 1, generator=gen)) for x in steps]
    assert [sampled.choose(x, i) for i, x in enumerate(steps)] == old


def test_seed_reproduces_and_another_seed_differs(tiny):
    a = _decode(tiny, temperature=1.5, seed=7, n=16)
    assert _decode(tiny, temperature=1.5, seed=7, n=16).tokens == a.tokens
    others = [_decode(tiny, temperature=1.5, seed=s, n=16).tokens for s in (8, 9, 10)]
    assert any(o != a.tokens for o in others)


def test_temperature_zero_stays_greedy_whatever_the_seed(tiny):
    assert _decode(tiny, seed=1).tokens == _decode(tiny, seed=2).tokens == _decode(tiny).tokens


def test_tiny_top_p_or_top_k_one_picks_the_greedy_token():
    for i in range(20):
        x = _logits(i)
        for s in (Sampling(temperature=1.5, top_p=1e-6, seed=i), Sampling(temperature=1.5, top_k=1, seed=i)):
            assert Sampler(s, V, set()).choose(x, 0) == int(x.argmax())


def test_top_p_keeps_the_nucleus_only():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {Sampler(Sampling(temperature=1.0, top_p=0.7, seed=s), 4, set()).choose(x, 0) for s in range(200)}
    assert seen == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there


def test_penalties_subtract_counts_of_generated_tokens():
    x = torch.zeros(V)
    x[3], x[4] = 2.0, 1.5
    pick = Sampler(Sampling(frequency_penalty=0.2, presence_penalty=0.2), V, set())
    assert pick.choose(x, 0) == 3  # no count yet
    assert pick.choose(x, 1) == 3  # 2.0 - 0.2 - 0.2 = 1.6 > 1.5
    assert pick.choose(x, 2) == 4  # 2.0 - 0.4 - 0.2 = 1.4 < 1.5
    assert pick.counts[3] == 2 and pick.counts[4] == 1


def test_penalties_lower_repeats_in_a_real_decode(tiny):
    def most_repeated(g):
        return max(g.tokens.count(t) for t in set(g.tokens))

    plain = _decode(tiny, n=40)
    penalised = _decode(tiny, n=40, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(plain.tokens) > 0 and most_repeated(penalised) < most_repeated(plain)


def test_min_tokens_masks_end_of_text_until_reached(tiny):
    eos = min(runner.eos_ids(tiny))
    bias = ((eos, 100.0),)  # end-of-text would win every step
    assert _decode(tiny, logit_bias=bias).tokens == []
    g = _decode(tiny, logit_bias=bias, min_tokens=5)
    assert len(g.tokens) == 5 and g.finish_reason == "stop" and eos not in g.tokens


def test_logit_bias_forces_a_token(tiny):
    g = _decode(tiny, n=6, logit_bias=((17, 100.0),))
    assert g.tokens == [17] * 6 and g.finish_reason == "length"
    with pytest.raises(UsageError, match="logit_bias"):
        _decode(tiny, logit_bias=((10**6, 1.0),))


def test_logprobs_are_the_log_softmax_of_the_raw_logits(tiny):
    ids = context_ids(tiny, SAMPLE_TEXT[:120])
    g = _decode(tiny, n=8, logprobs=5, temperature=0.9, seed=1, frequency_penalty=1.0)
    assert len(g.logprobs) == len(g.tokens) > 0
    every = runner.forward(tiny, torch.cat([ids, torch.tensor(g.tokens[:-1])]), logits="all").logits
    ref = torch.log_softmax(every[len(ids) - 1 :].float(), -1)  # the rows that chose each generated token
    for row, lp, t in zip(ref, g.logprobs, g.tokens, strict=True):
        assert lp.token == t and abs(lp.logprob - float(row[t])) < 1e-4
        top = torch.topk(row, 5)
        assert [tok for tok, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert _decode(tiny, n=4).logprobs is None
    assert all(lp.top == () for lp in _decode(tiny, n=4, logprobs=0).logprobs)


def test_stop_string_ends_the_text_before_it(tiny):
    full = _decode(tiny, n=30)
    assert full.finish_reason == "length" and len(full.text) > 6
    stop = full.text[4:7]
    cut = full.text.find(stop)
    g = _decode(tiny, n=30, stop=(stop, "never-generated-zzz"))
    assert g.text == full.text[:cut] and g.finish_reason == "stop"
    assert g.tokens == full.tokens[: len(g.tokens)] and len(g.tokens) < len(full.tokens)


def test_stop_text_rules():
    s = StopText(("\n\n", "END"))
    assert s.cut("ab", 1) is None and s.held("ab\n") == 1 and s.held("abEN") == 2 and s.held("abE.") == 0
    assert s.cut("ab\n\ncd", 2) == 2
    assert StopText(("END",)).cut("END", 1) == 0  # a text that begins with a stop is empty
    early = StopText(("END",), min_tokens=3)
    assert early.cut("END", 1) is None and early.cut("END x", 2) is None
    assert early.cut("END x y", 3) is None  # before min_tokens, and never looked for again
    assert early.cut("END x yEND", 4) == 7


def test_bad_fields_are_refused():
    for bad in (dict(top_p=1.5), dict(presence_penalty=3.0), dict(stop=("",)), dict(logprobs=21), dict(min_tokens=-1)):
        with pytest.raises(UsageError, match=next(iter(bad))):
            Sampling(**bad)
