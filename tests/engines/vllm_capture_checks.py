"""The sender's K/V captured inside vLLM equals what ctxrelay's runner captures. Run inside vLLM's venv:

    .venv-vllm/bin/python tests/engines/vllm_capture_checks.py MODEL OUT.json [--tokens N] [--results NAME]

MODEL is a zoo name or an HF directory (the tiny random llama the test writes). vLLM (eager, fp32: the
runner's dtype, so the comparison is at fp32 tolerance) prefills prompts marked for capture
(`capture_params`) with chunked prefill forced (`max_num_batched_tokens` below the prompt), and the
connector leaves their K/V; keys are turned back to pre-RoPE (capture.unrope_keys) and compared with the
runner's own capture of the same ids. Checks, one JSON row each:
  capture_equals_runner        a chunked prefill's K/V, every layer, within fp32 tolerance of the runner's
  capture_after_prefix_hit     a longer prompt on the same cache salt: the engine's prefix cache serves the
                               first blocks, the capture starts there and equals the runner's rest
  capture_in_a_batch           two capture requests and a plain one in one batch: each file holds its own rows
  capture_refused_elsewhere    the file is refused for another tenant (the seal and bindings hold)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

TOLERANCE = 2e-3  # relative L2 error per layer, fp32 engine against fp32 runner (kernel order differs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="zoo name or HF directory")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--tenant", default="acme")
    ap.add_argument("--results", default="", help="also merge the rows into benchmarks/results/NAME.json")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm_relay_checks import prompt_ids, write_engine_results

    from ctxrelay import zoo
    from ctxrelay.engines.kv_capture import CapturedKV, wait_for_file
    from ctxrelay.engines.vllm_connector import cpu_engine_env, transfer_config
    from ctxrelay.engines.vllm_params import capture_params
    from ctxrelay.errors import BindingError
    from ctxrelay.models import runner
    from ctxrelay.models.capture import unrope_keys

    model_dir = str(zoo.pull(args.model)) if args.model in zoo.ZOO else args.model
    cpu_engine_env(1)
    m = zoo.load(model_dir, dtype=torch.float32)
    ids = prompt_ids(m, args.tokens + 200)
    first, longer = ids[: args.tokens], ids
    work = Path(tempfile.mkdtemp(prefix="ctxrelay-capture-"))
    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
        max_model_len=max(1024, len(ids) + 16), max_num_batched_tokens=256, skip_tokenizer_init=True, seed=0,
        kv_transfer_config=transfer_config(m.spec.weights_hash),
    )  # fmt: skip

    # a family with k-norm (gemma3) is compared as its cache holds keys, after norm and RoPE: its pre-norm keys
    # cannot be had from the engine (the router keeps the runner for it)
    post_rope = bool(m.spec.family.qk_norm)

    def runner_kv(prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cap = runner.Capture(keys_pre_rope=True, values=True)
        with torch.inference_mode():
            cache = runner.forward(m, torch.tensor(prompt), capture=cap, logits="none").cache
        if post_rope:
            keys = [cache.view(i, len(prompt))[0][0].transpose(0, 1) for i in range(len(cap.keys))]
            return torch.stack(keys), torch.stack(cap.vals)
        return torch.stack(cap.keys), torch.stack(cap.vals)

    def engine_kv(prompts: list[list[int]], salt: str, capture: list[bool]) -> list[CapturedKV | None]:
        paths = [work / f"{uuid.uuid4().hex}.safetensors" for _ in prompts]
        reqs = [{"prompt_token_ids": p, "cache_salt": salt} for p in prompts]
        params = [
            SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                           extra_args={"kv_transfer_params": capture_params(path, args.tenant)} if c else None)
            for path, c in zip(paths, capture, strict=True)
        ]  # fmt: skip
        llm.generate(reqs, params, use_tqdm=False)
        out = []
        for path, p, c in zip(paths, prompts, capture, strict=True):
            if not c:
                out.append(None)
                continue
            wait_for_file(path, 60)
            out.append(CapturedKV.load(path, p, m.spec.weights_hash, args.tenant))
        return out

    def compare(cap: CapturedKV, prompt: list[int]) -> tuple[bool, str]:
        want_k, want_v = runner_kv(prompt)
        got_k = torch.stack(cap.keys) if post_rope else unrope_keys(m, torch.stack(cap.keys), cap.start)
        got_v = torch.stack(cap.values)
        if got_k.shape != want_k[:, cap.start :].shape:
            return False, f"shape {tuple(got_k.shape)} against {tuple(want_k[:, cap.start :].shape)}"
        ek = max(rel_err(got_k[i], want_k[i, cap.start :]) for i in range(got_k.shape[0]))
        ev = max(rel_err(got_v[i], want_v[i, cap.start :]) for i in range(got_v.shape[0]))
        ok = ek <= TOLERANCE and ev <= TOLERANCE
        return ok, f"positions {cap.start}..{cap.end - 1}: worst layer relative error keys {ek:.2e}, values {ev:.2e}"

    rows = []
    salt = "capture-" + uuid.uuid4().hex
    t = time.perf_counter()
    (a,) = engine_kv([first], salt, [True])
    ok, how = compare(a, first)
    rows.append({"check": "capture_equals_runner", "passed": ok and a.start == 0,
                 "detail": f"{len(first)} tokens in chunks of 256, start {a.start}: {how} "
                           f"(tolerance {TOLERANCE:g}); {time.perf_counter() - t:.2f} s"})  # fmt: skip
    (b,) = engine_kv([longer], salt, [True])
    ok, how = compare(b, longer)
    rows.append({"check": "capture_after_prefix_hit", "passed": ok and b.start > 0,
                 "detail": f"{len(longer)} tokens, the first {b.start} from the prefix cache: {how}"})  # fmt: skip
    other = list(reversed(first))
    c1, _, c2 = engine_kv([first, longer[50:], other], "batch-" + uuid.uuid4().hex, [True, False, True])
    ok1, how1 = compare(c1, first)
    ok2, how2 = compare(c2, other)
    rows.append({"check": "capture_in_a_batch", "passed": ok1 and ok2 and c1.start == 0 and c2.start == 0,
                 "detail": f"first: {how1}; second: {how2}"})  # fmt: skip
    (d,) = engine_kv([first], "refuse-" + uuid.uuid4().hex, [True])
    path = work / "kept.safetensors"
    d.save(path)
    try:
        CapturedKV.load(path, first, m.spec.weights_hash, "someone-else")
        refused = "loaded for another tenant"
    except BindingError as e:
        refused = f"refused: {e}"
    rows.append({"check": "capture_refused_elsewhere", "passed": refused.startswith("refused"), "detail": refused})
    for r in rows:
        r["transport"] = "native"
        r["engine"] = "vllm"
    Path(args.out).write_text(json.dumps({"model": m.spec.name, "rows": rows}, indent=1) + "\n")
    if args.results:
        extra = {"model": m.spec.name, "engine": "vllm", "engine_mode": "eager", "precision": "fp32"}
        write_engine_results(args.results, rows, extra, merge=True)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
