"""Needle QA: hide one synthetic fact in an essay haystack at a chosen depth, then ask for it.

The facts are invented (names, codes) so no model knows them from training; the question is a
plain-text suffix (no chat template) that small instruct models answer on one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ctxrelay.errors import UsageError
from ctxrelay.metrics import normalize_tokens, token_f1
from ctxrelay.text import sentence_boundaries


@dataclass(frozen=True)
class Needle:
    fact: str
    question: str
    answer: str
    paraphrase: str = ""  # the same question in other words (fewer words shared with the fact)


NEEDLES: tuple[Needle, ...] = (
    Needle(
        "The secret passphrase for the Larkspur vault is copper-heron-42.",
        "What is the secret passphrase for the Larkspur vault?",
        "copper-heron-42",
        "Which passphrase opens the Larkspur vault?",
    ),
    Needle(
        "The lighthouse keeper on Tarrow Island has a grey cat named Biscuit.",
        "What is the name of the cat of the lighthouse keeper on Tarrow Island?",
        "Biscuit",
        "What is the lighthouse keeper's cat on Tarrow Island called?",
    ),
    Needle(
        "The access code for the Wrenfield server room is 4172.",
        "What is the access code for the Wrenfield server room?",
        "4172",
        "Which code gives access to the Wrenfield server room?",
    ),
    Needle(
        "Professor Ilsa Varga's favourite fruit is the mangosteen.",
        "What is Professor Ilsa Varga's favourite fruit?",
        "mangosteen",
        "Which fruit does Professor Ilsa Varga like best?",
    ),
    Needle(
        "The ferry to Pellham Harbor leaves from pier 19.",
        "From which pier does the ferry to Pellham Harbor leave?",
        "pier 19",
        "What pier does the Pellham Harbor ferry depart from?",
    ),
    Needle(
        "The annual Quillfeather regatta is held in the town of Marrowby.",
        "In which town is the annual Quillfeather regatta held?",
        "Marrowby",
        "Where does the Quillfeather regatta take place every year?",
    ),
    Needle(
        "Dr. Maren Osei keeps her spare key under a blue ceramic frog.",
        "Where does Dr. Maren Osei keep her spare key?",
        "under a blue ceramic frog",
        "Where is Dr. Maren Osei's spare key hidden?",
    ),
    Needle(
        "The Halvorsen expedition reached the summit on the 14th of March.",
        "On what date did the Halvorsen expedition reach the summit?",
        "14th of March",
        "When did the Halvorsen expedition get to the summit?",
    ),
)

# Calibration-only facts (the gate's fact-recall stage): never in NEEDLES, so the held-out needle
# benchmarks and the demo ask about facts the calibration never saw.
CALIBRATION_NEEDLES: tuple[Needle, ...] = (
    Needle(
        "The night train to Oskarvik departs from platform 7.",
        "From which platform does the night train to Oskarvik depart?",
        "platform 7",
        "Which platform does the Oskarvik night train leave from?",
    ),
    Needle(
        "The Brambleton choir rehearses every Thursday in the old granary.",
        "Where does the Brambleton choir rehearse?",
        "the old granary",
        "In which building does the Brambleton choir practise?",
    ),
    Needle(
        "The combination of the Delacroix safe is 5093.",
        "What is the combination of the Delacroix safe?",
        "5093",
        "Which number opens the Delacroix safe?",
    ),
    Needle(
        "Captain Rhea Solberg named her sailboat the Gull's Promise.",
        "What did Captain Rhea Solberg name her sailboat?",
        "Gull's Promise",
        "What is Captain Rhea Solberg's sailboat called?",
    ),
    Needle(
        "The Fennimore library closes at half past six on Saturdays.",
        "At what time does the Fennimore library close on Saturdays?",
        "half past six",
        "When does the Fennimore library shut on Saturdays?",
    ),
    Needle(
        "The password for the Tamsin Lodge wifi is amber-falcon-77.",
        "What is the password for the Tamsin Lodge wifi?",
        "amber-falcon-77",
        "Which password unlocks the wifi at Tamsin Lodge?",
    ),
)

QUESTION_FORMAT = "\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class NeedleCase:
    context: str  # haystack with the fact inserted (the shared context a sender prefills)
    question: str  # the suffix the receiver appends: "\n\nQuestion: ...\nAnswer:"
    answer: str  # short gold answer
    depth: float  # where the fact actually starts, as a fraction of the haystack's characters
    needle: Needle

    @property
    def prompt(self) -> str:
        return self.context + self.question


def insert_at_depth(haystack: str, fact: str, depth: float) -> tuple[str, int]:
    """Insert `fact` at the sentence boundary nearest to `depth` * len(haystack).

    Returns (text, boundary): the boundary is the haystack character index where the fact went in.
    """
    if not 0.0 <= depth <= 1.0:
        raise UsageError(f"needle depth must be in [0, 1], got {depth}")
    target = depth * len(haystack)
    pos = min(sentence_boundaries(haystack), key=lambda c: (abs(c - target), c))
    before, after = haystack[:pos], haystack[pos:]
    # Keep the fact a sentence of its own whichever side of it the haystack continues.
    sep_before = "" if not before or before[-1].isspace() else " "
    sep_after = "" if not after or after[0].isspace() else " "
    return before + sep_before + fact + sep_after + after, pos


def make_needle_case(
    haystack: str, depth: float, seed: int = 0, paraphrase: bool = False, facts: tuple[Needle, ...] = NEEDLES
) -> NeedleCase:
    """One needle-QA case: fact number `seed` (mod the fact count) of `facts` inserted at `depth`; the
    question as written, or (paraphrase=True) in other words."""
    if not haystack.strip():
        raise UsageError("needle haystack is empty; build one with eval.datasets.essay_haystack")
    needle = facts[seed % len(facts)]
    context, pos = insert_at_depth(haystack, needle.fact, depth)
    return NeedleCase(
        context=context,
        question=QUESTION_FORMAT.format(question=needle.paraphrase if paraphrase else needle.question),
        answer=needle.answer,
        depth=pos / len(haystack),
        needle=needle,
    )


_SENTENCE_END = re.compile(r"[.!?:][\"')\]]*$")
_LABEL = re.compile(r"\s*(question|answer|q|a)\s*:|\s*\[\d+\]", re.IGNORECASE)


def first_answer_line(pred: str) -> str:
    """Generated text up to its first line break that ends the answer: models often go on to invent
    the next question. The essays are hard-wrapped at ~70 columns and the models wrap their answers
    the same way ("the Delacroix safe\nis 5093."), so a break inside a sentence (the line ends
    without . ! ? :, the next line is neither blank nor a "Question:" / "Answer:" / "[n]" label)
    joins the next line."""
    lines = pred.strip().split("\n")
    out = [lines[0].strip()]
    for line in lines[1:]:
        if _SENTENCE_END.search(out[-1]) or not line.strip() or _LABEL.match(line):
            break
        out.append(line.strip())
    return " ".join(out)


def score_answer(pred: str, gold: str) -> dict:
    """{"exact": 1 if the normalised gold appears as a word sequence in the answer line, "f1": ...}."""
    line = first_answer_line(pred)
    p, g = normalize_tokens(line), normalize_tokens(gold)
    exact = int(bool(g) and any(p[i : i + len(g)] == g for i in range(len(p) - len(g) + 1)))
    return {"exact": exact, "f1": token_f1(line, gold)}
