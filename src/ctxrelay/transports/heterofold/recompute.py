"""Selective recompute over the translated cache: heterofold's faithful mode.

After translation the receiver recomputes its own K/V, through all its layers, for a chosen share
f of the context tokens and writes them over the translated ones (CacheBlend's mechanism, here
across model families). The recomputed tokens' queries attend by position to the cache of
translated + recomputed entries (attend="all"), or only to the recomputed ones and the sink
(attend="own"). f = 0 is plain heterofold; f = 1 recomputes every token in one pass: the
receiver's native prefill exactly.

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
             (second_pass_positions), with those tokens and the question run again over them
Measured (bench heterofold-frontier): the deviation rule helps neither facts nor continuations
across families (translation error is spread over all tokens); the fact's sentence is what needle
answers need and the recent tokens are what continuation agreement needs, so mix does both.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from rank_bm25 import BM25Okapi

from ctxrelay.errors import UsageError
from ctxrelay.metrics import log_length_weight, nearest_length
from ctxrelay.models import runner
from ctxrelay.models.attention import attention_logits, native_attention
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel
from ctxrelay.text import content_words, sentence_spans
from ctxrelay.transports.heterofold.hiding import Hide, hide_code, hide_label

RULES = ("deviation", "lexical", "embedding", "recency", "mix", "adaptive", "mix2")
# candidates for the per-request estimate (recompute signals; the alignment's share of shared token ends)
SIGNALS = ("translated_attention", "tail_confidence", "tail_nll", "kv_change", "exact_share", "char_mismatch",
           "hiding_gap")  # fmt: skip
RECENCY_SHARE = 0.25  # of the budget, in adaptive
# mix2: the share of the budget its second pass recomputes (the first pass is mix over the rest). Chosen on the
# development needles into smollm2 (seed 0, 2048 tokens): 0.05 of 0.15 answered 1 of 8, 0.15 of 0.25 2 of 8
SECOND_SHARE = 0.6
TAIL = 32  # the context's last tokens whose next-token predictions and attention are signals
SIGNAL_LAYERS = 4  # layers, spread over the depth, whose K/V change and attention are signals
MATCH_RATIO = 0.5  # mix, adaptive: sentences scoring >= this share of the best BM25 score
COPY_NGRAM = 6  # mix: the context's last tokens looked up earlier in the context
COPY_SHARE = 0.25  # mix: at most this share of the budget goes to what followed those earlier occurrences
COPY_SOURCES = 4  # mix: distinct earlier occurrences copied from, best matched first
COPY_HITS = 256  # mix: the latest earlier occurrences of the last tokens considered as sources
COPY_REACH = 256  # mix: tokens compared backwards from each occurrence (backward_match)
COPY_VERBATIM = 32  # mix: a source the context's ending has repeated this long gets the whole copy budget
# the gate acts on a per-request estimate only where it ranked calibration texts left out of its fit at
# least this well (Spearman at a fixed f; faithful.left_out_spearman). Measured: kv_change at 0.33 in sample
# ranked held-out requests at -0.11..0.05 (qwen-1.5b -> gemma3, 20 per f) and sent 4 of 10 to native after
# paying a relay; translated_attention at -0.53 in sample (qwen-1.5b -> qwen-0.5b) was 0.21 left out
MIN_ESTIMATE_RHO = 0.5


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
    chosen: list[torch.Tensor] = []
    if rule in ("recency", "adaptive"):
        window = budget if rule == "recency" else max(1, round(RECENCY_SHARE * budget))
        chosen.append(torch.arange(t - window, t))
        budget -= window
    if rule == "deviation":
        dev = layer1_deviation(m, ids, cache)
        dev[torch.tensor(native, dtype=torch.long)] = float("inf")  # computed natively anyway
        chosen.append(dev.topk(min(t, budget + len(native))).indices)
    elif rule in ("lexical", "mix", "adaptive", "embedding"):
        groups = sentence_tokens(offsets, text)
        q = query_text(text, query)
        if rule == "embedding":
            q_ids = torch.tensor(m.tokenizer(q, add_special_tokens=False)["input_ids"], dtype=torch.long)
            scores = embedding_scores(m, ids, groups, q_ids)
        else:
            scores = bm25_scores([text[a:b] for a, b in sentence_spans(text)], q)
        if rule in ("mix", "adaptive"):  # only the matches
            best = max(scores, default=0.0)
            scores = [s if best > 0 and s >= MATCH_RATIO * best else 0.0 for s in scores]
        tail = min(TAIL + 1, budget) if rule == "mix" else 0  # mix always recomputes the last tokens
        copied = copy_sources(ids, round(COPY_SHARE * budget)) if rule == "mix" else torch.zeros(0, dtype=torch.long)
        chosen.append(copied)
        info["copied"] = int(copied.numel())
        taken = _take_sentences(groups, scores, budget - tail - copied.numel())
        info["sentences"] = len(taken)
        chosen += taken
        if rule == "mix":  # the rest of the budget: the context's last tokens
            left = budget - copied.numel() - sum(g.numel() for g in taken)
            chosen.append(torch.arange(t - max(tail, left), t))
    pos = torch.unique(torch.cat([*chosen, torch.tensor(native, dtype=torch.long)]))
    return Selection(pos, rule, info)


def estimate(model: dict | None, info: dict) -> float | None:
    """Predicted top-1 agreement of THIS request (faithful.fit_estimate): the calibrated mean at the
    request's fraction, length and hiding plus the slope times how far its signal lies from that mean.
    Where the stage ran at several settings (model["lengths"], keyed by setting_key), both means come
    from the settings with the request's hiding, interpolated linearly in log-length between the
    calibrated lengths around the request's context_tokens (the nearest outside them). None where the
    artifact has no estimate or the signal was not measured. Where the stage fitted one estimate per
    setting (model["by_setting"]), the request's own setting's is used (estimate_model)."""
    model = estimate_model(model, info.get("context_tokens"), hide_code(info.get("hide_translated", 0)))
    if not model or "centres" not in model or model.get("signal") not in info or "requested_fraction" not in info:
        return None
    f = float(info["requested_fraction"])
    mean_signal, mean_top1 = _centre(model["centres"], f)
    settings = model.get("lengths")
    if settings and info.get("context_tokens"):
        # artifacts made before settings had a hiding key all settings by length alone: all of them
        same = _by_length(settings, hide_code(info.get("hide_translated", 0))) or _by_length(settings)
        mean_signal, mean_top1 = _centre_at(same, f, int(info["context_tokens"]))
    return float(min(1.0, max(0.0, mean_top1 + model["slope"] * (float(info[model["signal"]]) - mean_signal))))


def estimate_model(model: dict | None, tokens: int | None, hide: Hide = 0) -> dict | None:
    """The estimate that judges a request of `tokens` context tokens hiding `hide` layers. Where the stage
    fitted one per setting (model["by_setting"], keyed by setting_key): that of the request's hiding at
    the calibrated length nearest its own in log-length (the gate's nearest-length rule; the shortest
    when no length is given), None where its hiding has none. Otherwise the one pooled estimate."""
    if not model or "by_setting" not in model:
        return model
    same = _by_length(model["by_setting"], hide_code(hide))
    return same[nearest_length(list(same), int(tokens or min(same)))] if same else None


def setting_key(tokens: int, hide: Hide) -> str:
    """A recompute-stage setting's name: "4096", or "4096+hide12" / "4096+hideglobal" where it hid
    translated entries."""
    label = hide_label(hide)
    return f"{int(tokens)}+{label}" if label else str(int(tokens))


def parse_setting(key: str) -> tuple[int, Hide]:
    n, _, hide = key.partition("+hide")
    return int(n), hide_code(hide)


def _centre(centres: dict, f: float) -> list[float]:
    return centres[min(centres, key=lambda k: abs(float(k) - f))]


def _by_length(settings: dict, hide: Hide | None = None) -> dict:
    """Per-setting entries (keyed by setting_key) of one hiding (None: all), keyed by their length."""
    return {parse_setting(k)[0]: v for k, v in settings.items() if hide is None or parse_setting(k)[1] == hide}


def _centre_at(by_len: dict, f: float, n: int) -> tuple[float, float]:
    """(mean signal, mean top-1) at fraction f for a context of n tokens, from centres per length."""
    a, b, w = log_length_weight(list(by_len), n)
    ca, cb = _centre(by_len[a], f), _centre(by_len[b], f)
    return (1 - w) * ca[0] + w * cb[0], (1 - w) * ca[1] + w * cb[1]


def calibrated_estimates(
    model: dict | None, rows: list[dict], f: float, tokens: int | None = None, hide: Hide | None = None
) -> list[float]:
    """What a trusted estimate said of each calibration text at fraction f (the recompute stage's rows;
    only those calibrated at `tokens` context tokens and with `hide` hidden layers when given); empty
    where the gate does not act on the estimate."""
    if not trusts(model, tokens, hide or 0):
        return []
    part = [r for r in rows if abs(float(r["f"]) - f) < 1e-9 and (tokens is None or row_tokens(r) == tokens)]
    part = [r for r in part if hide is None or hide_code(r.get("hide_translated", 0)) == hide]
    ests = (estimate(model, {**r, "requested_fraction": f, "context_tokens": row_tokens(r)}) for r in part)
    return [e for e in ests if e is not None]


def row_tokens(row: dict, default: int = 2048) -> int:
    """The context length a recompute-stage row (or table entry) was calibrated at; rows made before the
    stage ran at several lengths carry none and were made at the stage's default, 2048."""
    return int(row.get("tokens", default))


