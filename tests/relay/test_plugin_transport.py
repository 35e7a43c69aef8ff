"""A transport registered from outside the library is a first-class edge: the gate picks it under
transport="auto" and the pool answers through it, with no change to ctxrelay.relay.

The toy transport hands the sender's own K/V to a receiver that is a copy of the sender under
another weights hash (A -> A'), so its answer must equal A' reading the context itself.
"""

import copy
import time

import pytest
import torch

from conftest import SAMPLE_TEXT, assert_components_cover_ttft
from ctxrelay import transports
from ctxrelay.artifact import Artifact, model_binding
from ctxrelay.models import runner
from ctxrelay.models.spec import wrap
from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import CostModel, Profile, edge_key
from ctxrelay.transports import RelayOutput, Transport, check_edge

SUFFIX = " Question: what is a startup? Answer:"


class ToyIdentity(Transport):
    name = "toy-identity"
    artifact_version = 1
    needs = "kv"
    color = "tab:purple"

    def relay_prefill(self, receiver, state, artifact, suffix_ids, **options):
        check_edge(self.name, self.artifact_version, receiver, state, artifact)
        t0 = time.perf_counter()
        cache = runner.cache_from_pre_rope(receiver, state.keys_pre_rope, state.values)
        t1 = time.perf_counter()
        out = runner.forward(receiver, suffix_ids, cache)
        timings = {"assemble_s": t1 - t0, "first_token_s": time.perf_counter() - t1}
        return RelayOutput(out.cache, out.logits, timings, {"method": "identity"})


@pytest.fixture
def toy():
    t = transports.register(ToyIdentity())
    yield t
    transports.unregister(t.name)


def test_gate_picks_a_registered_plugin_transport_and_its_answer_is_native(toy, tiny_by_family, tmp_path):
    a = tiny_by_family["llama"]
    a2 = wrap(copy.deepcopy(a.hf), a.tokenizer, "tiny-llama-copy", weights_hash="copy-of-" + a.spec.weights_hash)
    assert a2.spec.weights_hash != a.spec.weights_hash  # another model version: no "self" edge between them
    art = Artifact(toy.name, toy.artifact_version, model_binding(a), model_binding(a2), {"unused": torch.zeros(1)},
                   quality={"top1_agreement": 1.0}, command="test")  # fmt: skip
    art.save(tmp_path / "artifacts" / "toy-identity-a-to-a2.safetensors")
    samples = lambda per, key: [(n, {key: per * n}) for n in (64, 128, 256)]
    key = edge_key(toy.name, a.spec.weights_hash, a2.spec.weights_hash)
    profile = Profile(
        native={a2.spec.weights_hash: CostModel.fit(samples(1e-3, "prefill_s"))},
        edges={key: CostModel.fit(samples(1e-4, "assemble_s"))},
    )
    pool = ModelPool([a, a2], artifact_dirs=[tmp_path / "artifacts"], profile=profile)
    state = pool.prefill(a.name, SAMPLE_TEXT, tenant="acme")
    res = pool.continue_from(state, a2.name, SUFFIX, transport="auto", max_new_tokens=4)
    ref = pool.native(a2.name, SAMPLE_TEXT, SUFFIX, max_new_tokens=4)
    assert res.transport == "toy-identity", res.reason
    assert "toy-identity predicted" in res.reason and res.info == {"method": "identity"}
    assert (res.first_logits - ref.first_logits).abs().max() < 1e-5
    assert res.tokens == ref.tokens
    # the graph draws it in its own colour and the request validator knows its name
    assert toy.name in transports.names() and pool.graph.calibrated[0].transport == toy.name


def test_an_artifact_of_an_unregistered_transport_is_skipped_with_its_reason(tiny_by_family, tmp_path):
    a, b = tiny_by_family["llama"], tiny_by_family["qwen2"]
    art = Artifact("nobody-knows", 1, model_binding(a), model_binding(b), {"w": torch.zeros(1)})
    art.save(tmp_path / "x.safetensors")
    pool = ModelPool([a, b], artifact_dirs=[tmp_path], profile=Profile())
    assert pool.graph.calibrated == [] and "unknown transport 'nobody-knows'" in pool.graph.skipped[0]


def test_registry_refuses_what_is_not_a_transport_and_silent_replacement(toy):
    with pytest.raises(transports.UnknownTransport, match="known: self"):
        transports.get("no-such-transport")
    with pytest.raises(ValueError, match="not a named ctxrelay Transport"):
        transports.register(object())
    with pytest.raises(ValueError, match="already registered"):
        transports.register(ToyIdentity())  # same name, another object
    assert transports.get(toy.name) is toy


