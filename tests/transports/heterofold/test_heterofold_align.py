"""Token alignment by shared character-end boundaries (TA) and layer alignment."""

import os

import numpy as np
import pytest
import torch

from ctxrelay.models.tiny import tiny_tokenizer
from ctxrelay.transports.heterofold.align import align_ids, align_tokens, layer_sources, special_ids_of

CASES = {
    "whitespace": "Hello  world!!   three   spaces\t\ttabs\n\n\nnewlines  \n end",
    "punctuation": "Wait... what?! (Really) -- yes; no: 'quoted' \"double\" [x]{y}<z> a/b\\c",
    "digits": "In 2024, 3.14159 people paid $1,234.56 for 42 items -- 7% more than 20231231.",
    "accents": "Café naïve résumé façade jalapeño Ångström Zürich œuvre déjà vu",
    "cjk": "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "emoji": "Launch 🚀🚀 done 🙂 family 👨‍👩‍👧 flags 🇫🇷 and ✨sparkles✨",
    "code": "def forward(self, x):\n    return self.proj(x) + 1  # residual\n\nif __name__ == '__main__':\n\tmain()",
    "merge_split": "(x) ):\n    foo_bar.baz() => x+=1; i++ ... !== ===",
}


def _ends_k(ends: list[int]) -> list[tuple[int, int]]:
    """(end, pieces still to come with the same end) for every token, written out plainly."""
    out = []
    for i, e in enumerate(ends):
        k = 0
        while i + k + 1 < len(ends) and ends[i + k + 1] == e:
            k += 1
        out.append((e, k))
    return out


def oracle(r_off, s_off, r_special, s_special) -> list[int]:
    """The rule as the paper states it, one token at a time (no vectorisation)."""
    rb = _ends_k([int(e) for _, e in r_off.tolist()])
    sb = _ends_k([int(e) for _, e in s_off.tolist()])
    sender_at = {b: i for i, b in enumerate(sb) if i > 0 and not s_special[i]}
    src, last_shared = [], None
    for i, b in enumerate(rb):
        if b in sender_at:
            last_shared = sender_at[b]
        src.append(-1 if i == 0 or r_special[i] or last_shared is None else last_shared)
    return src


def _enc(tok, text):
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=True)
    ids = torch.tensor(enc["input_ids"])
    offs = torch.tensor(enc["offset_mapping"]).view(-1, 2)
    return ids, offs


def _check_pair(recv_tok, send_tok, text):
    r_ids, r_off = _enc(recv_tok, text)
    s_ids, s_off = _enc(send_tok, text)
    al = align_ids(r_ids, r_off, special_ids_of(recv_tok), s_ids, s_off, special_ids_of(send_tok))
    from ctxrelay.transports.heterofold.align import special_mask

    r_sp = special_mask(r_ids, r_off, special_ids_of(recv_tok))
    s_sp = special_mask(s_ids, s_off, special_ids_of(send_tok))
    assert al.src.tolist() == oracle(r_off, s_off, r_sp, s_sp)
    src = al.src.numpy()
    done = src >= 0
    assert 0 in al.native and not done[r_sp].any()
    # never reads ahead: the source ends at or before the receiver token's end
    assert (s_off[src[done], 1].numpy() <= r_off[done, 1].numpy()).all()
    assert (np.diff(src[done]) >= 0).all()  # monotone: forward fill, never a jump back
    assert not s_sp[src[done]].any() and (src[done] > 0).all()  # sender sinks are never sources
    return al


@pytest.mark.parametrize("case", list(CASES))
def test_ta_matches_rule_on_tiny_tokenizers(case):
    byte, meta = tiny_tokenizer("bytelevel"), tiny_tokenizer("metaspace")
    for recv, send in ((byte, meta), (meta, byte)):
        al = _check_pair(recv, send, CASES[case])
        assert al.exact > 0


def test_self_alignment_is_identity_even_for_byte_pieces():
    tok = tiny_tokenizer("bytelevel")
    text = CASES["emoji"] + CASES["cjk"]
    ids, offs = _enc(tok, text)
    sp = special_ids_of(tok)
    al = align_ids(ids, offs, sp, ids, offs, sp)
    assert al.native == [0]
    assert al.src[1:].tolist() == list(range(1, len(ids)))


def test_forward_fill_and_many_to_one_by_hand():
    # text "ab cd": receiver tokens end at 1, 2, 5; sender tokens end at 2, 3, 5 (sender token 0 = sink)
    r_off = torch.tensor([[0, 1], [1, 2], [2, 5]])
    s_off = torch.tensor([[0, 0], [0, 2], [2, 3], [3, 5]])  # a BOS, then "ab", " ", "cd"
    s_sp = np.array([True, False, False, False])
    al = align_tokens(r_off, s_off, np.zeros(3, bool), s_sp)
    # r0 is the sink; r1 ("b", end 2) pairs with sender "ab" (many-to-one: the token AT the boundary)
    # r2 (end 5) pairs with sender "cd"
    assert al.src.tolist() == [-1, 1, 3]
    # receiver ends 1, 3, 4, 5 vs sender ends 3, 5: end 4 is no sender boundary -> forward fill to end 3
    r_off = torch.tensor([[0, 1], [1, 3], [3, 4], [4, 5]])
    s_off = torch.tensor([[0, 0], [0, 3], [3, 5]])
    al = align_tokens(r_off, s_off, np.zeros(4, bool), np.array([True, False, False]))
    assert al.src.tolist() == [-1, 1, 1, 2]
    assert al.exact == 2


