"""The cross-family relay at f = 1.0 through vLLM's connector reproduces vLLM's native prefill. Run inside
vLLM's venv:

    .venv-vllm/bin/python tests/engines/vllm_f1_exact.py SENDER RECEIVER OUT.json [--tokens N] [--cases K]
        [--positions P] [--results NAME]

Per held-out essay: the sender reads the context, heterofold builds the receiver's cache recomputing every
context token (f = 1.0, no hiding), the connector loads it, and vLLM decodes. Compared with vLLM's own
prefill of the same prompt: the first 16 greedy tokens (equal, or equal up to a bf16 tie as
vllm_relay_checks.same_greedy allows), and teacher-forced top-1 agreement over the essay's true
continuation, at P positions spread over it (one request each: ctxrelay's K/V for the context, the engine
prefills the continuation's first j tokens; vLLM skips external K/V for prompt log-prob requests, so the
continuation cannot be scored in one request). One row `f1_equals_native`, merged into NAME.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

import torch


def split_essay(tokenizer, tokens: int, seed: int, tail_tokens: int = 64) -> tuple[str, str]:
    """A held-out essay cut at a space about `tokens` tokens in: (context, continuation)."""
    from ctxrelay.data.datasets import essay_haystack

    text = essay_haystack(tokenizer, tokens + tail_tokens, "heldout", seed)
    cut = text.rfind(" ", 0, int(len(text) * tokens / (tokens + tail_tokens)))
    return text[:cut], text[cut:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sender")
    ap.add_argument("receiver")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--positions", type=int, default=8, help="teacher-forced positions per case")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--results", default="", help="also merge the row into benchmarks/results/NAME.json")
    args = ap.parse_args()
    from cross_pair import TENANT, CrossPair  # this folder: the scripts beside this one
    from vllm import SamplingParams
    from vllm_relay_checks import _gap, same_greedy, write_engine_results

    from ctxrelay.engines.vllm_connector import transfer_params

    pair = CrossPair.load(args.sender, args.receiver)
    tenant = TENANT
    cases = []
    for seed in range(args.cases):
        context, continuation = split_essay(pair.sender.tokenizer, args.tokens, 500 + seed)
        cont = pair.receiver.tokenizer(continuation, add_special_tokens=False)["input_ids"]
        ctx, path, _ = pair.relay(context, torch.tensor(cont[:1]), f"case{seed}", recompute=1.0)
        cases.append((ctx, cont, path))

    longest = max(len(c) + len(t) for c, t, _ in cases)
    llm = pair.engine(longest + args.new_tokens + 16)

    def generate(ids: list[int], n: int, salt: str, kv: tuple[Path, int] | None = None):
        extra = transfer_params(*kv, tenant) if kv else None
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=2,
                            extra_args=extra)  # fmt: skip
        got = llm.generate([{"prompt_token_ids": ids, "cache_salt": salt}], sp, use_tqdm=False)[0].outputs[0]
        return list(got.token_ids), [_gap(step) for step in got.logprobs or []]

    generate(cases[0][0], 1, "warm-up")
    greedy_ok, agree, scored, details = 0, 0, 0, []
    for i, (ctx, cont, path) in enumerate(cases):
        native_salt = uuid.uuid4().hex  # native requests of one case share it: their prefix is cached
        native, gaps = generate(ctx, args.new_tokens, native_salt)
        relayed, _ = generate(ctx, args.new_tokens, uuid.uuid4().hex, (path, len(ctx)))
        same, how = same_greedy(native, relayed, gaps)
        greedy_ok += same
        step = max(1, (len(cont) - 1) // args.positions)
        for j in range(1, len(cont), step)[: args.positions]:
            (want,), _ = generate(ctx + cont[:j], 1, native_salt)
            (got,), _ = generate(ctx + cont[:j], 1, uuid.uuid4().hex, (path, len(ctx)))
            agree += want == got
            scored += 1
        details.append(f"case {i}: {len(ctx)} context tokens, greedy {how}")
        print(details[-1], flush=True)
    top1 = agree / scored
    row = {
        "check": "f1_equals_native", "passed": greedy_ok == len(cases) and top1 >= 0.99 and len(cases) >= 8,
        "value": top1, "transport": "heterofold", "engine": "vllm", "engine_mode": "eager", "precision": "float32",
        "sender": args.sender, "receiver": args.receiver, "recompute_fraction": 1.0, "requests": len(cases),
        "detail": f"f = 1.0 through the connector: {greedy_ok}/{len(cases)} prompts with the first "
                  f"{args.new_tokens} greedy tokens equal to vLLM's native prefill; teacher-forced top-1 "
                  f"{agree}/{scored} = {top1:.3f} (needs >= 0.99 on >= 8 prompts); " + "; ".join(details),
    }  # fmt: skip
    print(json.dumps(row))
    Path(args.out).write_text(json.dumps({"rows": [row]}, indent=1) + "\n")
    if args.results:
        write_engine_results(args.results, [row], {}, merge=True)
    return 0 if row["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
