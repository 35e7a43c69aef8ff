import pytest

from ctxrelay.data.needle import NEEDLES, first_answer_line, insert_at_depth, make_needle_case, score_answer
from ctxrelay.errors import UsageError

HAY = " ".join(f"Sentence number {i} is here." for i in range(100))


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_insertion_depth_at_sentence_boundary(depth):
    case = make_needle_case(HAY, depth, seed=0)
    fact = NEEDLES[0].fact
    pos = case.context.index(fact)
    assert abs(pos / len(HAY) - depth) < 0.02  # depth is a fraction of the haystack
    assert abs(case.depth - pos / len(HAY)) < 1e-3
    # the haystack is untouched around the fact, and the fact starts and ends a sentence
    assert case.context.replace(fact, "").replace("  ", " ").strip() == HAY
    before = case.context[:pos].rstrip()
    assert before == "" or before.endswith(".")
    after = case.context[pos + len(fact) :]
    assert after == "" or after.startswith(" Sentence")


def test_insert_clamps_and_refuses_bad_depth():
    text, pos = insert_at_depth("A b. C d.", "X.", 0.0)
    assert text == "X. A b. C d." and pos == 0
    text, _ = insert_at_depth("A b. C d.", "X.", 1.0)
    assert text == "A b. C d. X."
    with pytest.raises(UsageError, match=r"\[0, 1\]"):
        make_needle_case(HAY, 1.5)
    with pytest.raises(UsageError, match="empty"):
        make_needle_case("  ", 0.5)


def test_seed_picks_fact_and_question_format():
    cases = [make_needle_case(HAY, 0.5, seed=s) for s in range(len(NEEDLES))]
    assert len({c.answer for c in cases}) == len(NEEDLES)
    c = cases[0]
    assert c.question == "\n\nQuestion: What is the secret passphrase for the Larkspur vault?\nAnswer:"
    assert c.prompt == c.context + c.question
    for n in NEEDLES:
        assert n.answer.lower() in n.fact.lower()


def test_score_answer():
    gold = "copper-heron-42"
    assert score_answer(" copper-heron-42", gold) == {"exact": 1, "f1": 1.0}
    assert score_answer(" The passphrase is 'Copper-Heron-42'.", gold)["exact"] == 1
    s = score_answer(" copper heron", gold)
    assert s["exact"] == 0 and s["f1"] == pytest.approx(0.8)  # p=2/2, r=2/3
    assert score_answer(" 4172", "4172")["exact"] == 1
    assert score_answer(" 41720", "4172") == {"exact": 0, "f1": 0.0}  # whole words only
    # only the first answer line counts: a model inventing more Q&A does not get credit
    assert score_answer(" I don't know.\nQuestion: x\nAnswer: copper-heron-42", gold)["exact"] == 0
    assert score_answer("", gold) == {"exact": 0, "f1": 0.0}


def test_answer_line_joins_a_sentence_wrapped_like_the_essays():
    # measured: gemma3-270m wraps its answers at the essays' ~70 columns
    assert score_answer(" The combination of the Delacroix safe\nis 5093.", "5093")["exact"] == 1
    assert (
        first_answer_line(" The safe and the\nDelacroix safe is 5093\nmore")
        == "The safe and the Delacroix safe is 5093 more"
    )
    # a finished sentence, a blank line or a label ends the answer
    assert score_answer(" The safe is locked.\nIt is 5093.", "5093")["exact"] == 0
    assert score_answer(" The Brambleton Choir\nQuestion: is it 5093?", "5093")["exact"] == 0
    assert score_answer(" I am not sure\n\n5093", "5093")["exact"] == 0
    assert score_answer(" See the note\n[1] 5093", "5093")["exact"] == 0
