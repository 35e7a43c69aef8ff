"""The recompute pass: the receiver's own K/V, through all its layers, for the chosen positions, written
over the translated entries (CacheBlend's mechanism, here across model families), and the cheap signals
the per-request estimate reads (estimate.py).

The recomputed tokens' queries attend by position to the cache of translated + recomputed entries
(attend="all"), or only to the recomputed ones and the sink (attend="own"). f = 0 is plain heterofold;
f = 1 recomputes every token in one pass: the receiver's native prefill exactly.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.attention import attention_logits, native_attention
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.heterofold.recompute.rules import TAIL

# candidates for the per-request estimate (recompute signals; the alignment's share of shared token ends)
SIGNALS = ("translated_attention", "tail_confidence", "tail_nll", "kv_change", "exact_share", "char_mismatch",
           "hiding_gap")  # fmt: skip


SIGNAL_LAYERS = 4  # layers, spread over the depth, whose K/V change and attention are signals


@torch.inference_mode()
def recompute(
    m: LoadedModel,
    ids: torch.Tensor,
    cache: KVCache,
    positions: torch.Tensor,
    attend: str = "all",
    signals: Collection[str] = SIGNALS,
    suffix: torch.Tensor | None = None,
    attended: torch.Tensor | None = None,
    suffix_attends: bool = True,
) -> tuple[runner.ForwardOut, dict]:
    """Overwrite the cache at `positions` with the receiver's own K/V, all layers, in one pass, and
    return cheap per-request signals of how close the result is to native (the estimate's inputs).

    attend="all": each recomputed query sees translated + recomputed entries before it;
    attend="own": only recomputed entries (and the native sink among them).
    `suffix` (ids appended after the context) runs in the same pass, its rows last in the returned
    hidden states: it sees the recomputed entries of each layer as a pass after this one would (they
    sit before it and never attend to it), so the receiver's weights are read once, not twice; entries
    the cache hides (KVCache.hide) are hidden from it, never from the recomputed queries.
    Signals: kv_change (relative change recompute made to the K/V at sampled layers), and where
    the context's last tokens were recomputed: tail_nll / tail_confidence (the receiver predicting
    them, teacher-forced) and translated_attention (the share of their attention that lands on
    translated entries, averaged over sampled layers and heads). Only the `signals` named are measured:
    tail_nll / tail_confidence need the LM head over the tail (into gemma3, a 262k vocabulary: 0.15 s,
    8% of a relay at 4096 tokens), so serving measures only what the gate acts on.
    `attended` ([t] floats, optional): adds, in every layer, the attention the context's recomputed last
    tokens (and the suffix's rows where `suffix_attends`: a question, not a teacher-forced continuation)
    give each context position, summed over heads and rows (second_pass_positions reads it)."""
    if attend not in ("all", "own"):
        raise UsageError(f"recompute attend must be 'all' or 'own', not {attend!r}")
    t, n = ids.shape[0], positions.numel()
    extra = 0 if suffix is None else suffix.numel()
    own = torch.zeros(t + extra, dtype=torch.bool)
    own[positions] = True
    own[t:] = True  # the suffix's own entries
    key_mask = own if attend == "own" else None
    if key_mask is not None and extra:  # the suffix sees every entry; only the recomputed queries are kept to their own
        key_mask = torch.cat([own.expand(n, -1), torch.ones(extra, t + extra, dtype=torch.bool)])
    layers = sorted({round(i * (m.spec.num_layers - 1) / max(1, SIGNAL_LAYERS - 1)) for i in range(SIGNAL_LAYERS)})
    kept = layers if "kv_change" in signals else []
    before = {j: (cache.keys[j][:, :, positions].clone(), cache.values[j][:, :, positions].clone()) for j in kept}
    run = 0  # how many of the context's last tokens were recomputed, in a row
    while run < min(TAIL + 1, t) and bool(own[t - 1 - run]):
        run += 1
    mass: list[float] = []
    tail_signal = run >= 2 and "translated_attention" in signals
    rows = slice(n - run, n + (extra if attended is not None and suffix_attends else 0))

    def watch(c):
        if attended is None and not tail_signal:
            return native_attention(c)
        p = torch.softmax(attention_logits(c, rows if attended is not None else slice(n - run, n)).float(), -1)
        if tail_signal and c.layer in layers:  # p[:, :run]: [H, run, S], the context's last tokens
            mass.append(float(p[:, :run][..., ~own[: p.shape[-1]]].sum(-1).mean()))
        if attended is not None:
            attended.add_(p[..., :t].sum((0, 1)))
        return native_attention(c)

    watching = range(m.spec.num_layers) if attended is not None else layers if tail_signal else ()
    watched = dict.fromkeys(watching, watch) or None
    run_ids, run_pos = ids[positions], positions
    if extra:
        run_ids, run_pos = torch.cat([run_ids, suffix]), torch.cat([positions, torch.arange(t, t + extra)])
    out = runner.forward(m, run_ids, cache, positions=run_pos, key_mask=key_mask, attention=watched, logits="none")
    measured: dict = {}
    change = []
    for j, (k0, v0) in before.items():
        k1, v1 = cache.keys[j][:, :, positions], cache.values[j][:, :, positions]
        change.append(float(((k1 - k0).norm() + (v1 - v0).norm()) / (k1.norm() + v1.norm()).clamp_min(1e-9)))
    if change:
        measured["kv_change"] = sum(change) / len(change)
    if run >= 2 and {"tail_nll", "tail_confidence"} & set(signals):
        tail = torch.arange(t - run, t - 1)  # each predicts the next context token
        lp = torch.log_softmax(runner.head(m, out.hidden[:, torch.searchsorted(positions, tail)], "all").float(), -1)
        measured["tail_nll"] = float(-lp.gather(1, ids[tail + 1][:, None]).mean())
        measured["tail_confidence"] = float(lp.max(-1).values.exp().mean())
    if mass:
        measured["translated_attention"] = sum(mass) / len(mass)
    return out, {k: v for k, v in measured.items() if k in signals}


def second_pass_positions(attended: torch.Tensor, translated: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` translated positions the first pass's queries attended to most (sorted): a translated
    entry the recomputed tokens lean on and native gives no weight bends them (into smollm2 such entries
    drew its answers towards ending the text), so the second pass makes it the receiver's own."""
    score = attended.masked_fill(~translated, -1.0)
    k = min(int(budget), int(translated.sum()))
    if k <= 0:
        return torch.zeros(0, dtype=torch.long)
    top = torch.topk(score, k).indices
    return top[score[top] > 0].sort().values
