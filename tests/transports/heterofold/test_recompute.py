"""heterofold's selective recompute: f = 1 is native prefill, f = 0 is plain heterofold, the rules pick
what they say, and the timing components still add up."""

import pytest
import torch

from conftest import SAMPLE_TEXT, zero_artifact
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import context_ids, suffix_ids, tokenize_context
from ctxrelay.transports.heterofold import relay_prefill
from ctxrelay.transports.heterofold.recompute.recompute_pass import recompute
from ctxrelay.transports.heterofold.recompute.rules import RULES, query_text, select, sentence_tokens
from ctxrelay.transports.heterofold.transfer import assemble_cache, translated_mask

TOL = 1e-4
FACT = "The access code for the Wrenfield server room is 4172."
CONTEXT = SAMPLE_TEXT[:200] + " " + FACT + " " + SAMPLE_TEXT[200:]
QUESTION = " Question: What is the access code for the Wrenfield server room? Answer:"
PAIRS = [("llama", "gemma3"), ("gemma3", "qwen2"), ("qwen2", "llama")]  # every family as a receiver


def _native(receiver, text, suffix):
    return runner.forward(receiver, torch.cat([context_ids(receiver, text), suffix]), logits="all")


@pytest.mark.parametrize(("s", "r"), PAIRS)
@pytest.mark.parametrize("attend", ["all", "own"])
def test_recomputing_every_token_reproduces_native_prefill(tiny_by_family, s, r, attend):
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    native = _native(receiver, CONTEXT, suffix).logits[-len(suffix) :]
    art = zero_artifact(sender, receiver)  # the translation is wrong everywhere: only recompute can fix it
    for rule in RULES:
        out = relay_prefill(receiver, state, art, suffix, logits="all", recompute=1.0, selection=rule, attend=attend)
        assert (out.logits - native).abs().max() < TOL, rule
        assert out.info["recompute_fraction"] == 1.0
    plain = relay_prefill(receiver, state, art, suffix, logits="all")
    assert (plain.logits - native).abs().max() > 1e-2  # the zero maps do change the answer


@pytest.mark.parametrize(("s", "r"), PAIRS)
def test_no_recompute_is_plain_heterofold(tiny_by_family, s, r):
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    art = zero_artifact(sender, receiver)
    a = relay_prefill(receiver, state, art, suffix, logits="all")
    b = relay_prefill(receiver, state, art, suffix, logits="all", recompute=0.0, selection="deviation")
    assert torch.equal(a.logits, b.logits) and "selection" not in b.info
    assert set(b.timings) == {"translate_s", "copy_s", "assemble_s", "first_token_s"}


@pytest.mark.parametrize(("s", "r"), PAIRS)
def test_the_sink_is_native_whether_or_not_the_recompute_pass_computes_it(tiny_by_family, s, r):
    """With recompute the sink and specials run in the recompute pass, not a pass of their own: a budget
    that rounds to no token is plain heterofold, and a partial one holds the receiver's own sink K/V."""
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    art = zero_artifact(sender, receiver)
    plain = relay_prefill(receiver, state, art, suffix, logits="all")
    tiny_f = relay_prefill(receiver, state, art, suffix, logits="all", recompute=1e-6, selection="recency")
    assert tiny_f.info["recomputed"] == 0 and (tiny_f.logits - plain.logits).abs().max() < TOL
    part = relay_prefill(receiver, state, art, suffix, recompute=0.2, selection="recency")
    native = _native(receiver, CONTEXT, suffix).cache
    for i in range(receiver.spec.num_layers):  # position 0 (the sink) attends only to itself: exactly native
        assert (part.cache.keys[i][:, :, 0] - native.keys[i][:, :, 0]).abs().max() < TOL
        assert (part.cache.values[i][:, :, 0] - native.values[i][:, :, 0]).abs().max() < TOL


