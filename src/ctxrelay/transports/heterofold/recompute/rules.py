"""Which context tokens the faithful relay recomputes: the selection rules, behind one table of named rules.

Which tokens decides everything (the query is the appended span, or with none the context's last
sentence):
  deviation  largest K/V deviation at layer 1 after a native layer 0 for every token (CacheBlend)
  lexical    whole sentences ranked by BM25 against the query's content words
  embedding  whole sentences ranked by cosine to the query in the receiver's input embeddings
  recency    the last tokens of the context
  mix        the last 33 tokens; where the context's last 6 tokens occurred before, what followed
             them there (a continuation that repeats the context copies from there; up to a quarter
             of the budget, at least half of it to the source the ending repeats longest); the sentences
             matching the query (BM25 score >= half the best, while they fit: needle facts); then
             more of the last tokens for the rest of the budget
  adaptive   the matching sentences + a recency window of a quarter of the budget: the matches
             decide f (f is a cap; the best match always goes in)
  mix2       mix over 40% of the budget, then a second pass (transfer.relay_prefill) over the rest: the
             translated entries that pass's last context tokens and question attended to most
             (recompute_pass.second_pass_positions), with those tokens and the question run again over them
Measured (bench heterofold-frontier): the deviation rule helps neither facts nor continuations
across families (translation error is spread over all tokens); the fact's sentence is what needle
answers need and the recent tokens are what continuation agreement needs, so mix does both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rank_bm25 import BM25Okapi

from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel
from ctxrelay.text import content_words, sentence_spans

RECENCY_SHARE = 0.25  # of the budget, in adaptive


# mix2: the share of the budget its second pass recomputes (the first pass is mix over the rest). Chosen on the
# development needles into smollm2 (seed 0, 2048 tokens): 0.05 of 0.15 answered 1 of 8, 0.15 of 0.25 2 of 8
SECOND_SHARE = 0.6


TAIL = 32  # the context's last tokens whose next-token predictions and attention are signals


MATCH_RATIO = 0.5  # mix, adaptive: sentences scoring >= this share of the best BM25 score


COPY_NGRAM = 6  # mix: the context's last tokens looked up earlier in the context


COPY_SHARE = 0.25  # mix: at most this share of the budget goes to what followed those earlier occurrences


COPY_SOURCES = 4  # mix: distinct earlier occurrences copied from, best matched first


COPY_HITS = 256  # mix: the latest earlier occurrences of the last tokens considered as sources


COPY_REACH = 256  # mix: tokens compared backwards from each occurrence (backward_match)


COPY_VERBATIM = 32  # mix: a source the context's ending has repeated this long gets the whole copy budget


@dataclass
class Selection:
    # sorted receiver positions to recompute, the native ones (sink, specials) among them; none where the
    # budget rounds to no token (the relay is then plain heterofold: transfer.relay_prefill)
    positions: torch.Tensor
    rule: str
    info: dict = field(default_factory=dict)


def query_text(context: str, query: str | None) -> str:
    """What relevance is judged against: the appended span, else the context's last sentence that
    has content words (a question at the end of the context, before its "Answer:")."""
    if query and content_words(query):
        return query
    for a, b in reversed(sentence_spans(context)[-3:]):
        if content_words(context[a:b]):
            return context[a:b]
    return ""


def sentence_tokens(offsets: torch.Tensor, text: str) -> list[torch.Tensor]:
    """Receiver token positions of each sentence of `text` (a token belongs where its span ends)."""
    ends = offsets[:, 1]
    spans = sentence_spans(text)
    bounds = torch.tensor([a for a, _ in spans] + [len(text) + 1])
    which = torch.bucketize(ends - 1, bounds, right=True) - 1  # sentence index of each token's last char
    keep = (offsets[:, 1] > offsets[:, 0]) & (which >= 0) & (which < len(spans))
    idx = torch.arange(offsets.shape[0])
    return [idx[keep & (which == s)] for s in range(len(spans))]


def backward_match(ids: torch.Tensor, starts: torch.Tensor, end: int, reach: int = COPY_REACH) -> torch.Tensor:
    """For each start, how many tokens right before it equal the tokens right before `end` (up to `reach`):
    how long the context's ending has been repeating what precedes that start, word for word."""
    if not starts.numel():
        return torch.zeros(0, dtype=torch.long)
    back = torch.arange(1, reach + 1)
    before = starts[:, None] - back  # [S, reach] positions before each start, nearest first
    tail = end - back
    ok = (before >= 0) & (tail >= 0)
    same = ok & (ids[before.clamp(min=0)] == ids[tail.clamp(min=0)])
    return same.long().cumprod(1).sum(1)