def test_no_preceding_boundary_is_computed_natively():
    # receiver tokens end at 1, 2 before the sender's first boundary at 3: both native
    r_off = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 6]])
    s_off = torch.tensor([[0, 0], [0, 3], [3, 6]])
    al = align_tokens(r_off, s_off, np.zeros(4, bool), np.array([True, False, False]))
    assert al.src.tolist() == [-1, -1, 1, 2] and al.native == [0, 1]


def test_same_index_drifts_where_ta_does_not():
    byte, meta = tiny_tokenizer("bytelevel"), tiny_tokenizer("metaspace")
    text = " ".join(CASES.values()) * 3
    r_ids, r_off = _enc(meta, text)
    s_ids, s_off = _enc(byte, text)
    args = (r_ids, r_off, special_ids_of(meta), s_ids, s_off, special_ids_of(byte))
    ta, same = align_ids(*args, pairing="ta"), align_ids(*args, pairing="same-index")
    assert ta.char_mismatch < 2.0
    assert same.char_mismatch > 10 * max(ta.char_mismatch, 1.0)
    with pytest.raises(ValueError, match="pairing"):
        align_ids(*args, pairing="nearest")


def test_layer_sources_proportional_with_offsets():
    src = layer_sources(30, 18)
    assert len(src) == 18 and src[0] == [0, 0, 4] and src[-1] == [25, 29, 29]
    assert src[9] == [11, 15, 19]  # round(9 * 29 / 17) = round(15.35) = 15
    assert all(0 <= x < 30 for s in src for x in s)
    assert layer_sources(24, 24)[10] == [6, 10, 14]


def _zoo_tokenizer(name):
    from transformers import AutoTokenizer

    from ctxrelay import zoo

    path = zoo.model_dir(name)
    if not path.exists():
        pytest.skip(f"{name} is not in the zoo cache; run `ctxrelay zoo pull {name}`")
    return AutoTokenizer.from_pretrained(os.fspath(path))


REAL = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]


@pytest.mark.real
def test_ta_on_zoo_tokenizers_all_directions():
    toks = {n: _zoo_tokenizer(n) for n in REAL}
    for recv in REAL:
        for send in REAL:
            for text in CASES.values():
                _check_pair(toks[recv], toks[send], text)


@pytest.mark.real
def test_ta_zoo_cases_by_hand():
    smol, gemma, qwen = (_zoo_tokenizer(n) for n in REAL)
    text = "Hello  world 東京 f(x):\n    return"

    def pairs(recv, send):
        r_ids, r_off = _enc(recv, text)
        s_ids, s_off = _enc(send, text)
        al = align_ids(r_ids, r_off, special_ids_of(recv), s_ids, s_off, special_ids_of(send))
        r_tok = recv.convert_ids_to_tokens(r_ids.tolist())
        s_tok = send.convert_ids_to_tokens(s_ids.tolist())
        return [(r, None if s < 0 else s_tok[s]) for r, s in zip(r_tok, al.src.tolist(), strict=True)]

    # gemma <- smollm2 (no BOS: its first token "Hello" is its sink, never a source): BOS, "Hello" and
    # "▁▁" (char 7, no shared boundary before it) are computed natively; "▁東京" pairs with smollm2's LAST
    # byte piece of 京; "\n" and "▁▁▁▁" end where smollm2 has no boundary -> forward fill to "):"
    assert pairs(gemma, smol) == [
        ("<bos>", None), ("Hello", None), ("▁▁", None), ("world", "Ġworld"), ("▁東京", "¬"), ("▁f", "Ġf"),
        ("(", "("), ("x", "x"), ("):", "):"), ("\n", "):"), ("▁▁▁▁", "):"), ("return", "Ġreturn"),
    ]  # fmt: skip
    # smollm2 <- qwen: byte pieces pair piece by piece from the character's end ("Ŀ" <-> "ĠæĿ"), smollm2's
    # extra first piece forward-fills; qwen merges "(x": smollm2's "(" forward-fills to "Ġf", "x" takes "(x"
    assert pairs(smol, qwen) == [
        ("Hello", None), ("Ġ", "Ġ"), ("Ġworld", "Ġworld"), ("Ġæ", "Ġworld"), ("Ŀ", "ĠæĿ"), ("±", "±"),
        ("äº", "±"), ("¬", "äº¬"), ("Ġf", "Ġf"), ("(", "Ġf"), ("x", "(x"), ("):", "(x"), ("ĊĠĠĠ", "ĠĠĠ"),
        ("Ġreturn", "Ġreturn"),
    ]  # fmt: skip
    # qwen <- gemma (gemma has a BOS, so its "Hello" is a valid source)
    assert pairs(qwen, gemma) == [
        ("Hello", None), ("Ġ", "Hello"), ("Ġworld", "world"), ("ĠæĿ", "world"), ("±", "world"),
        ("äº¬", "▁東京"), ("Ġf", "▁f"), ("(x", "x"), ("):Ċ", "\n"), ("ĠĠĠ", "\n"), ("Ġreturn", "return"),
    ]  # fmt: skip
