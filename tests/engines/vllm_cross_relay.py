"""A cross-family relay served by vLLM: the sender reads an essay with a planted fact, ctxrelay translates its
state into the receiver's cache (heterofold at one recompute fraction, no hiding: vLLM's fused attention
cannot hide entries), the connector loads it, and vLLM answers the question. Run inside vLLM's venv:

    .venv-vllm/bin/python tests/engines/vllm_cross_relay.py SENDER RECEIVER OUT.json [--tokens N] [--fraction F]
        [--cases K] [--dtype float32|bfloat16]

Per case: vLLM's native answer and the relayed one (greedy, scored against the fact), and single-call times:
native `generate(max_tokens=1)` on a cold cache salt, ctxrelay's relay compute on its runner (fp32), and the
relayed `generate(max_tokens=1)` (the K/V load and the question's prefill). One process, one run; single
calls after one warm-up, so timings are indicative, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sender")
    ap.add_argument("receiver")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--cases", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--results", default="", help="also write benchmarks/results/NAME.json (machine facts, ISA)")
    args = ap.parse_args()
    from cross_pair import TENANT, CrossPair  # this folder: the scripts beside this one
    from vllm import SamplingParams
    from vllm_relay_checks import write_engine_results

    from ctxrelay.data.datasets import essay_haystack
    from ctxrelay.data.needle import first_answer_line, make_needle_case, score_answer
    from ctxrelay.engines.vllm_connector import transfer_params
    from ctxrelay.models.tokens import suffix_ids

    pair = CrossPair.load(args.sender, args.receiver)
    receiver, tenant = pair.receiver, TENANT
    cases = []
    for seed in range(args.cases):
        case = make_needle_case(essay_haystack(pair.sender.tokenizer, args.tokens, "heldout", seed), 0.5, seed)
        q = suffix_ids(receiver, case.question)
        options = {"recompute": args.fraction, "selection": "mix", "query": case.question} if args.fraction else {}
        ctx_ids, path, relay_compute_s = pair.relay(case.context, q, f"case{seed}", warm=True, **options)
        cases.append((case, ctx_ids + q.tolist(), len(ctx_ids), path, relay_compute_s))

    llm = pair.engine(args.tokens + 256, args.dtype)

    def generate(ids: list[int], n: int, kv: tuple[Path, int] | None = None) -> tuple[list[int], float]:
        extra = transfer_params(*kv, tenant) if kv else None
        sp = SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, extra_args=extra)
        t = time.perf_counter()
        got = llm.generate([{"prompt_token_ids": ids, "cache_salt": uuid.uuid4().hex}], sp, use_tqdm=False)[0]
        return list(got.outputs[0].token_ids), time.perf_counter() - t

    generate(cases[0][1], 1)  # warm-up
    rows = []
    for case, ids, n_ctx, path, relay_compute_s in cases:
        native, _ = generate(ids, args.new_tokens)
        relayed, _ = generate(ids, args.new_tokens, (path, n_ctx))
        _, native_s = generate(ids, 1)
        _, load_s = generate(ids, 1, (path, n_ctx))
        native_text = first_answer_line(receiver.tokenizer.decode(native, skip_special_tokens=True))
        relay_text = first_answer_line(receiver.tokenizer.decode(relayed, skip_special_tokens=True))
        rows.append({
            "transport": "heterofold", "engine": "vllm", "engine_mode": "eager", "precision": args.dtype,
            "sender": args.sender, "receiver": args.receiver, "context_tokens": n_ctx,
            "recompute_fraction": args.fraction, "gold": case.answer,
            "native_answer": native_text, "relay_answer": relay_text,
            "native_right": bool(score_answer(native_text, case.answer)["exact"]),
            "relay_right": bool(score_answer(relay_text, case.answer)["exact"]),
            "engine_native_ttft_s": native_s, "relay_compute_s": relay_compute_s, "engine_load_ttft_s": load_s,
            "relay_ttft_s": relay_compute_s + load_s, "speedup_vs_engine": native_s / (relay_compute_s + load_s),
        })  # fmt: skip
        print(json.dumps(rows[-1]))
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    if args.results:
        timing = "single calls after one warm-up: indicative, not a benchmark"
        write_engine_results(args.results, rows, {"timing": timing})
    return 0


if __name__ == "__main__":
    sys.exit(main())