@pytest.mark.parametrize(("s", "r"), PAIRS)
@pytest.mark.parametrize(("attend", "hide"), [("all", 0), ("all", 2), ("own", 2)])
def test_the_suffix_in_the_recompute_pass_is_the_suffix_after_it(tiny_by_family, s, r, attend, hide):
    """The relay runs the suffix in the recompute pass; the reference is the two passes one after the other
    (recompute, then hide, then the suffix over the finished cache): same logits and cache."""
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    art = zero_artifact(sender, receiver)
    one = relay_prefill(receiver, state, art, suffix, logits="all", recompute=0.3, query=QUESTION, attend=attend,
                        hide_translated=hide)  # fmt: skip
    ids, offsets = tokenize_context(receiver, CONTEXT)
    cache, al = assemble_cache(receiver, state, art, ids, offsets, native=False)
    picked = select(receiver, "mix", 0.3, ids, offsets, CONTEXT, QUESTION, cache, al.native)
    recompute(receiver, ids, cache, picked.positions, attend, ())
    cache.hide(translated_mask(ids.numel(), al.native, picked), hide)
    two = runner.forward(receiver, suffix, cache, logits="all")
    assert one.info["recomputed"] == picked.positions.numel() > 0
    assert (one.logits - two.logits).abs().max() < TOL
    for i in range(receiver.spec.num_layers):
        assert (one.cache.keys[i] - two.cache.keys[i]).abs().max() < TOL
        assert (one.cache.values[i] - two.cache.values[i]).abs().max() < TOL
    assert one.cache.hidden_in == frozenset(range(hide))


def test_partial_recompute_moves_toward_native_and_times_every_part(tiny_by_family):
    sender, receiver = tiny_by_family["llama"], tiny_by_family["qwen2"]
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    native = _native(receiver, CONTEXT, suffix).logits[-len(suffix) :]
    art = zero_artifact(sender, receiver)
    errs = []
    for f in (0.0, 0.3, 0.7, 1.0):
        out = relay_prefill(receiver, state, art, suffix, logits="all", recompute=f, selection="recency", signals="all")
        errs.append(float((out.logits - native).abs().mean()))
        if f:
            assert {"select_s", "recompute_s"} <= set(out.timings)
            assert 0 < out.info["recompute_fraction"] <= f + 0.05  # + the natively computed sink
            assert out.info["kv_change"] >= 0 and "tail_nll" in out.info
            # serving measures only what the gate acts on (this artifact has no estimate): same logits
            served = relay_prefill(receiver, state, art, suffix, logits="all", recompute=f, selection="recency")
            assert torch.equal(served.logits, out.logits)
            assert not {"kv_change", "tail_nll", "tail_confidence", "translated_attention"} & set(served.info)
    assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] < TOL


def test_lexical_rules_pick_the_sentence_the_question_asks_about(tiny_by_family):
    m = tiny_by_family["qwen2"]
    ids, offsets = tokenize_context(m, CONTEXT)
    cache = runner.forward(m, ids, logits="none").cache
    fact = [i for i, g in enumerate(sentence_tokens(offsets, CONTEXT)) if g.numel()]
    groups = sentence_tokens(offsets, CONTEXT)
    fact_tokens = next(g for i, g in enumerate(groups) if i in fact and "4172" in m.tokenizer.decode(ids[g]))
    for rule in ("lexical", "mix", "adaptive"):
        sel = select(m, rule, 0.3, ids, offsets, CONTEXT, QUESTION, cache, [0])
        assert bool(torch.isin(fact_tokens, sel.positions).all()), rule
        assert sel.positions.numel() <= round(0.3 * len(ids)) + 1 + fact_tokens.numel()
    rec = select(m, "recency", 0.1, ids, offsets, CONTEXT, QUESTION, cache, [0])
    assert int(rec.positions.max()) == len(ids) - 1 and 0 in rec.positions.tolist()


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_picks_valid_positions_within_its_budget(tiny_by_family, rule):
    sender, receiver = tiny_by_family["gemma3"], tiny_by_family["llama"]
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    out = relay_prefill(receiver, state, zero_artifact(sender, receiver), suffix, recompute=0.3, selection=rule)
    ids, offsets = tokenize_context(receiver, CONTEXT)
    n, longest = len(ids), max(g.numel() for g in sentence_tokens(offsets, CONTEXT))
    sentence_rules = ("lexical", "mix", "embedding", "adaptive", "mix2")  # the best sentence goes in whole
    assert 0 < out.info["recomputed"] <= 0.3 * n + 1 + (longest if rule in sentence_rules else 0)
    assert out.info["selection"] == rule and out.cache.length == n + len(suffix)


