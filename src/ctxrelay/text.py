"""Plain-text helpers shared by the data sets and the transports: sentences and content words."""

from __future__ import annotations

import re

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
