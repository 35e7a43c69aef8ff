"""Quality metrics of a relayed receiver run against the receiver's own native run.

Logit conventions: `logits[i]` is the model's distribution for `targets[i]` (the caller shifts),
shape [T, V] (or [V] for one position). Log-softmax runs in float64 so a KL of identical inputs
is exactly 0 and tiny differences are not drowned in float32 rounding.
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import torch

from ctxrelay.errors import UsageError

HORIZONS = (1, 16, 32, 128, 512)


def _pair(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.as_tensor(ref_logits).detach().reshape(-1, ref_logits.shape[-1])
    out = torch.as_tensor(logits).detach().reshape(-1, logits.shape[-1])
    if ref.shape != out.shape:
        raise UsageError(
            f"reference logits {tuple(ref.shape)} and compared logits {tuple(out.shape)} differ in shape; "
            "compare the same positions of the same receiver (same vocabulary)"
        )
    if ref.shape[0] == 0:
        raise UsageError("no positions to compare (empty logits)")
    return ref.to(torch.float64), out.to(torch.float64)


def position_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(native || relay) at each position [T] (nats); log-probs are valid logits too."""
    ref, out = _pair(ref_logits, logits)
    log_p = torch.log_softmax(ref, dim=-1)
    log_q = torch.log_softmax(out, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0)


def position_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1.0 where the argmax equals the native argmax, else 0.0, per position [T]."""
    ref, out = _pair(ref_logits, logits)
    return (ref.argmax(-1) == out.argmax(-1)).double()


def next_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(native || relay) per position, averaged over positions (nats)."""
    return float(position_kl(ref_logits, logits).mean())


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Share of positions whose argmax equals the native argmax."""
    return float(position_agreement(ref_logits, logits).mean())


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood [T] of each target under its logits row."""
    lg = torch.as_tensor(logits).detach().reshape(-1, logits.shape[-1]).to(torch.float64)
    tg = torch.as_tensor(targets).reshape(-1).long()
    if lg.shape[0] != tg.shape[0]:
        raise UsageError(f"{lg.shape[0]} logit rows for {tg.shape[0]} targets: pass logits[i] predicting targets[i]")
    return -torch.log_softmax(lg, dim=-1).gather(1, tg[:, None]).squeeze(1)


def pooled_perplexity(nlls: Sequence[torch.Tensor], horizons: Sequence[int] = HORIZONS) -> dict[str, float]:
    """Perplexity over the first H targets of every sequence that has H, pooled over sequences."""
    out = {}
    for h in horizons:
        parts = [x[:h] for x in nlls if x.shape[0] >= h]
        if parts:
            out[str(h)] = math.exp(float(torch.cat(parts).double().mean()))
    return out


class PooledQuality:
    """Accumulates top-1 agreement, KL and NLL over many sequences' positions; pooled at the end."""

    def __init__(self) -> None:
        self.agree: list[torch.Tensor] = []
        self.kl: list[torch.Tensor] = []
        self.nll: list[torch.Tensor] = []
        self.native_nll: list[torch.Tensor] = []

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """One sequence: native logits (or log-probs) and the compared ones at the same positions."""
        self.agree.append(position_agreement(ref_logits, logits))
        self.kl.append(position_kl(ref_logits, logits))
        if targets is not None:
            self.nll.append(token_nll(logits, targets))
            self.native_nll.append(token_nll(ref_logits, targets))

    def result(self, horizons: Sequence[int] = HORIZONS) -> dict:
        out = {
            "top1_agreement": float(torch.cat(self.agree).mean()),
            "kl": float(torch.cat(self.kl).mean()),
            "positions": int(sum(x.shape[0] for x in self.agree)),
        }
        if self.nll:
            out["ppl"] = pooled_perplexity(self.nll, horizons)
            out["native_ppl"] = pooled_perplexity(self.native_nll, horizons)
        return out


def perplexity_at(logits: torch.Tensor, targets: torch.Tensor, horizons: Sequence[int] = HORIZONS) -> dict[str, float]:
    """Perplexity over the first H targets for each H; horizons beyond the targets are left out."""
    nll = token_nll(logits, targets)
    return {str(h): math.exp(float(nll[:h].mean())) for h in horizons if 1 <= h <= nll.shape[0]}


# ---- text metrics ------------------------------------------------------------------------------

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")
_ARTICLES = {"a", "an", "the"}


def log_length_weight(lengths: Sequence[int], n: int) -> tuple[int, int, float]:
    """(a, b, w): the calibrated context lengths around n and n's weight on b, linear in log-length, for
    quality measured at some lengths and asked of another. Outside their range: the nearest length alone
    (a = b, w = 0), so a measurement is never extrapolated."""
    ls, n = sorted(lengths), max(1, int(n))
    a = max((x for x in ls if x <= n), default=ls[0])
    b = min((x for x in ls if x >= n), default=ls[-1])
    return a, b, 0.0 if a == b else (math.log(n) - math.log(a)) / (math.log(b) - math.log(a))


def nearest_length(lengths: Sequence[int], n: int) -> int:
    """The calibrated length nearest n in log-length (the nearest one outside their range): the gate's
    rule wherever a measurement is read at one length rather than interpolated."""
    a, b, w = log_length_weight(lengths, n)
    return a if w <= 0.5 else b


def normalize_tokens(text: str) -> list[str]:
    """Lower-case, punctuation to spaces, articles dropped (SQuAD-style, but 'copper-heron-42'
    keeps its three words apart instead of gluing them)."""
    return [w for w in _PUNCT.sub(" ", text.lower()).split() if w not in _ARTICLES]


def token_f1(pred: str, ref: str) -> float:
    """Token-overlap F1 of the normalised words (1.0 when both are empty)."""
    p, r = normalize_tokens(pred), normalize_tokens(ref)
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


@functools.cache
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F-measure (rouge-score's longest common subsequence on its own tokenisation)."""
    return float(_rouge_scorer().score(ref, pred)["rougeL"].fmeasure)


def compare(
    ref_logits: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor | None = None,
    horizons: Sequence[int] = HORIZONS,
) -> dict:
    """KL and top-1 agreement vs native; with targets also relay and native perplexity per horizon."""
    out: dict = {"kl": next_token_kl(ref_logits, logits), "top1_agreement": top1_agreement(ref_logits, logits)}
    if targets is not None:
        out["ppl"] = perplexity_at(logits, targets, horizons)
        out["native_ppl"] = perplexity_at(ref_logits, targets, horizons)
    return out