def test_the_query_defaults_to_the_contexts_last_sentence():
    assert query_text("First sentence. What is the code?", "") == "What is the code?"
    assert query_text("Text.\n\nQuestion: What is the code?\nAnswer:", "").strip() == "Question: What is the code?"
    assert query_text("First sentence.", " Answer: the code") == " Answer: the code"


def test_bad_recompute_options_are_clear(tiny_by_family):
    m = tiny_by_family["llama"]
    ids, offsets = tokenize_context(m, CONTEXT)
    cache = runner.forward(m, ids, logits="none").cache
    with pytest.raises(UsageError, match="unknown recompute selection"):
        select(m, "magic", 0.1, ids, offsets, CONTEXT, "", cache, [0])
    with pytest.raises(UsageError, match=r"in \[0, 1\]"):
        select(m, "recency", 1.5, ids, offsets, CONTEXT, "", cache, [0])


def test_recompute_stage_measures_each_fraction_and_fits_an_estimate(tiny_by_family):
    from ctxrelay.transports.heterofold import transport
    from ctxrelay.transports.heterofold.calibration.fractions import calibrate_recompute, fit_estimate
    from ctxrelay.transports.heterofold.recompute.estimate import estimate
    from ctxrelay.transports.heterofold.recompute.recompute_pass import SIGNALS

    sender, receiver = tiny_by_family["llama"], tiny_by_family["gemma3"]
    art = zero_artifact(sender, receiver)
    words = SAMPLE_TEXT.split()
    texts = [" ".join(words[i:] + words[:i]) * 2 for i in range(0, 30, 6)]
    res = calibrate_recompute(sender, receiver, art, texts, [0.2, 0.6], suffix_tokens=40)
    assert [q["f"] for q in res["recompute"]] == [0.2, 0.6]
    assert res["recompute"][0]["top1_agreement"] <= res["recompute"][1]["top1_agreement"]
    assert len(res["recompute_rows"]) == 2 * len(texts)
    est = res["estimate"]
    assert set(est["by_setting"]) == {"2048"}  # one setting: its own fit is the pooled one
    assert est["by_setting"]["2048"]["signal"] == est["signal"]
    est = {k: v for k, v in est.items() if k != "by_setting"}  # the pooled estimate (artifacts made before)
    assert est["signal"] in SIGNALS and -1 <= est["spearman"] <= 1
    assert 0.0 <= estimate(est, {est["signal"]: 0.5, "requested_fraction": 0.2}) <= 1.0
    assert estimate(est, {"requested_fraction": 0.2}) is None  # the signal was not measured
    assert fit_estimate([]) == {}
    # the stage's table becomes the gate's operating points (cheapest first, plain translation first)
    art.quality.update(top1_agreement=0.5, recompute=res["recompute"], estimate=est)
    labels = [p["label"] for p in transport.operating_points(art.params, art.quality)]
    assert labels == ["", "f=0.20 mix", "f=0.60 mix"]
    suffix = suffix_ids(receiver, QUESTION)
    state = capture_state(sender, CONTEXT, "t")
    art.quality["estimate"] = {**est, "cv_spearman": 0.6}
    out = relay_prefill(receiver, state, art, suffix, recompute=0.2)
    assert 0.0 <= out.info["estimate"] <= 1.0  # every recomputed request reports its estimate
    assert "estimate" not in relay_prefill(receiver, state, art, suffix).info
    # an estimate that ranked texts left out of its fit weakly is reported but not given to the gate,
    # however well it fitted its own texts
    art.quality["estimate"] = {**est, "spearman": -0.9, "cv_spearman": 0.3}
    weak = relay_prefill(receiver, state, art, suffix, recompute=0.2, signals="all").info
    assert "estimate" not in weak and weak["estimate_unused"] == out.info["estimate"]
    with pytest.raises(UsageError, match="signals must be"):
        relay_prefill(receiver, state, art, suffix, recompute=0.2, signals="some")
    # serving does not even measure an estimate the gate will not act on
    assert not {"estimate", "estimate_unused"} & set(relay_prefill(receiver, state, art, suffix, recompute=0.2).info)