class ToyPoints(ToyIdentity):
    """Two operating points; relay_prefill reports a per-request estimate that depends on the point."""

    name = "toy-points"
    estimates = {"cheap": 0.5, "good": 0.95}
    calibrated = {"cheap": 0.95, "good": 0.97}  # top-1 agreement per point

    def operating_points(self, params, quality):
        return [
            {"label": p, "options": {"point": p}, "quality": {"top1_agreement": q}} for p, q in self.calibrated.items()
        ]

    empty: tuple[str, ...] = ()  # points whose first token is end-of-sequence

    def relay_prefill(self, receiver, state, artifact, suffix_ids, **options):
        out = super().relay_prefill(receiver, state, artifact, suffix_ids)
        out.info["estimate"] = self.estimates[options["point"]]
        if options["point"] in self.empty:
            out.logits = out.logits.clone()
            out.logits[-1, min(runner.eos_ids(receiver))] = out.logits[-1].max() + 1.0
        return out


@pytest.fixture
def points_pool(tiny_by_family, tmp_path):
    t = transports.register(ToyPoints())
    a = tiny_by_family["llama"]
    a2 = wrap(copy.deepcopy(a.hf), a.tokenizer, "tiny-llama-copy", weights_hash="copy2-" + a.spec.weights_hash)
    art = Artifact(t.name, 1, model_binding(a), model_binding(a2), {"unused": torch.zeros(1)}, command="test")
    art.save(tmp_path / "artifacts" / "toy-points.safetensors")
    samples = lambda per, key: [(n, {key: per * n}) for n in (64, 128, 256)]
    key = edge_key(t.name, a.spec.weights_hash, a2.spec.weights_hash)
    profile = Profile(
        native={a2.spec.weights_hash: CostModel.fit(samples(1.0, "prefill_s"))},  # 1 s/token: room to escalate
        edges={f"{key}@cheap": CostModel.fit(samples(1e-4, "assemble_s")),
               f"{key}@good": CostModel.fit(samples(2e-4, "assemble_s"))},
    )  # fmt: skip
    pool = ModelPool([a, a2], artifact_dirs=[tmp_path / "artifacts"], profile=profile)
    yield pool, a, a2, t
    transports.unregister(t.name)


def test_a_request_whose_estimate_fails_escalates_to_the_next_point(points_pool):
    pool, a, a2, t = points_pool
    state = pool.prefill(a.name, SAMPLE_TEXT, tenant="acme")
    res = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=2)
    assert res.transport == "toy-points" and res.decision["point"] == "good"
    assert "estimated top-1 for this request 0.95" in res.reason and "cheap: estimated top-1 0.50 < 0.85" in res.reason
    assert res.timings["rejected_relay_s"] > 0
    assert_components_cover_ttft(res, 0.2)


def test_a_request_no_point_estimates_good_enough_gets_native_with_the_reason(points_pool):
    pool, a, a2, t = points_pool
    t.estimates = {"cheap": 0.5, "good": 0.6}
    state = pool.prefill(a.name, SAMPLE_TEXT, tenant="acme")
    res = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=2)
    ref = pool.native(a2.name, SAMPLE_TEXT, SUFFIX, max_new_tokens=2)
    assert res.transport == "native" and "good: estimated top-1 0.60 < 0.85" in res.reason
    assert res.tokens == ref.tokens
    # quality_threshold=0 is the explicit opt-in to gist-only speed: the cheapest point, no estimate check
    gist = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=2, quality_threshold=0.0)
    assert gist.transport == "toy-points" and gist.decision["point"] == "cheap"


def test_a_relay_that_would_answer_nothing_escalates(points_pool):
    pool, a, a2, t = points_pool
    t.estimates, t.empty = {"cheap": 0.95, "good": 0.95}, ("cheap",)
    state = pool.prefill(a.name, SAMPLE_TEXT, tenant="acme")
    res = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=2)
    assert res.transport == "toy-points" and res.decision["point"] == "good"
    assert "cheap: the relayed first token ends the text (an empty answer)" in res.reason
    t.empty = ("cheap", "good")
    res = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=2)
    assert res.transport == "native" and "good: the relayed first token ends the text" in res.reason


def test_after_a_refusal_a_point_calibrated_no_better_is_not_tried(points_pool):
    pool, a, a2, t = points_pool
    # the better point is cheaper here (e.g. its estimate refuses fewer requests), so it goes first;
    # once its estimate refuses this request, the worse point would serve it no better
    t.calibrated = {"cheap": 0.97, "good": 0.95}
    pool.refresh()
    state = pool.prefill(a.name, SAMPLE_TEXT, tenant="acme")
    res = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=2)
    assert res.transport == "native", res.reason
    assert "cheap: estimated top-1 0.50 < 0.85" in res.reason
    assert "good: skipped (calibrated top-1 0.950, no better than a refused point)" in res.reason
    # a refusal for an empty answer says nothing about quality: the next point is still tried
    t.estimates, t.empty = {"cheap": 0.95, "good": 0.95}, ("cheap",)
    res = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=2)
    assert res.transport == "toy-points" and res.decision["point"] == "good", res.reason
