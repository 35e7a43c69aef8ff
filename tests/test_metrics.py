import math

import pytest
import torch

from ctxrelay import metrics as M
from ctxrelay.errors import UsageError


def test_identical_logits():
    lg = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    assert M.next_token_kl(lg, lg.clone()) == 0.0
    assert M.top1_agreement(lg, lg + 3.0) == 1.0  # a constant shift is the same distribution
    assert M.next_token_kl(lg, lg + 3.0) == pytest.approx(0.0, abs=1e-12)


def test_kl_known_distributions():
    p = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    q = torch.tensor([[0.9, 0.1]], dtype=torch.float64).log()
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert M.next_token_kl(p, q) == pytest.approx(want, rel=1e-9)
    # mean over positions: a second, identical position halves it
    assert M.next_token_kl(torch.cat([p, p]), torch.cat([q, p])) == pytest.approx(want / 2, rel=1e-9)
    # direction is KL(native || relay), not the reverse
    rev = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert M.next_token_kl(q, p) == pytest.approx(rev, rel=1e-9)


def test_top1_agreement_fraction():
    ref = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    out = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 0, 1.0], [0, 2.0, 0]])
    assert M.top1_agreement(ref, out) == 0.5


def test_shape_mismatch_is_clear():
    with pytest.raises(UsageError, match="differ in shape"):
        M.next_token_kl(torch.zeros(3, 5), torch.zeros(3, 6))
    with pytest.raises(UsageError, match="targets"):
        M.perplexity_at(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))


def test_perplexity_horizons():
    # uniform over 4 tokens -> ppl 4 whatever the target
    assert M.perplexity_at(torch.zeros(20, 4), torch.zeros(20, dtype=torch.long), (1, 16)) == {
        "1": pytest.approx(4.0),
        "16": pytest.approx(4.0),
    }
    # target probabilities 1/2 then 1/8: ppl@1 = 2, ppl@2 = exp(mean(log 2, log 8)) = 4
    lg = torch.tensor([[0.5, 0.5], [1 / 8, 7 / 8]]).log()
    tg = torch.tensor([0, 0])
    got = M.perplexity_at(lg, tg, horizons=(1, 2, 16, 512))
    assert got == {"1": pytest.approx(2.0), "2": pytest.approx(4.0)}  # 16 and 512 left out, not invented


def test_text_metrics():
    assert M.token_f1("the cat sat", "a cat sat down") == pytest.approx(2 * (1 * 2 / 3) / (1 + 2 / 3))
    assert M.token_f1("", "") == 1.0 and M.token_f1("x", "") == 0.0
    assert M.rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # LCS of "a b c d" and "a c d e" is "a c d": P = R = 3/4
    assert M.rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    assert M.rouge_l("x y", "a b") == 0.0


def test_compare():
    g = torch.Generator().manual_seed(1)
    ref, out = torch.randn(32, 11, generator=g), torch.randn(32, 11, generator=g)
    tg = torch.randint(0, 11, (32,), generator=g)
    res = M.compare(ref, out, tg, horizons=(1, 16, 32, 128))
    assert res["kl"] == M.next_token_kl(ref, out) and res["kl"] > 0
    assert res["top1_agreement"] == M.top1_agreement(ref, out)
    assert set(res["ppl"]) == {"1", "16", "32"} and set(res["native_ppl"]) == {"1", "16", "32"}
    assert res["native_ppl"]["32"] == M.perplexity_at(ref, tg)["32"]
    assert set(M.compare(ref, out)) == {"kl", "top1_agreement"}
