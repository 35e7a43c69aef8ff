"""How decode chooses the next token: the OpenAI (and vLLM) sampling fields in one record, one rule.

The order is vLLM's: the reported logprobs are the log-softmax of the RAW logits (what OpenAI and
vLLM's default report); then `logit_bias` is added, end-of-text is masked until `min_tokens` tokens
were generated, the presence/frequency penalties are subtracted (over the counts of GENERATED tokens
only, OpenAI's definition), and the token is the argmax at temperature 0, else one draw from
softmax(logits / temperature) cut to `top_k` and `top_p`, from a generator seeded with `seed`.
With every field at its default this is exactly the decode ctxrelay always had (argmax, or a
multinomial draw from the seeded generator), the same draws included.

`stop` strings end the text (`StopText`): the text ends before the first one, and, as in vLLM, a
stop only counts once `min_tokens` tokens were generated and is looked for only in the text the
newest token could have completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrelay.errors import UsageError

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound (vLLM's default max_logprobs)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # the smallest set of tokens whose probability reaches top_p (the top token always)
    top_k: int = 0  # 0: off
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # end-of-text (and stop strings) only from this many generated tokens on
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none reported; k: the chosen token's and the k most likely

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> UsageError:
            return UsageError(f"{name} must be {rule}, not {getattr(self, name)!r}")

        if not 0.0 <= self.temperature < float("inf"):
            raise bad("temperature", "a finite number >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise bad("top_p", "between 0 and 1")
        if self.top_k < 0:
            raise bad("top_k", ">= 0 (0: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "between -2 and 2")
        if self.min_tokens < 0:
            raise bad("min_tokens", ">= 0")
        if any(not s for s in self.stop):
            raise bad("stop", "non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"between 0 and {MAX_LOGPROBS}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise bad("logit_bias", "biases between -100 and 100")

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # log-softmax of the raw logits at the chosen token
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token, logprob), best first


class Sampler:
    """One decode's choices: the seeded generator, the counts of generated tokens, the logprobs kept."""

    def __init__(self, s: Sampling, vocab_size: int, eos: set[int]):
        self.s = s
        self.gen = torch.Generator().manual_seed(s.seed)
        self.eos = torch.tensor(sorted(e for e in eos if e < vocab_size), dtype=torch.long)
        for t, _ in s.logit_bias:
            if not 0 <= t < vocab_size:
                raise UsageError(f"logit_bias names token {t}, outside the vocabulary (0..{vocab_size - 1})")
        penalised = s.presence_penalty or s.frequency_penalty
        self.counts = torch.zeros(vocab_size) if penalised else None
        self.logprobs: list[TokenLogprob] = []

    def choose(self, logits: torch.Tensor, n_generated: int) -> int:
        """The next token after `n_generated` generated tokens, from next-token `logits` [V]."""
        s, raw = self.s, logits.view(-1)
        x = raw
        if s.adjusts_logits:
            x = raw.float().clone()
            for t, b in s.logit_bias:
                x[t] += b
            if n_generated < s.min_tokens and len(self.eos):
                x[self.eos] = float("-inf")
            if self.counts is not None:
                x -= s.frequency_penalty * self.counts + s.presence_penalty * (self.counts > 0)
        if s.temperature > 0:
            p = torch.softmax(x.float() / s.temperature, dim=-1)
            if s.top_k or s.top_p < 1.0:
                p = _truncate(p, s.top_k, s.top_p)
            nxt = int(torch.multinomial(p, 1, generator=self.gen))
        else:
            nxt = int(x.argmax())
        if self.counts is not None:
            self.counts[nxt] += 1
        if s.logprobs is not None:
            lp = torch.log_softmax(raw.float(), dim=-1)
            top = torch.topk(lp, s.logprobs) if s.logprobs else None
            pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
            self.logprobs.append(TokenLogprob(nxt, float(lp[nxt]), pairs))
        return nxt


def _truncate(p: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the probabilities outside the top_k and outside the nucleus of mass top_p (the top token stays)."""
    sorted_p, order = torch.sort(p, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the tokens ranked above each one
        keep &= before < top_p
    keep[0] = True
    out = torch.zeros_like(p)
    out[order[keep]] = sorted_p[keep]
    return out


@dataclass
class StopText:
    """Where a generated text ends at a stop string; decode and the stream run the same rule on the same
    tokens, so a streamed text never shows what the whole text cuts."""

    stops: tuple[str, ...] = ()
    min_tokens: int = 0
    seen: int = field(default=0, init=False)  # text length at the last look: stops before it were looked for

    def cut(self, text: str, n_tokens: int) -> int | None:
        """The end of the text if a stop string completed within what the newest token added, else None.
        Called once per generated token, with the whole text so far."""
        longest = max((len(s) for s in self.stops), default=0)
        start, self.seen = max(0, self.seen - longest), len(text)
        if not self.stops or n_tokens < self.min_tokens:
            return None
        hits = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def held(self, text: str) -> int:
        """How many characters at the end of `text` may still begin a stop string (a stream holds them back)."""
        return max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
