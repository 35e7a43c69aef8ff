"""hide_translated="global": translated entries hidden from the question only in the receiver's
full-attention layers (hiding.py), on tiny models of every family."""

import pytest
import torch

from conftest import SAMPLE_TEXT, zero_artifact
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import suffix_ids, tokenize_context
from ctxrelay.transports.heterofold import relay_prefill
from ctxrelay.transports.heterofold.hiding import (
    GLOBAL,
    hidden_layers,
    hide_code,
    hide_label,
    hide_last,
    hide_order,
    point_label,
)
from ctxrelay.transports.heterofold.recompute.recompute_pass import recompute
from ctxrelay.transports.heterofold.recompute.rules import select
from ctxrelay.transports.heterofold.recompute.settings import Setting
from ctxrelay.transports.heterofold.transfer import assemble_cache, translated_mask

TOL = 1e-4
QUESTION = " Question: what did the text say first? Answer:"


def test_hide_values_parse_label_and_order():
    assert [hide_code(x) for x in (None, "", 0, "0", 12, "12", "global", " Global ")] == [0, 0, 0, 0, 12, 12, GLOBAL,
                                                                                          GLOBAL]  # fmt: skip
    for bad in (-1, "-3", "first", 1.5j):
        with pytest.raises(UsageError, match="hide_translated"):
            hide_code(bad)
    assert [hide_label(x) for x in (0, 12, "global")] == ["", "hide12", "hideglobal"]
    assert sorted(["global", 12, 0, 6], key=hide_order) == [0, 6, 12, "global"]
    for n, hide in ((4096, 0), (4096, 12), (2048, "global")):  # settings keys round-trip
        assert Setting.parse(Setting(n, hide).key) == (n, hide)
    assert Setting(4096, "global").key == "4096+hideglobal"
    assert sorted([(0.1, 4096, "global"), (0.1, 4096, 12), (0.1, 2048, 0)], key=hide_last) == [
        (0.1, 2048, 0), (0.1, 4096, 12), (0.1, 4096, "global")]  # fmt: skip
    assert [point_label(0.12, "mix", h) for h in (0, 12, "global")] == [
        "f=0.12 mix", "f=0.12 mix hide12", "f=0.12 mix hideglobal"]  # fmt: skip


def test_global_names_the_full_attention_layers(tiny_by_family):
    gemma, llama = tiny_by_family["gemma3"].spec, tiny_by_family["llama"].spec
    full = {i for i, w in enumerate(gemma.sliding_windows) if w is None}
    assert full and len(full) < gemma.num_layers  # the tiny gemma3 has both kinds
    assert hidden_layers(gemma, GLOBAL) == full
    assert hidden_layers(llama, GLOBAL) == set(range(llama.num_layers))  # no windows: every layer
    assert hidden_layers(llama, GLOBAL, first=1) == set(range(1, llama.num_layers))
    assert hidden_layers(llama, 2) == {0, 1} and hidden_layers(llama, 0) == frozenset()
    with pytest.raises(UsageError, match="layer count"):
        hidden_layers(llama, llama.num_layers + 1)


@pytest.mark.parametrize(("s", "r"), [("llama", "gemma3"), ("gemma3", "qwen2"), ("qwen2", "llama")])
def test_global_hiding_is_the_two_passes_with_the_full_attention_layers_hidden(tiny_by_family, s, r):
    """The relay with hide_translated="global" equals recompute, then hiding the translated entries in
    the full-attention layers, then the question over that cache; on a receiver without sliding windows it
    equals hiding every layer."""
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state = capture_state(sender, SAMPLE_TEXT, "t")
    suffix = suffix_ids(receiver, QUESTION)
    art = zero_artifact(sender, receiver)
    kw = {"logits": "all", "recompute": 0.3, "query": QUESTION}
    served = relay_prefill(receiver, state, art, suffix, hide_translated="global", **kw)
    ids, offsets = tokenize_context(receiver, SAMPLE_TEXT)
    cache, al = assemble_cache(receiver, state, art, ids, offsets, native=False)
    picked = select(receiver, "mix", 0.3, ids, offsets, SAMPLE_TEXT, QUESTION, cache, al.native)
    recompute(receiver, ids, cache, picked.positions, "all", ())
    full = {i for i, w in enumerate(receiver.spec.sliding_windows) if w is None}
    cache.hide(translated_mask(ids.numel(), al.native, picked), full)
    two = runner.forward(receiver, suffix, cache, logits="all")
    assert (served.logits - two.logits).abs().max() < TOL
    assert served.cache.hidden_in == full and served.info["hide_translated"] == GLOBAL
    plain = relay_prefill(receiver, state, art, suffix, **kw)
    assert (served.logits - plain.logits).abs().max() > 1e-4  # the hiding did something
    if len(full) == receiver.spec.num_layers:
        every = relay_prefill(receiver, state, art, suffix, hide_translated=receiver.spec.num_layers, **kw)
        assert torch.equal(served.logits, every.logits)