def test_copy_sources_find_what_followed_the_contexts_last_tokens_earlier():
    from ctxrelay.transports.heterofold.recompute.rules import copy_sources

    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14] + list(range(100, 130)) + [7, 8, 9, 10, 11, 12])
    pos = copy_sources(ids, budget=12, n=6)
    assert pos.tolist() == list(range(2, 14))  # the earlier "7..12" and what came after it
    assert copy_sources(torch.arange(50), budget=12, n=6).numel() == 0  # nothing repeats


def test_copy_sources_give_the_latest_distinct_source_the_depth():
    from ctxrelay.transports.heterofold.recompute.rules import copy_sources

    tail = [7, 8, 9, 10, 11, 12]
    quoted = list(range(200, 240))  # what followed the tail each time it occurred before
    filler = list(range(300, 330))
    ids = torch.tensor(tail + quoted + filler + tail + quoted + filler + tail)
    second = len(tail + quoted + filler)  # start of the latest earlier occurrence
    # the same text quoted twice is one source: the whole budget runs on from the latest one
    assert copy_sources(ids, budget=30, n=6).tolist() == list(range(second, second + 30))
    other = torch.tensor(tail + list(range(400, 440)) + filler + tail + quoted + filler + tail)
    pos = copy_sources(other, budget=30, n=6).tolist()
    latest = [p for p in pos if p >= second]
    assert latest == list(range(second, second + 15)) and len(pos) == 30  # half each: two distinct sources


def test_copy_sources_follow_the_text_the_ending_repeats_word_for_word():
    """ShareGPT seed 500: a conversation repeating a legal text from 2000 tokens back, whose last tokens
    also occurred in three later places: the far source the ending has been repeating gets the budget."""
    from ctxrelay.transports.heterofold.recompute.rules import COPY_VERBATIM, backward_match, copy_sources

    tail = [7, 8, 9, 10, 11, 12]
    repeated = list(range(500, 500 + COPY_VERBATIM + 8))  # the text the context's ending repeats
    ids = repeated + tail + list(range(200, 240))
    source = len(repeated)
    for k in range(3):  # later, shorter matches of the last tokens, each followed by something else
        ids += [900 + k] + tail + list(range(1000 + 50 * k, 1040 + 50 * k))
    ids = torch.tensor(ids + repeated + tail)
    latest = len(ids) - len(repeated + tail) - 40 - len(tail)  # the latest short match
    hits = torch.tensor([source, latest])
    assert ids[latest : latest + 6].tolist() == tail
    assert backward_match(ids, hits, len(ids) - 6).tolist() == [len(repeated), 0]
    assert copy_sources(ids, budget=30, n=6).tolist() == list(range(source, source + 30))


