"""Probe: top-1 agreement / KL vs native when the appended span skips translated entries in the receiver's
first k layers (relay_prefill(..., hide_translated=k)), at fractions f of mix, on training-split texts.

    python scripts/hide_probe.py SENDER RECEIVER ESSAYS CONVS TOKENS F1,F2 K1,K2,... [OUT.json]

Sender states are cached (bench/states.py); one row per text, f and k is printed as it comes and the
means per (f, k) at the end; OUT.json gets the rows and the means.
"""

import json
import sys
import time

import torch

from ctxrelay import zoo
from ctxrelay.artifact import Artifact
from ctxrelay.bench.states import cached_sender_states
from ctxrelay.data.datasets import conversation_haystack, essay_haystack
from ctxrelay.metrics import position_agreement, position_kl
from ctxrelay.models import runner
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.state import ContextState
from ctxrelay.transports.heterofold.calib_data import find_artifact
from ctxrelay.transports.heterofold.quality import split_text
from ctxrelay.transports.heterofold.transfer import relay_prefill

SUFFIX = 129


def main(sender: str, receiver: str, essays: int, convs: int, tokens: int, fs: str, ks: str, out: str = "") -> None:
    torch.set_num_threads(2)
    fractions, hides = [float(x) for x in fs.split(",")], [int(x) for x in ks.split(",")]
    tok = zoo.tokenizer(receiver)
    texts = [essay_haystack(tok, tokens + SUFFIX + 8, split="train", seed=3 * i + 1) for i in range(essays)]
    texts += [conversation_haystack(tok, tokens + SUFFIX + 8, split="train", seed=5 * i + 2) for i in range(convs)]
    r = zoo.load(receiver)
    pairs = [split_text(r, t, SUFFIX) for t in texts]
    states = cached_sender_states(sender, [c for c, _ in pairs])
    art = Artifact.load(find_artifact(sender, receiver))
    rows = []
    for i, ((ctx, rest), path) in enumerate(zip(pairs, states, strict=True)):
        state, suf = ContextState.load(path), suffix_ids(r, rest)
        full = torch.cat([context_ids(r, ctx), suf])
        native = runner.forward(r, full, logits="all").logits[-len(suf) : -1]
        for f in fractions:
            for k in hides:
                t0 = time.perf_counter()
                o = relay_prefill(r, state, art, suf, logits="all", recompute=f, query="", hide_translated=k)
                row = {"text": i, "conversation": i >= essays, "f": f, "hide": k,
                       "top1": float(position_agreement(native, o.logits[:-1]).mean()),
                       "kl": float(position_kl(native, o.logits[:-1]).mean())}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), f"{time.perf_counter() - t0:.1f} s", flush=True)
    doc = results(rows, sender, receiver, tokens, "python scripts/hide_probe.py " + " ".join(sys.argv[1:]))
    for x in doc["rows"]:
        f, k = x["recompute_fraction"], x["hide_translated"]
        print(f"f={f} hide={k}: top-1 {x['top1_agreement']:.3f} KL {x['kl']:.3f}")
    if out:
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)


def results(rows: list[dict], sender: str, receiver: str, tokens: int, command: str) -> dict:
    """The results schema (DESIGN.md section 5): one row per (f, k), means over the texts; per-text rows beside."""
    from ctxrelay.bench.results import machine_facts

    means = []
    for f, k in sorted({(x["f"], x["hide"]) for x in rows}):
        part = [x for x in rows if x["f"] == f and x["hide"] == k]
        means.append({"transport": "heterofold", "method": f"mix f={f} hide={k}", "sender": sender,
                      "receiver": receiver, "context_tokens": tokens, "recompute_fraction": f, "selection": "mix",
                      "hide_translated": k, "texts": len(part),
                      "top1_agreement": sum(x["top1"] for x in part) / len(part),
                      "kl": sum(x["kl"] for x in part) / len(part)})  # fmt: skip
    return {"command": command, "machine": machine_facts(), "rows": means, "per_text": rows}


if __name__ == "__main__":
    main(*sys.argv[1:3], *map(int, sys.argv[3:6]), *sys.argv[6:9])
