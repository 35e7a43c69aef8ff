"""`ctxrelay bench vllm-native`: vLLM's own prefill on this machine, the native baseline a relay speedup is
measured against, beside ctxrelay's runner (labelled as such), in one process and run.

Per model, length, precision and mode: `engine_native_ttft_s`, a context the engine has not cached (each
timed request gets a fresh cache salt, so the prefix cache cannot serve it), and
`engine_prefix_hit_ttft_s`, the same prompt again under one salt (the prefix cache serves all its whole
blocks). TTFT is one `generate` call with `max_tokens=1`: prefill, the first token, the engine's own
scheduling. Warm-up first, median of the repeats. Contexts are held-out essays of exactly the requested
token count in each model's tokenizer. Runs inside vLLM's venv (`make vllm`):

    .venv-vllm/bin/ctxrelay bench vllm-native --model smollm2-135m --lengths 1024,2048
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from ctxrelay import zoo
from ctxrelay.errors import UsageError
from ctxrelay.results import write_results
from ctxrelay.timing import median_time
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.native.bench import essay_ids, model_names, native_ttft
from ctxrelay_bench.runs import bench_options

DEFAULTS = {"precisions": "bfloat16,float32", "compiled": False, "runner": True, "kv_space_gib": 1}
TUNING_KEYS = keys_from(
    DEFAULTS,
    {
        "precisions": "comma-separated dtypes vLLM runs the model in (bfloat16, float32)",
        "compiled": "vLLM's default compiled mode (torch.compile, ~80 s a start) instead of eager",
        "runner": "also time ctxrelay's own fp32 runner (the reference) in the same run",
        "kv_space_gib": "VLLM_CPU_KVCACHE_SPACE: GiB of paged KV cache",
    },
)
SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def engine_rows(model_dir: str, prompts: dict[int, list[int]], dtype: str, compiled: bool, repeats: int) -> list:
    """One engine started for (model, dtype, mode): cold and prefix-hit TTFT at every length."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=not compiled, enable_prefix_caching=True,
              max_model_len=max(prompts) + 16, skip_tokenizer_init=True, seed=0)  # fmt: skip
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def call(ids: list[int], salt: str) -> None:
        llm.generate([{"prompt_token_ids": ids, "cache_salt": salt}], one, use_tqdm=False)

    out = []
    call(prompts[min(prompts)], "warm-up")
    for n, ids in sorted(prompts.items()):
        cold = median_time(lambda ids=ids: call(ids, uuid.uuid4().hex), repeats)[0]
        salt = uuid.uuid4().hex
        hit = median_time(lambda ids=ids, salt=salt: call(ids, salt), repeats)[0]  # its warm-up fills the cache
        out.append({"context_tokens": n, "engine_native_ttft_s": cold, "engine_prefix_hit_ttft_s": hit})
    _shutdown(llm)
    return out


def _shutdown(llm) -> None:
    """Stop the engine's processes before the next one starts: two engines do not fit beside the models."""
    stop = getattr(llm, "shutdown", None)
    if stop:
        stop()
    gc.collect()


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (1024, 2048),
    repeats: int = 3,
    out: str = "vllm-native",
    options: dict | None = None,
    command: str = "",
) -> Path:
    opts = bench_options("vllm-native", options, DEFAULTS)
    try:
        import vllm
    except ImportError:
        raise UsageError("bench vllm-native runs in vLLM's venv: `make vllm`, then .venv-vllm/bin/ctxrelay") from None
    from ctxrelay.engines.vllm_connector import cpu_engine_env

    cpu_engine_env(float(opts["kv_space_gib"]))
    mode = "compiled" if opts["compiled"] else "eager"
    rows = []
    for name in model_names(model or "smollm2-135m"):
        m = zoo.load(name)
        prompts = {n: essay_ids(m, n).tolist() for n in lengths}
        runner_s = {}
        if opts["runner"]:
            for n, ids in prompts.items():
                t = torch.tensor(ids)
                runner_s[n] = median_time(lambda m=m, t=t: native_ttft(m, t), repeats)[0]
        model_dir = str(zoo.pull(name))
        for dtype in str(opts["precisions"]).split(","):
            for r in engine_rows(model_dir, prompts, dtype, bool(opts["compiled"]), repeats):
                precision = SHORT.get(dtype, dtype)
                row = {"transport": "native", "engine": "vllm", "engine_mode": mode, "precision": precision,
                       "receiver": name, **r}  # fmt: skip
                if r["context_tokens"] in runner_s:
                    row["runner_native_ttft_s"] = runner_s[r["context_tokens"]]
                    row["engine_vs_runner"] = runner_s[r["context_tokens"]] / r["engine_native_ttft_s"]
                rows.append(row)
                print(row)
    extra = {"vllm": vllm.__version__, "repeats": repeats, "options": opts}
    return write_results(out, rows, command or f"ctxrelay bench vllm-native --model {model}", extra)