def test_the_estimate_is_centred_per_calibrated_length():
    """Where mean top-1 falls with length and the signal does not, centres from one length would rank a
    mix of lengths by length; per-length centres rank requests by their signal within their length."""
    from ctxrelay.transports.heterofold.calibration.fractions import fit_estimate
    from ctxrelay.transports.heterofold.recompute.estimate import calibrated_estimates, estimate

    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, base in ((2048, 0.9), (4096, 0.8)):
        for i in range(8):
            sig = 0.1 + 0.02 * i + 0.002 * float(torch.rand(1, generator=gen))
            rows.append({"f": 0.3, "tokens": n, "translated_attention": sig, "top1_agreement": base - 0.5 * sig})
    est = fit_estimate(rows)
    assert est["signal"] == "translated_attention" and est["spearman"] == pytest.approx(-1.0)
    assert set(est["lengths"]) == {"2048", "4096"} and est["slope"] == pytest.approx(-0.5, abs=1e-6)
    info = {"translated_attention": 0.15, "requested_fraction": 0.3}
    at = {n: estimate(est, {**info, "context_tokens": n}) for n in (1024, 2048, 2896, 4096, 8192)}
    assert at[2048] == pytest.approx(0.9 - 0.5 * 0.15, abs=1e-3) and at[4096] == pytest.approx(0.8 - 0.075, abs=1e-3)
    assert at[1024] == at[2048] and at[8192] == at[4096]  # the nearest calibrated length outside the range
    assert at[2896] == pytest.approx((at[2048] + at[4096]) / 2, abs=1e-3)
    assert estimate(est, info) == pytest.approx(at[2048])  # no length given: the shortest's centres
    trusted = {**est, "cv_spearman": 0.9}
    assert len(calibrated_estimates(trusted, rows, 0.3)) == 16
    long = calibrated_estimates(trusted, rows, 0.3, tokens=4096)
    assert len(long) == 8 and max(long) < min(calibrated_estimates(trusted, rows, 0.3, tokens=2048))
    # rows made before the stage knew lengths fit one set of centres, as they always did
    legacy = fit_estimate([{k: v for k, v in r.items() if k != "tokens"} for r in rows if r["tokens"] == 2048])
    assert "lengths" not in legacy and estimate(legacy, {**info, "context_tokens": 4096}) == pytest.approx(at[2048])


def test_a_signal_that_barely_varies_is_never_the_estimate():
    """exact_share with a shared tokenizer is 1 - 1/n: a ranking by token count, not by quality."""
    from ctxrelay.transports.heterofold.calibration.fractions import fit_estimate

    rows = [{"f": 0.3, "top1_agreement": 0.8 + 0.01 * i, "exact_share": 1 - 1 / (2040 + i),
             "tail_nll": 3.0 - 0.05 * i + 0.2 * (i % 3)} for i in range(8)]  # fmt: skip
    est = fit_estimate(rows)
    assert est["signal"] == "tail_nll"  # exact_share ranks these perfectly, and means nothing
    assert fit_estimate([{k: v for k, v in r.items() if k != "tail_nll"} for r in rows]) == {}


@pytest.mark.parametrize(("s", "r"), PAIRS)
def test_hiding_translated_entries_from_the_question(tiny_by_family, s, r):
    """hide_translated = k: nothing is translated at f = 1 (native exactly); at f < 1 the question and the
    answer skip the translated entries in the first k layers; 0 is the relay as before."""
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    native = _native(receiver, CONTEXT, suffix).logits[-len(suffix) :]
    art = zero_artifact(sender, receiver)
    layers = receiver.spec.num_layers
    full = relay_prefill(receiver, state, art, suffix, logits="all", recompute=1.0, hide_translated=layers)
    assert (full.logits - native).abs().max() < TOL
    base = relay_prefill(receiver, state, art, suffix, logits="all", recompute=0.3, selection="recency")
    same = relay_prefill(receiver, state, art, suffix, logits="all", recompute=0.3, selection="recency",
                         hide_translated=0)  # fmt: skip
    assert torch.equal(base.logits, same.logits) and "hide_translated" not in same.info
    hid = relay_prefill(receiver, state, art, suffix, logits="all", recompute=0.3, selection="recency",
                        hide_translated=layers)  # fmt: skip
    assert hid.info["hide_translated"] == layers and (hid.logits - base.logits).abs().max() > 1e-4
    assert hid.cache.hidden_in == frozenset(range(layers))  # the answer decoded from this cache skips them too
    with pytest.raises(UsageError, match="hide_translated"):
        relay_prefill(receiver, state, art, suffix, recompute=0.3, hide_translated=layers + 1)