def copy_sources(ids: torch.Tensor, budget: int, n: int = COPY_NGRAM) -> torch.Tensor:
    """Where the context's last n tokens occurred before, the tokens from there on (a continuation that
    repeats the context copies from there, as prompt-lookup decoding assumes), within `budget`.

    Sources are ranked by how long the context's ending has matched them word for word (backward_match),
    the latest first among equals: a conversation repeating a text from far back goes on copying the place
    it has been repeating. Ranked by recency alone, a legal text repeated from 2000 tokens back got a
    quarter of the budget behind three short matches, and its continuation read ppl@128 5.6x native
    (ShareGPT seed 500 into gemma3). Earlier occurrences followed by the same tokens are one source (the
    best ranked is kept). A source matched for COPY_VERBATIM tokens or more gets the whole budget; else
    the first gets at least half: a copied continuation runs for many tokens. Split evenly over repeats,
    each got a few dozen, and ShareGPT conversations that quote their earlier code measured ppl@128
    8-11x native with ppl@32 1.0-1.3x (the copy's later part stayed translated)."""
    t = ids.shape[0]
    if t <= 2 * n or budget <= 0:
        return torch.zeros(0, dtype=torch.long)
    hits = (ids[: t - n].unfold(0, n, 1) == ids[t - n :]).all(1).nonzero().view(-1)  # earlier starts
    hits = hits[hits + n < t - n][-COPY_HITS:]
    if not hits.numel():
        return torch.zeros(0, dtype=torch.long)
    matched = backward_match(ids, hits, t - n)
    ranked = sorted(zip(matched.tolist(), hits.tolist(), strict=True), reverse=True)
    sources: list[int] = []
    seen: set[tuple[int, ...]] = set()
    for _, p in ranked:
        following = tuple(ids[p + n : p + 2 * n].tolist())
        if following not in seen:
            seen.add(following)
            sources.append(p)
        if len(sources) == COPY_SOURCES:
            break
    if ranked[0][0] >= COPY_VERBATIM:  # a verbatim repeat: its source takes the whole budget
        sources = sources[:1]
    shares = [budget]  # one source: all of it
    if len(sources) > 1:  # the first keeps at least half, the others share the rest
        others = len(sources) - 1
        shares = [budget - budget // 2] + [max(n + 1, budget // 2 // others)] * others
    spans = [torch.arange(p, min(p + share, t)) for p, share in zip(sources, shares, strict=True)]
    return torch.unique(torch.cat(spans))[:budget]


def _take_sentences(groups: list[torch.Tensor], scores: list[float], budget: int) -> list[torch.Tensor]:
    """Best-scoring sentences (score > 0) while they fit the budget (the best one always)."""
    taken, used = [], 0
    for s in sorted(range(len(groups)), key=lambda i: -scores[i]):
        if scores[s] <= 0 or not groups[s].numel():
            break
        if taken and used + groups[s].numel() > budget:
            continue
        taken.append(groups[s])
        used += groups[s].numel()
        if used >= budget:
            break
    return taken


def bm25_scores(groups_text: list[str], query: str) -> list[float]:
    docs = [content_words(t) or ["\x00"] for t in groups_text]
    q = content_words(query)
    if not q:
        return [0.0] * len(docs)
    return [float(x) for x in BM25Okapi(docs).get_scores(q)]


def embedding_scores(m: LoadedModel, ids: torch.Tensor, groups: list[torch.Tensor], query_ids: torch.Tensor):
    emb = m.hf.get_input_embeddings()
    if not query_ids.numel():
        return [0.0] * len(groups)
    q = emb(query_ids).float().mean(0)
    out = []
    for g in groups:
        v = emb(ids[g]).float().mean(0) if g.numel() else torch.zeros_like(q)
        out.append(float(torch.nn.functional.cosine_similarity(v, q, dim=0)) if g.numel() else 0.0)
    return out


@torch.inference_mode()
def layer1_deviation(m: LoadedModel, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """CacheBlend's signal: run layer 0 natively for every context token (its K/V replace the
    translated ones, as CacheBlend does) and return each token's K+V deviation at layer 1 [T]."""
    t = ids.shape[0]
    own = runner.early_kv(m, ids, min(2, m.spec.num_layers))
    cache.write(0, slice(0, t), *own[0])
    if len(own) < 2:
        return torch.zeros(t)
    k1, v1 = own[1]
    kt, vt = cache.view(1, t)
    return ((k1 - kt).float().pow(2).sum((0, 1, 3)) + (v1 - vt).float().pow(2).sum((0, 1, 3))).sqrt()


@dataclass
class Request:
    """What a rule may read of one relayed request: the receiver, the context's receiver ids and their
    character offsets, its text, the query, the translated cache and the natively computed positions."""

    m: LoadedModel
    ids: torch.Tensor
    offsets: torch.Tensor
    text: str
    query: str | None
    cache: KVCache
    native: list[int]

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]


# a rule: (request, budget in tokens, info to fill) -> groups of positions to recompute
Rule = Callable[[Request, int, dict], list[torch.Tensor]]


def _deviation(r: Request, budget: int, info: dict) -> list[torch.Tensor]:
    dev = layer1_deviation(r.m, r.ids, r.cache)
    dev[torch.tensor(r.native, dtype=torch.long)] = float("inf")  # computed natively anyway
    return [dev.topk(min(r.tokens, budget + len(r.native))).indices]


def _recency(r: Request, budget: int, info: dict) -> list[torch.Tensor]:
    return [torch.arange(r.tokens - budget, r.tokens)]


def _sentences(r: Request, budget: int, info: dict, embedding: bool = False, matches_only: bool = False):
    """Whole sentences by their score against the query, while they fit the budget."""
    groups = sentence_tokens(r.offsets, r.text)
    q = query_text(r.text, r.query)
    if embedding:
        q_ids = torch.tensor(r.m.tokenizer(q, add_special_tokens=False)["input_ids"], dtype=torch.long)
        scores = embedding_scores(r.m, r.ids, groups, q_ids)
    else:
        scores = bm25_scores([r.text[a:b] for a, b in sentence_spans(r.text)], q)
    if matches_only:
        best = max(scores, default=0.0)
        scores = [s if best > 0 and s >= MATCH_RATIO * best else 0.0 for s in scores]
    taken = _take_sentences(groups, scores, budget)
    info["sentences"] = len(taken)
    return taken


def _lexical(r: Request, budget: int, info: dict) -> list[torch.Tensor]:
    info["copied"] = 0
    return _sentences(r, budget, info)


def _embedding(r: Request, budget: int, info: dict) -> list[torch.Tensor]:
    info["copied"] = 0
    return _sentences(r, budget, info, embedding=True)


def _adaptive(r: Request, budget: int, info: dict) -> list[torch.Tensor]:
    window = max(1, round(RECENCY_SHARE * budget))
    info["copied"] = 0
    return [torch.arange(r.tokens - window, r.tokens), *_sentences(r, budget - window, info, matches_only=True)]


def _mix(r: Request, budget: int, info: dict) -> list[torch.Tensor]:
    tail = min(TAIL + 1, budget)  # mix always recomputes the last tokens
    copied = copy_sources(r.ids, round(COPY_SHARE * budget))
    info["copied"] = int(copied.numel())
    taken = _sentences(r, budget - tail - copied.numel(), info, matches_only=True)
    left = budget - copied.numel() - sum(g.numel() for g in taken)  # the rest: the context's last tokens
    return [copied, *taken, torch.arange(r.tokens - max(tail, left), r.tokens)]


# mix2 runs mix over part of the budget here; its second pass is the relay's (transfer.relay_prefill)
RULES: dict[str, Rule | None] = {
    "deviation": _deviation, "lexical": _lexical, "embedding": _embedding, "recency": _recency,
    "mix": _mix, "adaptive": _adaptive, "mix2": None,
}  # fmt: skip


@torch.inference_mode()
def select(
    m: LoadedModel,
    rule: str,
    fraction: float,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    text: str,
    query: str | None,
    cache: KVCache,
    native: list[int],
) -> Selection:
    """The receiver positions to recompute for `fraction` of the context under `rule`."""
    if rule not in RULES:
        raise UsageError(f"unknown recompute selection {rule!r}; use one of {', '.join(RULES)}")
    if not 0.0 <= fraction <= 1.0:
        raise UsageError(f"recompute fraction must be in [0, 1], got {fraction}")
    t = ids.shape[0]
    budget = round(fraction * t)
    info: dict = {"requested_fraction": fraction}
    if budget == 0:
        return Selection(torch.zeros(0, dtype=torch.long), rule, info)
    if budget >= t:
        return Selection(torch.arange(t), rule, info)
    if rule == "mix2":  # the first pass; the second pass's budget is left to the relay
        first_fraction = fraction * (1 - SECOND_SHARE)
        first = select(m, "mix", first_fraction, ids, offsets, text, query, cache, native)
        second = budget - round(first_fraction * t)  # the first pass's own budget, as select sets it
        return Selection(first.positions, rule, {**first.info, **info, "second_pass_budget": second})
    chosen = RULES[rule](Request(m, ids, offsets, text, query, cache, native), budget, info)
    pos = torch.unique(torch.cat([*chosen, torch.tensor(native, dtype=torch.long)]))
    return Selection(pos, rule, info)
