"""The faithful mode's fact-recall stage: does the relay keep the facts the receiver would answer?

Top-1 agreement over a continuation (fractions.py) measures the gist; a needle answer depends on a few
tokens of one sentence, and a relay can agree on 86% of next tokens yet lose the fact (measured: into
smollm2-135m, mix at f = 0.2 passes top-1 0.85 and answers 0 of 8 held-out needles that native
answers 3 of). So the gate also needs, per operating point, how often the relayed receiver answers a
question right where its own native prefill answers it right.

On calibration-only facts (data.needle.CALIBRATION_NEEDLES, never asked by the benchmarks or the
demo) hidden in training-split essays at three depths: the sender reads the context, with the
question inside it on even cases (the demo's way: the sender read everything) and without it on odd
ones (a new turn appended as the receiver's suffix); the receiver answers natively and relayed at
every fraction f; answers are greedy, scored with score_answer. Per f, context length and hiding the
artifact records
  quality["facts"]: [{"f", "selection", "tokens", "hide_translated", "cases", "native_right", "kept",
                      "fact_recall"}]
with fact_recall = kept / native_right (None where native answered none). Runs at other lengths or with
other hiding add entries beside these (job.py, the facts stage); the gate reads the entry of each
point's own hiding at the length nearest the request (points.facts_at).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay.artifact import Artifact
from ctxrelay.data.datasets import essay_haystack
from ctxrelay.data.needle import CALIBRATION_NEEDLES, make_needle_case, score_answer
from ctxrelay.models import runner
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.state import Binding, ContextState
from ctxrelay.transports.heterofold.calibration import text_cache
from ctxrelay.transports.heterofold.hiding import Hide
from ctxrelay.transports.heterofold.transfer import relay_prefill

DEPTHS = (0.2, 0.5, 0.8)


def calibration_cases(tokenizer, n: int, tokens: int) -> list:
    """`n` needle cases of about `tokens` receiver tokens over training-split essays."""
    cases = []
    for i in range(n):
        hay = essay_haystack(tokenizer, tokens - 24, split="train", seed=11 * i + 5)  # room for the fact
        cases.append(make_needle_case(hay, DEPTHS[i % 3], seed=i, paraphrase=i % 4 >= 2, facts=CALIBRATION_NEEDLES))
    return cases


def sender_state(sender: LoadedModel, text: str, root: Path) -> ContextState:
    """The sender's state of `text` from the calibration cache (a prefill of the 1.5B is ~10 s)."""
    st = text_cache.sender_text(sender, text, root)
    return ContextState(
        text=text,
        tokens=st.ids,
        offsets=st.offsets,
        binding=Binding.of(sender, "calibration"),
        keys_pre_rope=st.keys.float(),
        values=st.values.float(),
        meta={"sender": sender.spec.name},
    )


def _answer(m: LoadedModel, cache, logits: torch.Tensor, new_tokens: int) -> str:
    return runner.decode(m, cache, logits[-1], time.perf_counter(), new_tokens).text


@torch.inference_mode()
def calibrate_facts(
    sender: LoadedModel,
    receiver: LoadedModel,
    artifact: Artifact,
    fractions: list[float],
    rule: str,
    *,
    cases: int,
    tokens: int,
    new_tokens: int,
    root: Path,
    hide: Hide = 0,
) -> dict:
    """{"facts": [...per f...], "rows": [...per case and f...]} (module docstring)."""
    rows = []
    for i, case in enumerate(tqdm(calibration_cases(receiver.tokenizer, cases, tokens), desc="fact cases")):
        inside = i % 2 == 0  # the question inside the sender's context, else appended by the receiver
        text = case.prompt if inside else case.context
        state = sender_state(sender, text, root)
        ctx = context_ids(receiver, text)
        q = torch.zeros(0, dtype=torch.long) if inside else suffix_ids(receiver, case.question)
        if inside:  # native: the last context token gives the first answer token, as relay_prefill does
            nat = runner.forward(receiver, ctx, logits="last")
        else:
            nat = runner.forward(receiver, q, runner.forward(receiver, ctx, logits="none").cache, logits="last")
        native = _answer(receiver, nat.cache, nat.logits, new_tokens)
        native_right = score_answer(native, case.answer)["exact"]
        for f in fractions:
            kw = {"recompute": f, "selection": rule, "query": case.question, "hide_translated": hide if f else 0}
            out = relay_prefill(receiver, state, artifact, q, **kw)
            answer = _answer(receiver, out.cache, out.logits, new_tokens)
            rows.append({"case": i, "f": f, "tokens": tokens, "hide_translated": hide if f else 0,
                         "question_inside": inside, "native_right": native_right,
                         "relay_right": score_answer(answer, case.answer)["exact"], "answer": answer,
                         "native_answer": native})  # fmt: skip
    return {"facts": fact_table(rows, rule, hide, tokens), "rows": rows}


def fact_table(rows: list[dict], rule: str, hide: Hide = 0, tokens: int = 2048) -> list[dict]:
    """Per f: cases, native right, kept; f = 0 (plain translation) never hides."""
    table = []
    for f in sorted({r["f"] for r in rows}):
        part = [r for r in rows if r["f"] == f]
        right = sum(r["native_right"] for r in part)
        kept = sum(r["native_right"] and r["relay_right"] for r in part)
        table.append({"f": f, "selection": rule, "tokens": tokens, "hide_translated": hide if f else 0,
                      "cases": len(part), "native_right": right, "kept": kept,
                      "fact_recall": kept / right if right else None})  # fmt: skip
    return table