def test_a_stage_measured_with_hidden_translations_serves_its_points_with_them(tiny_by_family):
    from ctxrelay.transports.heterofold import transport
    from ctxrelay.transports.heterofold.calibration.fractions import calibrate_recompute

    sender, receiver = tiny_by_family["llama"], tiny_by_family["qwen2"]
    art = zero_artifact(sender, receiver)
    words = SAMPLE_TEXT.split()
    texts = [" ".join(words[i:] + words[:i]) * 2 for i in range(0, 24, 6)]
    hide = receiver.spec.num_layers // 2
    res = calibrate_recompute(sender, receiver, art, texts, [0.3], suffix_tokens=40, hide=hide)
    plain = calibrate_recompute(sender, receiver, art, texts, [0.3], suffix_tokens=40)
    assert res["recompute"][0]["hide_translated"] == hide and plain["recompute"][0]["hide_translated"] == 0
    assert res["recompute"][0]["kl"] != plain["recompute"][0]["kl"]  # measured with the option, not without
    art.quality.update(top1_agreement=0.5, recompute=res["recompute"])
    pts = transport.operating_points(art.params, art.quality)
    assert pts[0]["options"] == {}  # plain translation hides nothing
    assert pts[1]["options"] == {"recompute": 0.3, "selection": "mix", "hide_translated": hide}


def test_the_gate_trusts_an_estimate_by_the_texts_left_out_of_its_fit():
    """A signal that follows top-1 ranks texts left out of its fit about as well as those in it; noise
    picked as the best of six signals fits its own texts but ranks left-out ones near zero."""
    from ctxrelay.transports.heterofold.calibration.fractions import fit_estimate
    from ctxrelay.transports.heterofold.recompute.estimate import trusts
    from ctxrelay.transports.heterofold.recompute.recompute_pass import SIGNALS

    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(24):
        top1 = 0.7 + 0.01 * i
        noise = {s: float(torch.rand(1, generator=gen)) for s in SIGNALS}
        for f in (0.2, 0.3):
            rows.append({"text": i, "f": f, "top1_agreement": top1 + f / 10, **noise})
    noisy = fit_estimate(rows)  # every signal is noise: the best of six in sample
    assert abs(noisy["spearman"]) > noisy["cv_spearman"] and noisy["cv_spearman"] < 0.5 and not trusts(noisy)
    for r in rows:  # one signal now follows top-1 (with a little noise)
        r["tail_nll"] = 3.0 - 5 * r["top1_agreement"] + 0.01 * float(torch.rand(1, generator=gen))
    good = fit_estimate(rows)
    assert good["signal"] == "tail_nll" and good["cv_spearman"] > 0.9 and trusts(good)
    assert not trusts({k: v for k, v in good.items() if k != "cv_spearman"})  # calibrated before it existed


