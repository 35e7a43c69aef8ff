"""The settings a recompute or fact stage measured at: context length and hiding. A stage's entries are
keyed by Setting.key ("4096", "4096+hide12", "4096+hideglobal"); entries made before a stage kept
several settings carry none and were measured at the stage's own (stage_setting).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ctxrelay.transports.heterofold.hiding import Hide, hide_code, hide_label


class Setting(NamedTuple):
    """What a stage measured at: the context length in receiver tokens and the layers hiding translated
    entries from the question (0: none; "global": the receiver's full-attention layers)."""

    tokens: int
    hide: Hide = 0

    @property
    def key(self) -> str:
        """Its name in an artifact: "4096", or "4096+hide12" / "4096+hideglobal" where it hid."""
        label = hide_label(self.hide)
        return f"{int(self.tokens)}+{label}" if label else str(int(self.tokens))

    @classmethod
    def parse(cls, key: str) -> Setting:
        n, _, hide = key.partition("+hide")
        return cls(int(n), hide_code(hide))


def row_tokens(row: dict, default: int = 2048) -> int:
    """The context length a recompute-stage row (or table entry) was calibrated at; rows made before the
    stage ran at several lengths carry none and were made at the stage's default, 2048."""
    return int(row.get("tokens", default))


def with_setting(entries: list[dict], tokens: int, hide: Hide) -> list[dict]:
    """Stage rows or table entries (recompute or fact stage) with the context length and hiding they
    were measured at made explicit ("tokens", "hide_translated"; f = 0 never hides). Entries made
    before a stage kept several settings may carry neither: they were measured at the stage's own
    (`tokens`, `hide`: stage_setting)."""
    out = []
    for x in entries:
        h = hide_code(x.get("hide_translated", hide)) if x["f"] else 0
        rest = {k: v for k, v in x.items() if k != "hide_translated"}
        out.append({**rest, "tokens": row_tokens(x, tokens), "hide_translated": h})
    return out


def stage_setting(stage: dict | None, tokens_key: str = "recompute_tokens") -> tuple[int, Hide]:
    """(tokens, hiding) of a stage's last run: what its older entries were measured at."""
    return int((stage or {}).get(tokens_key, 2048)), hide_code((stage or {}).get("hide_layers", 0))


def serving_span(lengths: list[int], measured: list[int]) -> list[int | None]:
    """[shortest, longest) request length a point measured at `measured` (of the artifact's calibrated
    `lengths`) may serve: up to the geometric middle towards the next calibrated length it was not
    measured at (where the gate's nearest-length rule would read another length), None: unbounded."""
    lo_i, hi_i = lengths.index(min(measured)), lengths.index(max(measured))
    lo = math.isqrt(lengths[lo_i - 1] * lengths[lo_i]) + 1 if lo_i > 0 else None
    hi = math.isqrt(lengths[hi_i] * lengths[hi_i + 1]) + 1 if hi_i < len(lengths) - 1 else None
    return [lo, hi]
