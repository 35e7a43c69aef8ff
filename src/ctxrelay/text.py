"""Plain-text helpers shared by the data sets and the transports: sentences and content words; the
one check of a text a user hands in."""

from __future__ import annotations

import re

from ctxrelay.errors import UsageError

_BOUNDARY = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[0-9A-Za-z\u00c0-\uffff]+(?:['-][0-9A-Za-z\u00c0-\uffff]+)*")

# function words carry no content: a question and a sentence sharing only these are not related
_FUNCTION_WORDS = """
a about above after again against all am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just me more most
my myself no nor not now of off on once only or other our ours ourselves out over own same she
should so some such than that the their theirs them themselves then there these they this those
through to too under until up very was we were what when where which while who whom why will with
would you your yours yourself yourselves answer question user assistant
"""
STOPWORDS = frozenset(_FUNCTION_WORDS.split())


def sentence_boundaries(text: str) -> list[int]:
    """Character positions where a new sentence starts (plus 0 and len(text))."""
    cuts = {0, len(text)}
    cuts.update(m.end() for m in _BOUNDARY.finditer(text))
    return sorted(cuts)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the sentences (and lines) of `text`, in order, none empty."""
    cuts = sentence_boundaries(text)
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if text[a:b].strip()]


def content_words(text: str) -> list[str]:
    """Lower-cased words without the function words ('copper-heron-42' stays one word)."""
    return [w for w in (m.group().lower() for m in _WORD.finditer(text)) if w not in STOPWORDS]


def checked_text(text: object, what: str = "text", *, allow_empty: bool = False) -> str:
    """`text` when it is a string that encodes as UTF-8 (no lone surrogates: what invalid UTF-8
    becomes when decoded leniently) and, unless `allow_empty`, not empty; else a UsageError."""
    if not isinstance(text, str):
        raise UsageError(f"{what} must be a string, not {type(text).__name__}")
    if not text and not allow_empty:
        raise UsageError(f"{what} is empty: give the text to read")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what} is not valid UTF-8 text (character {e.start} is a lone surrogate)") from None
    return text