def with_setting(entries: list[dict], tokens: int, hide: Hide) -> list[dict]:
    """Stage rows or table entries (recompute or fact stage) with the context length and hiding they
    were measured at made explicit ("tokens", "hide_translated"; f = 0 never hides). Entries made
    before a stage kept several settings may carry neither: they were measured at the stage's own
    (`tokens`, `hide`: stage_setting)."""
    out = []
    for x in entries:
        h = hide_code(x.get("hide_translated", hide)) if x["f"] else 0
        rest = {k: v for k, v in x.items() if k != "hide_translated"}
        out.append({**rest, "tokens": row_tokens(x, tokens), "hide_translated": h})
    return out


def stage_setting(stage: dict | None, tokens_key: str = "recompute_tokens") -> tuple[int, Hide]:
    """(tokens, hiding) of a stage's last run: what its older entries were measured at."""
    return int((stage or {}).get(tokens_key, 2048)), hide_code((stage or {}).get("hide_layers", 0))


def serving_span(lengths: list[int], measured: list[int]) -> list[int | None]:
    """[shortest, longest) request length a point measured at `measured` (of the artifact's calibrated
    `lengths`) may serve: up to the geometric middle towards the next calibrated length it was not
    measured at (where the gate's nearest-length rule would read another length), None: unbounded."""
    lo_i, hi_i = lengths.index(min(measured)), lengths.index(max(measured))
    lo = math.isqrt(lengths[lo_i - 1] * lengths[lo_i]) + 1 if lo_i > 0 else None
    hi = math.isqrt(lengths[hi_i] * lengths[hi_i + 1]) + 1 if hi_i < len(lengths) - 1 else None
    return [lo, hi]