@pytest.mark.parametrize(("s", "r"), PAIRS)
@pytest.mark.parametrize("hide", [0, 2, -1])
def test_the_hiding_gap_is_the_first_rows_distance_between_two_relays(tiny_by_family, s, r, hide):
    """hiding_gap (a per-request signal): the total variation between the suffix's first next-token
    distributions of the relay as served and of the same relay with the other hiding (none where the
    point hides, every layer where it does not). Measuring it leaves the relay's logits and cache as
    they were; with nothing translated (f = 1) hiding changes nothing, and the gap is 0. hide=-1: every
    layer (tiny gemma3's first layers slide over the recomputed last tokens only: hiding 2 changes nothing
    for the first row there)."""
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    hide = receiver.spec.num_layers if hide < 0 else hide
    state = capture_state(sender, CONTEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    art = zero_artifact(sender, receiver)
    other = 0 if hide else receiver.spec.num_layers
    kw = {"logits": "all", "recompute": 0.3, "query": QUESTION}
    measured = relay_prefill(receiver, state, art, suffix, hide_translated=hide, signals="all", **kw)
    served = relay_prefill(receiver, state, art, suffix, hide_translated=hide, **kw)
    flipped = relay_prefill(receiver, state, art, suffix, hide_translated=other, **kw)
    assert torch.equal(measured.logits, served.logits) and measured.cache.length == served.cache.length
    assert measured.cache.hidden_in == served.cache.hidden_in == frozenset(range(hide))
    for i in range(receiver.spec.num_layers):
        assert torch.equal(measured.cache.keys[i], served.cache.keys[i])
        assert torch.equal(measured.cache.values[i], served.cache.values[i])
    p, q = (torch.softmax(x.logits[0].float(), -1) for x in (served, flipped))
    want = float(0.5 * (p - q).abs().sum())
    assert want > 1e-3 or (r == "gemma3" and hide == 2)
    assert measured.info["hiding_gap"] == pytest.approx(want, abs=1e-4)
    full = relay_prefill(receiver, state, art, suffix, recompute=1.0, hide_translated=hide, signals="all")
    assert full.info["hiding_gap"] < 1e-5


def test_the_estimate_is_centred_per_hiding():
    """The same f hiding 12 layers and hiding none are two operating points with their own mean top-1:
    a request is judged against the centres of its own hiding."""
    from ctxrelay.transports.heterofold.calibration.fractions import fit_estimate
    from ctxrelay.transports.heterofold.recompute.estimate import estimate

    rows = []
    for hide, base in ((0, 0.8), (12, 0.9)):
        for i in range(8):
            sig = 0.1 + 0.02 * i
            rows.append({"text": i, "f": 0.2, "tokens": 4096, "hide_translated": hide, "hiding_gap": sig,
                         "top1_agreement": base - 0.5 * sig})  # fmt: skip
    est = fit_estimate(rows)
    assert est["signal"] == "hiding_gap" and set(est["lengths"]) == {"4096", "4096+hide12"}
    info = {"hiding_gap": 0.15, "requested_fraction": 0.2, "context_tokens": 4096}
    assert estimate(est, info) == pytest.approx(0.8 - 0.075, abs=1e-6)
    assert estimate(est, {**info, "hide_translated": 12}) == pytest.approx(0.9 - 0.075, abs=1e-6)
    assert est["cv_spearman"] == pytest.approx(1.0)


def test_the_estimate_is_fitted_and_trusted_per_setting():
    """Where one setting's signal ranks its texts and another's does not, each setting gets its own
    estimate (signal, line, left-out Spearman): the gate acts on the one that ranks, never on the other,
    and a request is judged by its own hiding's estimate at the nearest calibrated length."""
    from ctxrelay.transports.heterofold.calibration.fractions import estimate_entry
    from ctxrelay.transports.heterofold.recompute.estimate import calibrated_estimates, estimate, estimate_model, trusts

    gen = torch.Generator().manual_seed(2)
    rows = []
    for i in range(12):
        top1 = 0.8 + 0.01 * i
        noise = float(torch.rand(1, generator=gen))
        rows.append({"text": i, "f": 0.2, "tokens": 4096, "hide_translated": 0, "top1_agreement": top1,
                     "translated_attention": 1.0 - top1, "kv_change": noise})  # fmt: skip
        rows.append({"text": i, "f": 0.2, "tokens": 2048, "hide_translated": 12, "top1_agreement": top1,
                     "translated_attention": float(torch.rand(1, generator=gen)), "kv_change": noise})  # fmt: skip
    est = estimate_entry(rows, "mix")
    assert set(est["by_setting"]) == {"4096", "2048+hide12"}
    assert est["by_setting"]["4096"]["signal"] == "translated_attention"
    assert trusts(est, 4096, 0) and trusts(est, 3000, 0)  # the one unhidden setting serves every length
    assert not trusts(est, 2048, 12) and not trusts(est, 4096, 6)  # ranks nothing / no such hiding
    assert estimate_model(est, 2048, 12) is est["by_setting"]["2048+hide12"]
    info = {"translated_attention": 0.15, "requested_fraction": 0.2, "context_tokens": 4096}
    assert estimate(est, info) == pytest.approx(0.85, abs=1e-3)
    assert len(calibrated_estimates(est, rows, 0.2, 4096, 0)) == 12
    assert calibrated_estimates(est, rows, 0.2, 2048, 12) == []
