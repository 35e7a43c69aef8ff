"""The heterofold artifacts shipped in the package (the demo's directions, one from gemma3), on the zoo models."""

import json
from pathlib import Path

import pytest
import torch

import ctxrelay
from ctxrelay.artifact import Artifact
from ctxrelay.transports.heterofold import ARTIFACT_VERSION, TRANSPORT

PACKAGED = Path(ctxrelay.__file__).parent / "artifacts"
SHIPPED = [
    ("qwen2.5-coder-1.5b", "smollm2-135m"),
    ("qwen2.5-coder-1.5b", "gemma3-270m"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),  # same tokenizer, other size: beside mapflow's edge
    ("smollm2-135m", "gemma3-270m"),  # the small sender: the gate relays it with recompute
    ("gemma3-270m", "qwen2.5-coder-0.5b"),  # relayed at f = 0.4 / 0.3 (2048 / 4096 tokens)
]


def _path(sender, receiver):
    return PACKAGED / f"heterofold-{sender}-to-{receiver}.safetensors"


def _zoo_manifest(name):
    from ctxrelay import zoo

    path = zoo.model_dir(name) / "ctxrelay.json"
    if not path.exists():
        pytest.skip(f"{name} is not in the zoo cache; run `ctxrelay zoo pull {name}`")
    return json.loads(path.read_text())


@pytest.mark.parametrize(("sender", "receiver"), SHIPPED)
def test_shipped_artifact_is_small_bound_and_reports_quality(sender, receiver):
    path = _path(sender, receiver)
    assert path.exists(), f"{path.name} must ship with the package (made by `ctxrelay calibrate`)"
    assert path.stat().st_size <= 10 * 10**6  # shipped artifacts stay small (fp16, <= 10 MB)
    art = Artifact.load(path, transport=TRANSPORT, version=ARTIFACT_VERSION)
    assert art.command.startswith("ctxrelay calibrate --transport heterofold")
    assert art.params["method"] == "heterofold" and art.params["pairing"] == "ta"
    assert all(t.dtype == torch.float16 for t in art.tensors.values())
    q = art.quality
    assert 0 <= q["top1_agreement"] <= 1 and q["kl"] >= 0 and "128" in q["ppl"] and "128" in q["native_ppl"]
    assert (art.sender["name"], art.receiver["name"]) == (sender, receiver)


@pytest.mark.real
@pytest.mark.parametrize(("sender", "receiver"), SHIPPED)
def test_shipped_artifact_matches_the_zoo_models(sender, receiver):
    from transformers import AutoTokenizer

    from ctxrelay import zoo
    from ctxrelay.models.spec import hash_tokenizer

    art = Artifact.load(_path(sender, receiver))
    for bound, name in ((art.sender, sender), (art.receiver, receiver)):
        assert bound["weights_hash"] == _zoo_manifest(name)["weights_hash"], f"{name} weights changed: recalibrate"
        tok = AutoTokenizer.from_pretrained(str(zoo.model_dir(name)))
        assert bound["tokenizer_hash"] == hash_tokenizer(tok)


@pytest.mark.real
def test_shipped_artifact_carries_the_context_qwen15_to_smollm2():
    """The 1.5B reads a held-out essay; smollm2 continues it from the translated cache: its
    perplexity on the true continuation is far below what it gets without the context."""
    from ctxrelay import zoo
    from ctxrelay.data.datasets import essay_haystack
    from ctxrelay.metrics import token_nll
    from ctxrelay.models import runner
    from ctxrelay.models.capture import capture_state
    from ctxrelay.models.tokens import suffix_ids, tokenize_context
    from ctxrelay.transports.heterofold import relay_prefill
    from ctxrelay.transports.heterofold.calibration import heldout as quality

    sender_name, receiver_name = SHIPPED[0]
    _zoo_manifest(sender_name)
    art = Artifact.load(_path(sender_name, receiver_name))
    receiver = zoo.load(receiver_name)
    text = essay_haystack(receiver.tokenizer, 480, split="heldout", seed=3)
    context, rest = quality.split_text(receiver, text, 96)
    sender = zoo.load(sender_name)
    state = capture_state(sender, context, tenant="test")
    del sender
    suffix = suffix_ids(receiver, rest)
    out = relay_prefill(receiver, state, art, suffix, logits="all")
    ctx_ids = tokenize_context(receiver, context)[0]
    native = runner.forward(receiver, torch.cat([ctx_ids, suffix]), logits="all").logits[-len(suffix) :]
    alone = runner.forward(receiver, suffix, logits="all").logits
    targets = suffix[1:]
    relay_nll = token_nll(out.logits[:-1], targets).mean()
    alone_nll = token_nll(alone[:-1], targets).mean()
    native_nll = token_nll(native[:-1], targets).mean()
    top1 = (out.logits[:-1].argmax(-1) == native[:-1].argmax(-1)).float().mean()
    print(f"nll relay {relay_nll:.3f} native {native_nll:.3f} no-context {alone_nll:.3f}, top-1 {top1:.3f}")
    assert relay_nll < alone_nll - 0.2  # the translated cache carries the context
    assert top1 > 0.5
    assert set(out.timings) == {"translate_s", "copy_s", "assemble_s", "first_token_s"}


@pytest.mark.real
def test_full_recompute_reproduces_native_on_a_real_pair():
    """f = 1: the receiver recomputes every context token over the translated cache: its native
    prefill, to fp32 tolerance, whatever the translation left there."""
    from ctxrelay import zoo
    from ctxrelay.data.datasets import essay_haystack
    from ctxrelay.models import runner
    from ctxrelay.models.capture import capture_state
    from ctxrelay.models.tokens import context_ids, suffix_ids
    from ctxrelay.transports.heterofold import relay_prefill

    sender_name, receiver_name = SHIPPED[0]
    _zoo_manifest(sender_name)
    art = Artifact.load(_path(sender_name, receiver_name))
    receiver = zoo.load(receiver_name)
    context = essay_haystack(receiver.tokenizer, 300, split="heldout", seed=5)
    state = capture_state(zoo.load(sender_name), context, tenant="test")
    suffix = suffix_ids(receiver, "\n\nQuestion: What is this essay about?\nAnswer:")
    native = runner.forward(receiver, torch.cat([context_ids(receiver, context), suffix]), logits="all").logits
    out = relay_prefill(receiver, state, art, suffix, logits="all", recompute=1.0)
    assert (out.logits - native[-len(suffix) :]).abs().max() < 1e-3
    hidden = relay_prefill(receiver, state, art, suffix, logits="all", recompute=1.0, hide_translated=12)
    assert (hidden.logits - native[-len(suffix) :]).abs().max() < 1e-3  # nothing translated is left to hide
    plain = relay_prefill(receiver, state, art, suffix, logits="all")
    assert (plain.logits - native[-len(suffix) :]).abs().max() > 1e-2  # the translation alone is not native
    own = relay_prefill(receiver, state, art, suffix, logits="all", own_layers=receiver.spec.num_layers)
    assert (own.logits - native[-len(suffix) :]).abs().max() < 1e-3  # its own K/V in every layer: native
