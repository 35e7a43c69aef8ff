"""heterofold jobs glue: calibration data, directions, bench options (no model runs)."""

import pytest

from ctxrelay.eval import EvalError
from ctxrelay.eval import heterofold_jobs as jobs
from ctxrelay.models.tiny import tiny_tokenizer


def test_chunks_cut_at_boundaries_and_cover_the_text():
    text = " ".join(f"Sentence number {i} ends here." + ("\n\n" if i % 5 == 4 else "") for i in range(200))
    pieces = jobs.chunk(text, 500)
    assert all(250 <= len(p) <= 500 for p in pieces)
    assert all(p.endswith(".") for p in pieces)  # paragraph or sentence ends, never mid-word
    assert sum(len(p) for p in pieces) > 0.9 * len(text) - 500


def test_calibration_texts_are_split_by_the_datasets_splits():
    train, held = jobs.calibration_texts(
        {"chunk_chars": 1500, "essay_chunks": 6, "conversations": 3, "heldout_essays": 2, "heldout_convs": 2}
    )
    assert len(train) == 9 and len(held) == 4
    assert not set(train) & set(held)
    assert all(len(t) > 700 for t in train + held)


def test_directions_and_options():
    assert len(jobs._directions("", "")) == 8
    assert jobs._directions("smollm2-135m", "gemma3-270m,smollm2-135m") == [("smollm2-135m", "gemma3-270m")]
    with pytest.raises(EvalError, match="different"):
        jobs._directions("smollm2-135m", "smollm2-135m")
    with pytest.raises(EvalError, match="unknown heterofold bench option"):
        jobs._bench_options({"lenghts": 3})
    with pytest.raises(EvalError, match="method"):
        jobs._bench_options({"methods": "ridge"})


def test_bench_cases_cut_contexts_at_token_counts():
    tok = tiny_tokenizer("bytelevel")
    cases = jobs.bench_cases(tok, [64, 128], ["essays", "sharegpt"], continuation=40, seed=0)
    assert [(c.length, c.dataset) for c in cases] == [
        (64, "essays"),
        (64, "sharegpt"),
        (128, "essays"),
        (128, "sharegpt"),
    ]
    for c in cases:
        assert c.answer and c.question.startswith("\n\nQuestion:")
        n_ctx = len(tok(c.context, add_special_tokens=False)["input_ids"])
        assert c.length < n_ctx <= c.length + 80  # the needle fact adds one sentence
        assert len(tok(c.continuation, add_special_tokens=False)["input_ids"]) >= 40
