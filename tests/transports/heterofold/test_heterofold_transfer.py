"""heterofold transfer: exactness (self-transfer with identity maps), sink handling, bindings, contract."""

import dataclasses

import pytest
import torch

from conftest import SAMPLE_TEXT, zero_artifact
from ctxrelay.errors import BindingError
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tiny import tiny_model
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.transports.base import TIMING_KEYS
from ctxrelay.transports.heterofold import ARTIFACT_VERSION, identity_artifact, relay_prefill

TOL = 1e-4
# a mid-text special token ("<eos>") is computed natively too, not translated
CONTEXT = SAMPLE_TEXT[:220] + " <eos> and then more text follows here."


def _suffix(m, text=" Nor is it necessary for a startup to work on technology."):
    ids, offs = tokenize_context(m, text)
    return ids[(offs[:, 1] > 0)]  # drop an added BOS


def test_self_transfer_with_identity_maps_reproduces_native(tiny):
    state = capture_state(tiny, CONTEXT, "tenant-a")
    suffix = _suffix(tiny)
    native = runner.forward(tiny, torch.cat([state.tokens, suffix]), logits="all").logits
    art = identity_artifact(tiny)
    out = relay_prefill(tiny, state, art, suffix, logits="all")
    assert out.info["native_positions"] >= 2  # the sink and the <eos>
    assert (out.logits - native[-len(suffix) :]).abs().max() < TOL
    last = relay_prefill(tiny, state, art, suffix)
    assert last.logits.shape == (1, tiny.spec.vocab_size)
    assert (last.logits[0] - native[-1]).abs().max() < TOL
    assert out.cache.length == state.num_tokens + len(suffix)
    # decoding continues from the relayed cache exactly as from the native one
    nxt = torch.tensor([int(native[-1].argmax())])
    a = runner.forward(tiny, nxt, out.cache).logits
    b = runner.forward(tiny, torch.cat([state.tokens, suffix, nxt])).logits
    assert (a - b).abs().max() < TOL


def test_empty_suffix_runs_the_last_context_token_natively(tiny):
    state = capture_state(tiny, CONTEXT, "t")
    native = runner.forward(tiny, state.tokens).logits
    out = relay_prefill(tiny, state, identity_artifact(tiny), torch.tensor([], dtype=torch.long))
    assert (out.logits - native).abs().max() < TOL
    assert out.cache.length == state.num_tokens
    steps = {"translate_s", "copy_s", "assemble_s", "first_token_s"}
    assert steps <= set(out.timings) <= set(TIMING_KEYS) and all(v >= 0 for v in out.timings.values())


def test_cross_family_sink_is_native_and_specials_native(tiny_by_family):
    sender, receiver = tiny_by_family["llama"], tiny_by_family["gemma3"]
    state = capture_state(sender, CONTEXT, "t")
    out = relay_prefill(receiver, state, zero_artifact(sender, receiver), _suffix(receiver))
    ids = tokenize_context(receiver, CONTEXT)[0]
    native = runner.forward(receiver, ids[:1], logits="none").cache
    for i in range(receiver.spec.num_layers):
        assert torch.allclose(out.cache.keys[i][:, :, :1], native.keys[i], atol=1e-5)  # BOS: own state (fp32 tolerance)
        assert out.cache.keys[i].shape[2] == len(ids) + len(_suffix(receiver))
    assert out.info["context_tokens"] == len(ids) and out.info["exact_boundaries"] > 0


def test_bindings_are_refused(tiny_by_family):
    llama, qwen, gemma = (tiny_by_family[f] for f in ("llama", "qwen2", "gemma3"))
    state = capture_state(llama, CONTEXT, "t")
    art = zero_artifact(llama, gemma)
    suffix = _suffix(gemma)
    with pytest.raises(BindingError, match="receiver"):
        relay_prefill(qwen, state, art, suffix)  # artifact calibrated for another receiver
    qwen_state = capture_state(qwen, CONTEXT, "t")
    with pytest.raises(BindingError, match="made by"):
        relay_prefill(gemma, qwen_state, art, suffix)  # state from a model that is not the artifact's sender
    with pytest.raises(BindingError, match="mapflow"):
        relay_prefill(gemma, state, dataclasses.replace(art, transport="mapflow"), suffix)
    with pytest.raises(BindingError, match="recalibrate"):
        relay_prefill(gemma, state, dataclasses.replace(art, version=ARTIFACT_VERSION + 1), suffix)
    other = tiny_model("llama", seed=1)  # same architecture and tokenizer, other weights
    other_state = capture_state(other, CONTEXT, "t")
    with pytest.raises(BindingError, match="weights"):
        relay_prefill(gemma, other_state, art, suffix)
    with pytest.raises(ValueError, match="kv=True"):
        relay_prefill(gemma, capture_state(llama, CONTEXT, "t", kv=False), art, suffix)
    with pytest.raises(ValueError, match="token ids"):
        relay_prefill(gemma, state, art, torch.tensor([gemma.spec.vocab_size + 5]))


@pytest.mark.real
def test_self_transfer_exact_on_a_real_model():
    from ctxrelay import zoo

    m = zoo.load("smollm2-135m")
    text = (SAMPLE_TEXT + " ") * 2
    state = capture_state(m, text, "t")
    suffix = _suffix(m, " The best way to get startup ideas is to look for problems.")
    native = runner.forward(m, torch.cat([state.tokens, suffix]), logits="all").logits[-len(suffix) :]
    out = relay_prefill(m, state, identity_artifact(m), suffix, logits="all")
    assert (out.logits - native).abs().max() < 1e-3
    assert torch.equal(out.logits.argmax(-1), native.argmax(-1))