def trusts(model: dict | None, tokens: int | None = None, hide: Hide = 0) -> bool:
    """Whether the artifact's estimate ranks requests well enough for the gate to act on it: by how it
    ranked calibration texts it was not fitted on (cv_spearman), never by its in-sample fit; per setting
    where the stage fitted one per setting (estimate_model: the one for `tokens` and `hide`). An estimate
    calibrated before cv_spearman existed is not acted on (`ctxrelay calibrate ... --set stage=refit`
    adds it from the stored rows)."""
    model = estimate_model(model, tokens, hide)
    return bool(model) and float(model.get("cv_spearman") or 0.0) >= MIN_ESTIMATE_RHO


@torch.inference_mode()
def recompute(
    m: LoadedModel,
    ids: torch.Tensor,
    cache: KVCache,
    positions: torch.Tensor,
    attend: str = "all",
    signals: Collection[str] = SIGNALS,
    suffix: torch.Tensor | None = None,
    attended: torch.Tensor | None = None,
    suffix_attends: bool = True,
) -> tuple[runner.ForwardOut, dict]:
    """Overwrite the cache at `positions` with the receiver's own K/V, all layers, in one pass, and
    return cheap per-request signals of how close the result is to native (the estimate's inputs).

    attend="all": each recomputed query sees translated + recomputed entries before it;
    attend="own": only recomputed entries (and the native sink among them).
    `suffix` (ids appended after the context) runs in the same pass, its rows last in the returned
    hidden states: it sees the recomputed entries of each layer as a pass after this one would (they
    sit before it and never attend to it), so the receiver's weights are read once, not twice; entries
    the cache hides (KVCache.hide) are hidden from it, never from the recomputed queries.
    Signals: kv_change (relative change recompute made to the K/V at sampled layers), and where
    the context's last tokens were recomputed: tail_nll / tail_confidence (the receiver predicting
    them, teacher-forced) and translated_attention (the share of their attention that lands on
    translated entries, averaged over sampled layers and heads). Only the `signals` named are measured:
    tail_nll / tail_confidence need the LM head over the tail (into gemma3, a 262k vocabulary: 0.15 s,
    8% of a relay at 4096 tokens), so serving measures only what the gate acts on.
    `attended` ([t] floats, optional): adds, in every layer, the attention the context's recomputed last
    tokens (and the suffix's rows where `suffix_attends`: a question, not a teacher-forced continuation)
    give each context position, summed over heads and rows (second_pass_positions reads it)."""
    if attend not in ("all", "own"):
        raise UsageError(f"recompute attend must be 'all' or 'own', not {attend!r}")
    t, n = ids.shape[0], positions.numel()
    extra = 0 if suffix is None else suffix.numel()
    own = torch.zeros(t + extra, dtype=torch.bool)
    own[positions] = True
    own[t:] = True  # the suffix's own entries
    key_mask = own if attend == "own" else None
    if key_mask is not None and extra:  # the suffix sees every entry; only the recomputed queries are kept to their own
        key_mask = torch.cat([own.expand(n, -1), torch.ones(extra, t + extra, dtype=torch.bool)])
    layers = sorted({round(i * (m.spec.num_layers - 1) / max(1, SIGNAL_LAYERS - 1)) for i in range(SIGNAL_LAYERS)})
    kept = layers if "kv_change" in signals else []
    before = {j: (cache.keys[j][:, :, positions].clone(), cache.values[j][:, :, positions].clone()) for j in kept}
    run = 0  # how many of the context's last tokens were recomputed, in a row
    while run < min(TAIL + 1, t) and bool(own[t - 1 - run]):
        run += 1
    mass: list[float] = []
    tail_signal = run >= 2 and "translated_attention" in signals
    rows = slice(n - run, n + (extra if attended is not None and suffix_attends else 0))

    def watch(c):
        if attended is None and not tail_signal:
            return native_attention(c)
        p = torch.softmax(attention_logits(c, rows if attended is not None else slice(n - run, n)).float(), -1)
        if tail_signal and c.layer in layers:  # p[:, :run]: [H, run, S], the context's last tokens
            mass.append(float(p[:, :run][..., ~own[: p.shape[-1]]].sum(-1).mean()))
        if attended is not None:
            attended.add_(p[..., :t].sum((0, 1)))
        return native_attention(c)

    watching = range(m.spec.num_layers) if attended is not None else layers if tail_signal else ()
    watched = dict.fromkeys(watching, watch) or None
    run_ids, run_pos = ids[positions], positions
    if extra:
        run_ids, run_pos = torch.cat([run_ids, suffix]), torch.cat([positions, torch.arange(t, t + extra)])
    out = runner.forward(m, run_ids, cache, positions=run_pos, key_mask=key_mask, attention=watched, logits="none")
    measured: dict = {}
    change = []
    for j, (k0, v0) in before.items():
        k1, v1 = cache.keys[j][:, :, positions], cache.values[j][:, :, positions]
        change.append(float(((k1 - k0).norm() + (v1 - v0).norm()) / (k1.norm() + v1.norm()).clamp_min(1e-9)))
    if change:
        measured["kv_change"] = sum(change) / len(change)
    if run >= 2 and {"tail_nll", "tail_confidence"} & set(signals):
        tail = torch.arange(t - run, t - 1)  # each predicts the next context token
        lp = torch.log_softmax(runner.head(m, out.hidden[:, torch.searchsorted(positions, tail)], "all").float(), -1)
        measured["tail_nll"] = float(-lp.gather(1, ids[tail + 1][:, None]).mean())
        measured["tail_confidence"] = float(lp.max(-1).values.exp().mean())
    if mass:
        measured["translated_attention"] = sum(mass) / len(mass)
    return out, {k: v for k, v in measured.items() if k in signals}


def second_pass_positions(attended: torch.Tensor, translated: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` translated positions the first pass's queries attended to most (sorted): a translated
    entry the recomputed tokens lean on and native gives no weight bends them (into smollm2 such entries
    drew its answers towards ending the text), so the second pass makes it the receiver's own."""
    score = attended.masked_fill(~translated, -1.0)
    k = min(int(budget), int(translated.sum()))
    if k <= 0:
        return torch.zeros(0, dtype=torch.long)
    top = torch.topk(score, k).indices
    return top[score[top] > 0].sort().values
