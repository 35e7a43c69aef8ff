"""`ctxrelay bench router`: the transcript spans, the per-turn facts on a tiny model, and the simulation
(prefix cache never slower than full re-prefill; a cheaper relay lowers TTFT only after the other model)."""

from ctxrelay.relay.graph import CostModel
from ctxrelay_bench.router import bench as router


def _facts(n_conv=6, turns=3):
    mk = lambda j, s: router.TurnFacts(prompt_tokens=300 * j + 100, through_reply=300 * (j + 1), reply_tokens=50,
                                       score=s)  # fmt: skip
    return {
        "L": {f"c{i}": [mk(j, -1.0) for j in range(turns)] for i in range(n_conv)},
        "S": {f"c{i}": [mk(j, -1.0 - 0.5 * ((i + j) % 2)) for j in range(turns)] for i in range(n_conv)},
    }


def _costs(relay_s=None, refused=0.0):
    lin = lambda per: CostModel({"prefill_s": [0.05, per, 0.0]})
    relay = {("L", "S"): (lambda n: (relay_s, refused))} if relay_s is not None else {}
    return router.Costs({"L": lin(4e-3), "S": lin(1e-3)}, {"L": 0.02, "S": 0.005}, relay)


def test_transcript_spans_cover_each_reply():
    text, spans = router.text_of([("hi there", "hello"), ("and now?", "now this")])
    assert [text[a:b] for _, a, b in spans] == ["hello", "now this"]
    assert text[: spans[1][0]].endswith("user: and now?\n\n")


def test_turn_facts_on_a_tiny_model(tiny):
    text, spans = router.text_of([("What is two and two?", "It is four."), ("And three?", "Seven minus four.")])
    facts = router.score_conversation(tiny, text, spans)
    assert len(facts) == 2
    for f in facts:
        assert 0 < f.prompt_tokens < f.through_reply and f.reply_tokens > 0 and f.score < 0
    assert facts[0].through_reply < facts[1].prompt_tokens


def test_p_counts_small_turns_after_large_ones():
    assert router.share_after_large({"a": ["L", "S", "S"], "b": ["S", "L", "S"]}, "L", "S") == 2 / 3


def test_prefix_cache_never_slower_than_full_and_relay_only_after_the_other_model():
    facts = _facts()
    rt = router.routes(facts, "L", "S", tau=0.25, sigma=0.0, seed=0)  # S where the margin is 0, L where 0.5
    native = router.simulate(facts, rt, _costs(), "native", rate=0.01, think_s=5.0, reply_cap=16, seed=0)
    full = router.simulate(facts, rt, _costs(), "full", rate=0.01, think_s=5.0, reply_cap=16, seed=0)
    assert all(n["prefill_s"] <= f["prefill_s"] + 1e-12 for n, f in zip(native, full, strict=True))
    relay = router.simulate(facts, rt, _costs(relay_s=0.01), "relay", rate=0.01, think_s=5.0, reply_cap=16, seed=0)
    relayed = [x for x in relay if x["how"] == "relay"]
    assert relayed and all(x["model"] == "S" for x in relayed)
    assert sum(x["ttft_s"] for x in relay) < sum(x["ttft_s"] for x in native)
    # no edge passes the gate: the relay mode is the native one
    same = router.simulate(facts, rt, _costs(), "relay", rate=0.01, think_s=5.0, reply_cap=16, seed=0)
    assert [x["ttft_s"] for x in same] == [x["ttft_s"] for x in native]


def test_a_refused_relay_pays_the_relay_then_the_prefix_cached_prefill():
    facts = _facts(n_conv=40)
    rt = router.routes(facts, "L", "S", tau=0.25, sigma=0.0, seed=0)
    native = router.simulate(facts, rt, _costs(), "native", rate=0.01, think_s=5.0, reply_cap=16, seed=0)
    half = router.simulate(facts, rt, _costs(relay_s=0.01, refused=0.5), "relay", rate=0.01, think_s=5.0,
                           reply_cap=16, seed=0)  # fmt: skip
    hows = [x["how"] for x in half]
    assert hows.count("refused") and hows.count("relay")  # drawn per turn, about half each
    for x, n in zip(half, native, strict=True):
        if x["how"] == "refused":  # the relay, then what native prefill costs this turn
            assert x["prefill_s"] > n["prefill_s"]
    # refused so often that the expected cost loses to the prefix-cached prefill: never tried
    never = router.simulate(facts, rt, _costs(relay_s=0.05, refused=0.99), "relay", rate=0.01, think_s=5.0,
                            reply_cap=16, seed=0)  # fmt: skip
    assert not any(x["how"] in ("relay", "refused") for x in never)
