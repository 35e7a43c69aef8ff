"""Probe: does a soft version of hiding keep more facts than hiding or not hiding?

    python scripts/soft_hiding_probe.py SENDER RECEIVER F BIASES [CASES] [TOKENS]
    e.g. python scripts/soft_hiding_probe.py qwen2.5-coder-1.5b gemma3-270m 0.2 0,-1,-2 "" 4096

Hiding (`KVCache.hide`) keeps the question from the translated entries of the context: a bias of -inf on
their attention scores. Here the bias is b (BIASES, a comma list; 0 is no hiding, -inf hides in every
layer), in every layer of the receiver. The attention mask is replaced in this process only. The cases
are the fact stage's own (`facts.calibration_cases`, 24 at TOKENS, default 4096; CASES: a comma list of
case numbers, empty for all), relayed with the shipped artifact at recompute fraction F (rule mix) and
answered greedily (24 tokens, score_answer). Prints one JSON line per case, then facts kept per bias.
Not a timing run.
"""

import json
import math
import sys
from dataclasses import replace

import torch

from ctxrelay import paths, zoo
from ctxrelay.artifact import Artifact
from ctxrelay.data.needle import score_answer
from ctxrelay.models import attention, runner
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.transports.heterofold import facts
from ctxrelay.transports.heterofold.transfer import relay_prefill

BIAS: dict[str, float | None] = {"b": None}
_call_mask = attention.call_mask


def soft_mask(c: attention.AttnCall, rows: slice | None = None, keys: tuple[int, int] | None = None) -> torch.Tensor:
    """call_mask, as native_attention asks it per chunk of query rows, with the keys the key mask leaves out
    given the additive bias BIAS["b"] instead of -inf (SDPA takes a float mask as added scores)."""
    visible = _call_mask(c, rows, keys)
    b = BIAS["b"]
    if b is None or c.key_mask is None or c.softcap is not None:  # eager attention needs the bool mask
        return visible
    allowed = _call_mask(replace(c, key_mask=None), rows, keys)  # causal and window only
    return (
        torch.zeros(visible.shape, dtype=c.q.dtype)
        .masked_fill_(allowed & ~visible, b)
        .masked_fill_(~allowed, -math.inf)
    )


@torch.inference_mode()
def main() -> None:
    sender_name, receiver_name, f = sys.argv[1], sys.argv[2], float(sys.argv[3])
    biases = [float(b) for b in sys.argv[4].split(",")]
    chosen = {int(c) for c in sys.argv[5].split(",")} if len(sys.argv) > 5 and sys.argv[5] else None
    tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 4096
    torch.set_num_threads(2)
    attention.call_mask = soft_mask  # native_attention reads it from its module
    sender, receiver = zoo.load(sender_name), zoo.load(receiver_name)
    artifact = Artifact.load(paths.find_artifact("heterofold", sender_name, receiver_name))
    root = paths.work_dir("heterofold", "states")
    lines = []
    for i, case in enumerate(facts.calibration_cases(receiver.tokenizer, 24, tokens)):
        if chosen is not None and i not in chosen:
            continue
        inside = i % 2 == 0  # as the fact stage: the question inside the sender's context on even cases
        text = case.prompt if inside else case.context
        state = facts.sender_state(sender, text, root)
        ctx = context_ids(receiver, text)
        q = torch.zeros(0, dtype=torch.long) if inside else suffix_ids(receiver, case.question)
        BIAS["b"] = None
        if inside:
            nat = runner.forward(receiver, ctx, logits="last")
        else:
            nat = runner.forward(receiver, q, runner.forward(receiver, ctx, logits="none").cache, logits="last")
        line = {
            "case": i,
            "native_right": score_answer(facts._answer(receiver, nat.cache, nat.logits, 24), case.answer)["exact"],
        }
        for b in biases:
            hide = 0 if b == 0 else receiver.spec.num_layers
            BIAS["b"] = None if b == 0 or math.isinf(b) else b
            out = relay_prefill(
                receiver, state, artifact, q, recompute=f, selection="mix", query=case.question, hide_translated=hide
            )
            answer = facts._answer(receiver, out.cache, out.logits, 24)
            line[str(b)] = [score_answer(answer, case.answer)["exact"], answer[:40]]
        lines.append(line)
        print(json.dumps(line), flush=True)
    for b in biases:
        kept = sum(1 for x in lines if x["native_right"] and x[str(b)][0])
        print(f"bias {b}: kept {kept} of {sum(x['native_right'] for x in lines)} native answers")


if __name__ == "__main__":
    main()
