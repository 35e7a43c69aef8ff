"""heterofold's own_layers: the receiver's own K/V for every context token in its first k layers. k = all
layers is native prefill exactly; k = 1 replaces layer 0 alone; the artifact's params say what it serves."""

import pytest
import torch

from conftest import SAMPLE_TEXT, zero_artifact
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import context_ids, suffix_ids, tokenize_context
from ctxrelay.transports.heterofold import relay_prefill
from ctxrelay.transports.heterofold.calibration import job as calib_data
from ctxrelay.transports.heterofold.transfer import assemble_cache

TOL = 1e-4
QUESTION = " Question: What does the text say? Answer:"
PAIRS = [("llama", "gemma3"), ("gemma3", "qwen2"), ("qwen2", "llama")]  # every family as a receiver


def _native_logits(receiver, suffix):
    return runner.forward(receiver, torch.cat([context_ids(receiver, SAMPLE_TEXT), suffix]), logits="all").logits


@pytest.mark.parametrize(("s", "r"), PAIRS)
@pytest.mark.parametrize("f", [0.0, 0.3])
def test_own_kv_in_every_layer_reproduces_native_prefill(tiny_by_family, s, r, f):
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, SAMPLE_TEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    native = _native_logits(receiver, suffix)[-len(suffix) :]
    art = zero_artifact(sender, receiver)  # translation is wrong everywhere: only the own K/V can fix it
    layers = receiver.spec.num_layers
    out = relay_prefill(receiver, state, art, suffix, logits="all", recompute=f, own_layers=layers)
    assert (out.logits - native).abs().max() < TOL
    assert out.info["own_layers"] == layers
    assert sum(out.timings.values()) > 0 and "assemble_s" in out.timings
    art.params["own_layers"] = layers  # the artifact's own setting is the default
    assert torch.equal(relay_prefill(receiver, state, art, suffix, logits="all", recompute=f).logits, out.logits)
    plain = relay_prefill(receiver, state, art, suffix, logits="all", recompute=f, own_layers=0)
    assert (plain.logits - native).abs().max() > 1e-2


@pytest.mark.parametrize(("s", "r"), PAIRS)
@pytest.mark.parametrize("f", [0.0, 0.3])
def test_hiding_hides_translated_entries_only_not_the_receivers_own(tiny_by_family, s, r, f):
    """Own K/V in every layer and every layer hidden: nothing translated is left, so the question sees
    the whole context and the relay is native prefill exactly (before, it hid the receiver's own entries)."""
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, SAMPLE_TEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    native = _native_logits(receiver, suffix)[-len(suffix) :]
    art, layers = zero_artifact(sender, receiver), receiver.spec.num_layers
    kw = {"logits": "all", "recompute": f, "own_layers": layers}
    out = relay_prefill(receiver, state, art, suffix, hide_translated=layers, **kw)
    assert (out.logits - native).abs().max() < TOL
    # one own layer: hiding k layers hides layers 1..k-1, the same as hiding k layers where layer 0 shows all
    ids, offsets = tokenize_context(receiver, SAMPLE_TEXT)
    cache, _ = assemble_cache(receiver, state, art, ids, offsets, room=len(suffix), own_layers=1)
    hidden = torch.ones(ids.numel(), dtype=torch.bool)
    hidden[0] = False  # the sink stays visible, as the relay keeps it
    cache.hide(hidden, 2, first=1)
    assert cache.hidden_in == frozenset({1}) and cache.clone().hidden_in == frozenset({1})
    cache.hide(hidden, 1, first=1)  # no layer left between first and layers: nothing hidden
    assert cache.hidden is None and cache.hidden_in == frozenset()


@pytest.mark.parametrize(("s", "r"), PAIRS)
def test_own_layer_zero_replaces_layer_zero_alone(tiny_by_family, s, r):
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, SAMPLE_TEXT, "t")
    ids, offsets = tokenize_context(receiver, SAMPLE_TEXT)
    art = zero_artifact(sender, receiver)
    plain, _ = assemble_cache(receiver, state, art, ids, offsets)
    own, _ = assemble_cache(receiver, state, art, ids, offsets, own_layers=1)
    native = runner.forward(receiver, ids, logits="none").cache
    t = ids.numel()
    assert torch.allclose(own.view(0, t)[0], native.view(0, t)[0], atol=1e-5)
    assert torch.allclose(own.view(0, t)[1], native.view(0, t)[1], atol=1e-5)
    for i in range(1, receiver.spec.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(own.view(i, t), plain.view(i, t), strict=True))


def test_bad_own_layers_are_clear(tiny_by_family):
    sender, receiver = tiny_by_family["llama"], tiny_by_family["qwen2"]
    state = capture_state(sender, SAMPLE_TEXT, "t")
    art = zero_artifact(sender, receiver)
    suffix = suffix_ids(receiver, QUESTION)
    for k in (-1, receiver.spec.num_layers + 1):
        with pytest.raises(UsageError, match="own_layers must be a layer count"):
            relay_prefill(receiver, state, art, suffix, own_layers=k)


def test_setting_own_layers_drops_the_stages_measured_with_other_kv(tiny_by_family):
    art = zero_artifact(tiny_by_family["llama"], tiny_by_family["qwen2"])
    art.params.update(recompute_stage={"rows": []}, facts_stage={"rows": []})
    art.quality.update(top1_agreement=0.7, recompute=[{"f": 0.3}], facts=[{"f": 0.3}], estimate={"signal": "x"})
    calib_data._set_own_layers(art, 0, 4)  # what it already serves (no own_layers: 0): nothing changes
    assert "recompute_stage" in art.params and "recompute" in art.quality
    calib_data._set_own_layers(art, 1, 4)
    assert art.params["own_layers"] == 1 and art.params["report_own_layers"] == 0
    assert not {"recompute_stage", "facts_stage"} & set(art.params)
    assert not {"recompute", "facts", "estimate"} & set(art.quality) and art.quality["top1_agreement"] == 0.7
    with pytest.raises(UsageError, match="own_layers must be a layer count"):
        calib_data._set_own_layers(art, 5, 4)


def test_own_layers_is_refused_where_a_stage_runs_no_model():
    with pytest.raises(UsageError, match="own_layers changes what the relay serves"):
        calib_data.calibrate_job("a", "b", options={"stage": "refit", "own_layers": 1})
