"""`ctxrelay bench vllm-capture`: what leaving a sender's state costs when vLLM reads the text (the
connector's capture) against a plain engine request, and against ctxrelay's runner reading it.

Per sender, one vLLM engine started as `ctxrelay serve --engine vllm` starts it (compiled by default,
prefix caching on, ctxrelay's connector). Per length and repeat, in alternating order on fresh cache salts
(nothing served from the prefix cache), the same held-out essay:
- `engine_ttft_s`: a plain request, one token decoded (request sent -> answer);
- `capture_ttft_s`: the same request marked for capture (the engine also hands every layer's new keys and
  values to the recorder; the file is written on a thread after the answer). `capture_overhead` is the
  median over repeats of capture / plain - 1, paired by repeat (the issue's bar: <= 3%);
- `capture_file_s`: request sent -> the capture file in place;
- `state_engine_s`: the whole state build as `serve --engine vllm` does it (engine read, file, keys back to
  pre-RoPE, the ContextState); `state_runner_s`: ctxrelay's runner building the same state (its reference;
  `runner_repeats` of them). `state_max_rel_err`: the engine's state against the runner's, worst layer.
A family with k-norm (gemma3) has no capture: its cached keys lost the pre-norm scale the translators read;
its state stays the runner's. Timing runs need the machine to themselves (`flock ~/.cache/ctxrelay/timing.lock`).
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths
from ctxrelay.data.datasets import essay_haystack
from ctxrelay.engines.kv_capture import wait_for_file
from ctxrelay.engines.vllm_params import cache_salt, capture_params
from ctxrelay.engines.vllm_server import EngineConfig
from ctxrelay.errors import UsageError
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.relay.api import ModelPool
from ctxrelay.results import machine_facts, write_results
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.vllm_engine import VllmEngine
from ctxrelay.transports.base import TuningKey
from ctxrelay_bench.runs import bench_options

TUNING_KEYS = [
    TuningKey("senders", "smollm2-135m,qwen2.5-coder-0.5b", "models whose engine captures (comma list)"),
    TuningKey("mode", "compiled", "the engine's mode: compiled (vLLM's default) | eager"),
    TuningKey("dtype", "auto", "the engine's dtype: auto (bf16 with AVX512-bf16/AMX, else fp32) | float32 | bfloat16"),
    TuningKey("runner_repeats", 1, "runner state builds per length (its reference time)"),
    TuningKey("seed", 700, "the held-out essay of repeat i is drawn with seed + i"),
]  # fmt: skip
OPTIONS = {k.name: k.default for k in TUNING_KEYS}
TENANT = "bench"


def bench(
    model: str = "", sender: str = "", receiver: str = "", lengths: Sequence[int] = (2048, 4096), repeats: int = 5,
    out: str = "vllm-capture", options: dict | None = None, command: str = "",
) -> Path:  # fmt: skip
    opts = bench_options("vllm-capture", options, OPTIONS)
    senders = [model or sender] if (model or sender) else [s for s in str(opts["senders"]).split(",") if s]
    if repeats < 5:
        raise UsageError(f"the capture overhead is a median of >= 5 paired runs, got --repeats {repeats}")
    command = command or f"ctxrelay bench vllm-capture --lengths {','.join(map(str, lengths))} --repeats {repeats}"
    rows: list[dict] = []
    path = None
    for name in senders:
        pool = ModelPool([name], engine=True)
        config = EngineConfig(dtype=str(opts["dtype"]), compiled=opts["mode"] == "compiled", profile_lengths=())
        engine = VllmEngine.start(pool, Metrics(), config, machine_facts()["isa"], paths.cache_dir(), served=[name])
        try:
            rows += sender_rows(engine, name, lengths, repeats, opts)
            path = write_results(out, rows, command, {"options": opts, "lengths": list(lengths), "engine": "vllm"})
        finally:
            engine.close()
    if path is None:
        raise UsageError("no sender was measured")
    return path


def sender_rows(engine: VllmEngine, name: str, lengths: Sequence[int], repeats: int, opts: dict) -> list[dict]:
    m, server = engine.pool.models[name], engine.servers[name]
    if m.spec.family.qk_norm:
        raise UsageError(f"{name} normalises keys before RoPE: the engine cannot give its state (the runner does)")
    rows = []
    warm = tokenize_context(m, essay_haystack(m.tokenizer, 256, split="train", seed=1))[0].tolist()
    engine.read_once(name, warm, cache_salt(TENANT, uuid.uuid4().hex))
    for n in lengths:
        plain, cap, ratios, files, builds, runner_s, errs = [], [], [], [], [], [], []
        for i in tqdm(range(repeats), desc=f"{name} @ {n}", unit="pair"):
            text = essay_haystack(m.tokenizer, n, split="heldout", seed=int(opts["seed"]) + i)
            ids = tokenize_context(m, text)[0].tolist()
            where = engine.payload_dir / f"bench-{uuid.uuid4().hex}.safetensors"
            order = (False, True) if i % 2 == 0 else (True, False)  # alternate who runs first
            got = {}
            for capture in order:
                t = time.perf_counter()
                salt = cache_salt(TENANT, uuid.uuid4().hex)
                got[capture] = engine.read_once(name, ids, salt, capture_params(where, TENANT) if capture else None)
                if capture:
                    wait_for_file(where, 60)
                    files.append(time.perf_counter() - t)
            where.unlink(missing_ok=True)
            plain.append(got[False])
            cap.append(got[True])
            ratios.append(got[True] / got[False] - 1)
            state = engine.captured_state(m, text, TENANT, None, None)  # as the state builder makes it
            builds.append(state.meta["prefill_s"])
            if i < int(opts["runner_repeats"]):
                with torch.inference_mode():
                    ref = capture_state(m, text, TENANT)
                runner_s.append(ref.meta["prefill_s"])
                errs.append(_max_rel_err(state, ref))
        rows.append({
            "sender": name, "context_tokens": n, "transport": "native", "repeats": repeats,
            "engine": "vllm", "engine_mode": server.config.mode, "engine_dtype": server.dtype,
            "engine_ttft_s": statistics.median(plain), "capture_ttft_s": statistics.median(cap),
            "capture_overhead": statistics.median(ratios), "capture_overheads": ratios,
            "capture_file_s": statistics.median(files), "state_engine_s": statistics.median(builds),
            "state_runner_s": statistics.median(runner_s) if runner_s else None,
            "state_max_rel_err": max(errs) if errs else None,
        })  # fmt: skip
    return rows


def _max_rel_err(a, b) -> float:
    worst = 0.0
    for x, y in ((a.keys_pre_rope, b.keys_pre_rope), (a.values, b.values)):
        for i in range(x.shape[0]):
            worst = max(worst, float((x[i].float() - y[i].float()).norm() / y[i].float().norm().clamp_min(1e-12)))
    return worst
