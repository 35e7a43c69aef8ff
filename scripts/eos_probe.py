"""Probe: how many relayed needle answers are lost to an immediate end-of-text?

    python scripts/eos_probe.py SENDER RECEIVER TOKENS1,TOKENS2 F K1,K2,... [OUT_NAME]

On the heterofold frontier's held-out needle cases (seed 0, 8 per length, the same cases as
`ctxrelay bench heterofold-frontier`), native prefill and the relay at fraction F of mix with the
question hiding the translated entries in the receiver's first k layers, for each k: the probability
of end-of-text as the first answer token, and the answer scored as greedy decoding gives it and with
end-of-text masked at the first step only (native and relay alike). Rows print as they come;
OUT_NAME writes benchmarks/results/OUT_NAME.json.
"""

import json
import sys
import time

import torch

from ctxrelay import zoo
from ctxrelay.bench import heterofold_frontier as frontier
from ctxrelay.bench.results import write_results
from ctxrelay.bench.states import cached_sender_states
from ctxrelay.data.needle import score_answer
from ctxrelay.models import runner
from ctxrelay.models.runner import eos_ids
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.state import ContextState
from ctxrelay.transports.heterofold.transfer import relay_prefill


def answer(m, cache, logits: torch.Tensor, eos: list[int], mask: bool, tokens: int) -> tuple[str, float]:
    p_eos = float(torch.softmax(logits.float(), -1)[eos].sum())
    if mask:
        logits = logits.clone()
        logits[eos] = -float("inf")
    return runner.decode(m, cache, logits, time.perf_counter(), tokens).text, p_eos


def main(sender: str, receiver: str, lengths: list[int], f: float, hides: list[int], out: str | None) -> None:
    torch.set_num_threads(2)
    opts = {**frontier.OPTIONS, "needles": 8, "sharegpt": 0}
    cases = frontier.build_cases(frontier.ref_tokenizer(opts["ref_tokenizer"]), lengths, opts)
    states = cached_sender_states(sender, [c.context for c in cases])
    r, art = zoo.load(receiver), frontier._artifact(sender, receiver)
    eos, n_answer = list(eos_ids(r)), int(opts["answer_tokens"])
    rows = []
    for case, path in zip(cases, states, strict=True):
        state, q = ContextState.load(path), suffix_ids(r, case.question)
        row = {
            "transport": "heterofold",
            "sender": sender,
            "receiver": receiver,
            "case": case.key,
            "tokens": case.length,
            "f": f,
        }
        pre = runner.forward(r, context_ids(r, case.context), logits="none")
        qo = runner.forward(r, q, pre.cache, logits="last")
        ways = {"native": (qo.cache, qo.logits[-1])}
        for k in hides:
            o = relay_prefill(r, state, art, q, recompute=f, selection="mix", hide_translated=k)
            ways[f"relay_hide{k}"] = (o.cache, o.logits[-1])
        for mask in (False, True):  # each prefill once; each decode from its own copy of the cache
            for name, (cache, logits) in ways.items():
                text, p_eos = answer(r, cache.clone(), logits, eos, mask, n_answer)
                key = name + ("_eos_masked" if mask else "")
                row[key] = {"right": score_answer(text, case.answer)["exact"], "p_eos": p_eos, "answer": text}
        shown = {k: (v["right"], round(v["p_eos"], 3)) if isinstance(v, dict) else v for k, v in row.items()}
        print(json.dumps({k: v for k, v in shown.items() if k not in ("transport", "sender", "receiver")}))
        rows.append(row)
    ways = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    summary = []
    for n in lengths:
        part = [x for x in rows if x["tokens"] == n]
        for k in ways:
            right, p_eos = sum(x[k]["right"] for x in part), sum(x[k]["p_eos"] for x in part) / len(part)
            summary.append({"tokens": n, "way": k, "right": right, "cases": len(part), "mean_p_eos": p_eos})
            print(f"{n} {k:28s} {right}/{len(part)} right, mean p(end-of-text first) {p_eos:.3f}")
    if out:
        command = "python scripts/eos_probe.py " + " ".join(sys.argv[1:])
        path = write_results(out, rows, command, {"summary": summary, "sender": sender, "receiver": receiver})
        print(f"results written: {path}")


if __name__ == "__main__":
    a = sys.argv[1:]
    lengths, hides = [int(n) for n in a[2].split(",")], [int(k) for k in a[4].split(",")]
    main(a[0], a[1], lengths, float(a[3]), hides, a[5] if len(a) > 5 else None)
