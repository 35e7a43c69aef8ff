"""Which layers keep translated entries from the question and the answer (relay_prefill's hide_translated).

A hiding is a layer count k (the receiver's first k layers, as calibrated since 2026-12-02) or
"global": the receiver's full-attention layers only, those without a sliding window (gemma3: 3 of
18; a receiver with no sliding windows has only full-attention layers, so there it hides every
layer). Why "global": into gemma3 the question reaches facts more than a window back only through
its full-attention layers, where thousands of translated entries compete with the recomputed fact,
while its sliding-window layers need the translated neighbourhood (hiding the first 6, 12 or 18
layers lost facts the unhidden relay kept). Probe, smollm2 -> gemma3 at 4096 tokens, f = 0.15 mix,
the 24 needle questions of frontier seed 500: 15 answered unhidden, 20 hiding only layers 5, 11 and 17
(native 20), essays top-1 0.878 -> 0.875, ShareGPT ppl x1.55 -> x1.60.

Values travel through artifacts, results files and `--set` options as JSON: 0 (none), an int, or the
string "global"; `hide_code` is the one parser.
"""

from __future__ import annotations

import torch

from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel, ModelSpec

GLOBAL = "global"
Hide = int | str


def hide_code(value: object) -> Hide:
    """A hiding as stored and compared: 0, a positive layer count, or "global" (from JSON, a `--set`
    string or a settings key). Anything else is refused with what to write instead."""
    if value is None or value == "":
        return 0
    if isinstance(value, str) and value.strip().lower() == GLOBAL:
        return GLOBAL
    try:
        k = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise UsageError(f"hide_translated must be a layer count or {GLOBAL!r}, not {value!r}") from None
    if k < 0:
        raise UsageError(f"hide_translated must be a layer count >= 0 or {GLOBAL!r}, not {k}")
    return k


def hide_label(hide: object) -> str:
    """ "hide12" / "hideglobal" in point labels and settings keys; "" where nothing is hidden."""
    code = hide_code(hide)
    return f"hide{code}" if code else ""


def hide_order(hide: object) -> tuple[int, int]:
    """A sort key: no hiding, then layer counts, then global."""
    code = hide_code(hide)
    return (1, 0) if code == GLOBAL else (0, int(code))


def hide_last(setting: tuple) -> tuple:
    """A sort key for a tuple whose last item is a hiding ((f, tokens, hide), (tokens, hide), ...): ints
    and "global" do not compare, so the hiding sorts by hide_order."""
    return (*setting[:-1], hide_order(setting[-1]))


def point_label(f: float, rule: str, hide: object = 0) -> str:
    """An operating point's label, as the artifact names it and gate replays print it: "f=0.12 mix",
    "f=0.12 mix hideglobal"."""
    label = hide_label(hide)
    return f"f={f:.2f} {rule}" + (f" {label}" if label else "")


def hidden_layers(spec: ModelSpec, hide: object, first: int = 0) -> frozenset[int]:
    """The receiver layers whose question and answer rows skip translated entries. `first`: the layers
    below it hold the receiver's own entries (nothing translated to hide)."""
    code = hide_code(hide)
    n = spec.num_layers
    if code == GLOBAL:
        return frozenset(i for i in range(max(0, first), n) if spec.sliding_windows[i] is None)
    if code > n:
        raise UsageError(f"hide_translated must be a layer count in 0..{n} for {spec.name}, or {GLOBAL!r}; got {code}")
    return frozenset(range(max(0, first), code))


@torch.inference_mode()
def hiding_gap(m: LoadedModel, cache: KVCache, first_id: torch.Tensor, served: torch.Tensor, translated: torch.Tensor,
               hide: object, first: int = 0) -> float:  # fmt: skip
    """Total variation between the receiver's next-token distributions after the suffix's first token as
    served (`served`: its hidden row [1, 1, D], the translated entries hidden as the point hides) and
    with the other hiding: none where the point hides, every layer from `first` (the receiver's own
    layers hide nothing) where it does not. A request whose
    answer leans on what the translated entries say moves when they are hidden. Measured: a probe
    (scripts/hide_gap_probe.py, smollm2 -> gemma3 at 2048, f = 0.2 hiding 12, 18 texts) ranked per-text
    top-1 agreement at Spearman -0.91, but the recompute stage's 24 texts per f at the same point at -0.45,
    and at f = 0.12 at +0.19 (docs/notebook.md): a candidate like the others, not a trusted estimate. Cost:
    one one-token pass over the receiver's weights and two LM-head rows; the cache (entries, length,
    hiding) is left as it was."""
    t = translated.numel()
    held = cache.length, cache.hidden, cache.hidden_in
    saved = [
        (cache.keys[j][:, :, t : t + 1].clone(), cache.values[j][:, :, t : t + 1].clone())
        for j in range(m.spec.num_layers)
    ]
    try:
        cache.length = t
        cache.hide(translated, frozenset() if hide_code(hide) else hidden_layers(m.spec, m.spec.num_layers, first))
        other = runner.forward(m, first_id.view(1), cache, logits="none").hidden[:, -1:]
    finally:
        for j, (k, v) in enumerate(saved):
            cache.write(j, slice(t, t + 1), k, v)
        cache.length, cache.hidden, cache.hidden_in = held
    p = torch.softmax(runner.head(m, torch.cat([served, other], 1), "all").float(), -1)
    return float(0.5 * (p[0] - p[1]).abs().sum())
