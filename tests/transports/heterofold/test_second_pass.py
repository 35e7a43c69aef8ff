"""heterofold's mix2 rule: a second recompute pass over the translated entries the first pass's queries leaned
on most."""

import pytest
import torch
from test_recompute import CONTEXT, PAIRS, QUESTION, TOL

from conftest import zero_artifact
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.transports.heterofold import relay_prefill
from ctxrelay.transports.heterofold.recompute.recompute_pass import second_pass_positions
from ctxrelay.transports.heterofold.recompute.rules import SECOND_SHARE


def _case(tiny_by_family, s: str, r: str):
    """(receiver, sender state of CONTEXT, QUESTION's ids, the zero artifact: only recompute fixes anything)."""
    sender, receiver = tiny_by_family[s], tiny_by_family[r]
    state, art = capture_state(sender, CONTEXT, "t"), zero_artifact(sender, receiver)
    return receiver, state, suffix_ids(receiver, QUESTION), art


def _translated_rows(cache, n: int) -> int:
    """Context positions whose last-layer keys are still the zero artifact's translation (all zeros)."""
    return int((cache.keys[-1][0, :, :n].abs().sum((0, 2)) == 0).sum())


@pytest.mark.parametrize(("s", "r"), PAIRS)
def test_a_second_pass_after_recomputing_everything_is_still_native_prefill(tiny_by_family, s, r):
    receiver, state, suffix, art = _case(tiny_by_family, s, r)
    native = runner.forward(receiver, torch.cat([context_ids(receiver, CONTEXT), suffix]), logits="all")
    out = relay_prefill(receiver, state, art, suffix, logits="all", recompute=1.0, selection="mix2")
    assert out.info["recompute_fraction"] == 1.0 and "second_pass" not in out.info
    assert (out.logits - native.logits[-len(suffix) :]).abs().max() < TOL


@pytest.mark.parametrize(("s", "r"), PAIRS)
@pytest.mark.parametrize("hide", [0, 2])
def test_the_second_pass_makes_its_share_of_translated_entries_the_receivers_own(tiny_by_family, s, r, hide):
    receiver, state, suffix, art = _case(tiny_by_family, s, r)
    n = context_ids(receiver, CONTEXT).numel()
    f = 0.5
    one = relay_prefill(receiver, state, art, suffix, logits="all", recompute=f * (1 - SECOND_SHARE),
                        hide_translated=hide)  # fmt: skip
    two = relay_prefill(receiver, state, art, suffix, logits="all", recompute=f, selection="mix2", hide_translated=hide)
    # the first pass is mix over its share; every translated entry draws some attention from the last tokens,
    # so the second pass spends the rest of the budget
    assert two.info["second_pass"] == round(f * n) - round(f * (1 - SECOND_SHARE) * n) > 0
    assert _translated_rows(one.cache, n) - _translated_rows(two.cache, n) == two.info["second_pass"]
    assert two.info["recompute_fraction"] == pytest.approx(one.info["recompute_fraction"] + two.info["second_pass"] / n)
    assert (two.logits - one.logits).abs().max() > 0  # the pass changed what the question sees
    if hide:  # what the second pass recomputed is no longer hidden from the question
        assert int(two.cache.hidden.sum()) == _translated_rows(two.cache, n)
    assert {"translate_s", "select_s", "recompute_s", "first_token_s"} <= set(two.timings)


def test_a_teacher_forced_continuation_does_not_choose_what_is_recomputed(tiny_by_family):
    """With query="" (a continuation scored token by token, not a question) only the context's own last
    tokens choose the second pass: two continuations get the same positions (and a question does choose)."""
    receiver, state, _, art = _case(tiny_by_family, "llama", "gemma3")
    n = context_ids(receiver, CONTEXT).numel()
    zero_rows = []
    for text in (" The end of the story was near.", " Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14."):
        out = relay_prefill(receiver, state, art, suffix_ids(receiver, text), recompute=0.3, selection="mix2",
                            query="")  # fmt: skip
        zero_rows.append(out.cache.keys[-1][0, :, :n].abs().sum((0, 2)) == 0)
    assert torch.equal(zero_rows[0], zero_rows[1]) and out.info["second_pass"] > 0


def test_second_pass_positions_are_the_most_attended_translated_ones():
    attended = torch.tensor([5.0, 0.0, 3.0, 9.0, 1.0, 7.0])
    translated = torch.tensor([False, True, True, False, True, True])
    assert second_pass_positions(attended, translated, 2).tolist() == [2, 5]
    assert second_pass_positions(attended, translated, 10).tolist() == [2, 4, 5]  # never an unattended one
    assert second_pass_positions(attended, translated, 0).numel() == 0


def test_a_bad_fraction_for_mix2_is_a_clear_error(tiny_by_family):
    receiver, state, suffix, art = _case(tiny_by_family, "llama", "qwen2")
    with pytest.raises(UsageError, match=r"in \[0, 1\]"):
        relay_prefill(receiver, state, art, suffix, recompute=1.5, selection="mix2")
