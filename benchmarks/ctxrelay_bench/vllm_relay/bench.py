"""`ctxrelay bench vllm-relay`: the relay inside vLLM against vLLM's own prefill, in one run on one machine.

Per receiver, one vLLM engine (its CPU build, compiled by default, prefix caching on) started as `ctxrelay
serve --engine vllm` starts it, with ctxrelay's connector; the gate reads the engine's costs (serve/
engine_profile.py). Per direction, length and held-out request (needle questions on essays, ShareGPT
continuations; heterofold_frontier's cases):
- `engine_native_ttft_s`: vLLM prefilling the whole prompt on a prefix cache that has not seen it (a fresh
  cache salt), request sent -> first token; `engine_prefix_hit_ttft_s`: the same prompt again (cache hit);
- `relay_ttft_s`: request arrival -> first token through the relay: the sender's state read from the store,
  the gate, translation and selective recompute (ctxrelay's runner), the K/V file, the engine's load and
  its prefill of the rest; components in `timings`. A request the gate (or its per-request estimate) sends
  to native prefill counts with what it cost: the relay's work, then vLLM's native prefill;
- `runner_native_ttft_s`: ctxrelay's own runner prefilling natively (a reference, not the baseline);
- needles: the engine's greedy answers, relayed and native; essays and ShareGPT top-1: teacher-forced
  agreement of the relayed cache with native over the continuation, computed on ctxrelay's runner with the
  K/V the engine is given (vLLM skips external K/V for requests that ask for prompt log-probs), against the
  runner's native prefill in the relay's precision (`engine_relay_dtype`: bf16 with a bf16 engine on a CPU
  with bf16 units, engine_profile.relay_dtype).
Two points per direction: the gate's default (quality threshold 0.85) and plain translation (threshold 0).
The sender's own prefill is not timed (it happened for the sender's own answer). Timing runs need the
machine to themselves (`flock ~/.cache/ctxrelay/timing.lock`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths, zoo
from ctxrelay.data.needle import score_answer
from ctxrelay.engines.vllm_params import cache_salt
from ctxrelay.engines.vllm_server import EngineConfig
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.tokens import suffix_ids
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.gate import DEFAULT_QUALITY
from ctxrelay.relay.store import DiskStore
from ctxrelay.results import machine_facts, read_results, results_file, write_results
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.vllm_engine import VllmEngine
from ctxrelay.state import ContextState
from ctxrelay.transports.base import TuningKey
from ctxrelay_bench.heterofold_frontier.bench import build_cases, native_ref, relay_point
from ctxrelay_bench.plots import plot_path, save_figure
from ctxrelay_bench.runs import bench_options, markdown_table
from ctxrelay_bench.sender_states import cached_sender_states

TUNING_KEYS = [
    TuningKey("directions", "smollm2-135m:gemma3-270m,qwen2.5-coder-1.5b:gemma3-270m,"
              "gemma3-270m:qwen2.5-coder-0.5b,qwen2.5-coder-1.5b:qwen2.5-coder-0.5b",
              "sender:receiver pairs (comma list)"),
    TuningKey("needles", 6, "needle cases per length"),
    TuningKey("sharegpt", 2, "ShareGPT continuation cases per length"),
    TuningKey("continuation", 129, "teacher-forced continuation tokens"),
    TuningKey("answer_tokens", 24, "greedy needle-answer tokens"),
    TuningKey("ref_tokenizer", "qwen2.5-coder-0.5b", "contexts are cut at this tokenizer's counts"),
    TuningKey("seed", 900, "case i draws its essay and fact from seed + i"),
    TuningKey("mode", "compiled", "the engine's mode: compiled (vLLM's default) | eager"),
    TuningKey("dtype", "auto", "the engine's dtype: auto (bf16 with AVX512-bf16/AMX, else fp32) | float32 | bfloat16"),
    TuningKey("runner_native", 2, "requests per length whose native prefill is also timed on ctxrelay's runner"),
]  # fmt: skip
OPTIONS = {k.name: k.default for k in TUNING_KEYS}
# what heterofold_frontier's quality helpers read besides: every context token may be attended, nothing hidden
# (the connector serves only points that hide nothing)
FRONTIER = {"attend": "all", "hide": 0}
TENANT = "bench"
POINTS = (("default", DEFAULT_QUALITY), ("plain", 0.0))


def bench(
    model: str = "", sender: str = "", receiver: str = "", lengths: Sequence[int] = (2048, 4096), repeats: int = 1,
    out: str = "vllm-relay", options: dict | None = None, command: str = "",
) -> Path:  # fmt: skip
    opts = {**bench_options("vllm-relay", options, OPTIONS), **FRONTIER}
    pairs = [tuple(d.split(":")) for d in str(opts["directions"]).split(",") if d]
    if sender or receiver:
        pairs = [(sender, receiver)]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise UsageError(f"directions are sender:receiver pairs, got {opts['directions']!r}")
    command = command or f"ctxrelay bench vllm-relay --lengths {','.join(map(str, lengths))}"
    tok = zoo.tokenizer(str(opts["ref_tokenizer"]))
    cases = build_cases(tok, lengths, {**opts, "seed": int(opts["seed"])})
    rows: list[dict] = []
    extra = {"options": opts, "lengths": list(lengths), "engine": "vllm"}
    path = None
    for recv in dict.fromkeys(r for _, r in pairs):
        senders = [s for s, r in pairs if r == recv]
        store = DiskStore(Path(tempfile.mkdtemp(prefix="ctxrelay-vllm-relay-")))
        pool = ModelPool([recv, *senders], engine=True, store=store)
        config = EngineConfig(
            dtype=str(opts["dtype"]), compiled=opts["mode"] == "compiled", profile_lengths=tuple(lengths)
        )
        engine = VllmEngine.start(
            pool, Metrics(), config, machine_facts()["isa"], paths.cache_dir(), served=[recv]
        )
        try:
            for s in senders:
                rows += direction_rows(engine, s, recv, cases, opts)
                path = write_results(out, rows, command, {**extra, "engine_dtype": engine.servers[recv].dtype})
        finally:
            engine.close()
    if path is None:
        raise UsageError("no direction was measured")
    plot(read_results(path)["rows"], path)
    return path


def report(out: str = "vllm-relay") -> Path:
    """Print the table of a results file and draw its plot again (no model runs)."""
    rows = read_results(out)["rows"]
    head = ["direction", "tokens", "point", "relayed", "vLLM native s", "relay s", "x vLLM", "needles (native)",
            "essays top-1", "ShareGPT top-1"]  # fmt: skip
    cells = [[f"{r['sender']} -> {r['receiver']}", str(r["context_tokens"]), r["point"],
              f"{r['relayed_requests']}/{r['requests']}", _f(r["engine_native_ttft_s"]), _f(r["relay_ttft_s"]),
              _f(r["speedup_vs_engine"], "{:.2f}x"), f"{_f(r['needle_acc'])} ({_f(r['native_needle_acc'])})",
              _f(r["essays_top1"]), _f(r["sharegpt_top1"])] for r in rows]  # fmt: skip
    print("\n".join(markdown_table(head, cells)))
    return plot(rows, results_file(out))


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def plot(rows: list[dict], path: Path) -> Path:
    """Speedup against vLLM's native prefill per direction and length, one bar per point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["sender"], r["receiver"], r["context_tokens"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4))
    for j, point in enumerate(("default", "plain")):
        ys = [next((r["speedup_vs_engine"] or 0 for r in rows if (r["sender"], r["receiver"], r["context_tokens"])
                    == k and r["point"] == point), 0) for k in keys]  # fmt: skip
        ax.bar([i + 0.4 * j for i in range(len(keys))], ys, width=0.4, label=f"{point} point")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + 0.2 for i in range(len(keys))], [f"{s} ->\n{r}\n{n}" for s, r, n in keys], fontsize=7)
    ax.set(ylabel="vLLM native TTFT / relay TTFT", title="relay inside vLLM vs vLLM's own prefill")
    ax.legend()
    return save_figure(fig, plot_path(path))


def direction_rows(engine: VllmEngine, sender: str, recv: str, cases: list, opts: dict) -> list[dict]:
    pool, r = engine.pool, engine.pool.models[recv]
    states = cached_sender_states(sender, [c.context for c in cases])
    by_point: dict[tuple[str, int], list[dict]] = {}
    timed_runner: dict[int, int] = {}
    for case, state_path in tqdm(list(zip(cases, states, strict=True)), desc=f"{sender} -> {recv}", unit="req"):
        state = ContextState.load(state_path)
        pool.store.put(state)
        # the reference and the relayed cache's quality in the precision the relay computes in (bf16 with a bf16
        # engine: the engine's own native is bf16 too)
        rq = pool.relay_model(r)
        ref = native_ref(rq, case, opts)
        question = case.question or "\n"
        ids = [*ref.ctx.tolist(), *suffix_ids(r, question).tolist()]
        n_new = int(opts["answer_tokens"]) if case.question else 1
        salt = cache_salt(TENANT, f"native-{time.monotonic_ns()}")
        native = engine.generate(recv, ids, TENANT, time.perf_counter(), n_new, 0.0, None, None, None, "", salt=salt)
        hit = engine.generate(recv, ids, TENANT, time.perf_counter(), 1, 0.0, None, None, None, "", salt=salt)
        runner_s = None
        if timed_runner.get(case.length, 0) < int(opts["runner_native"]):
            timed_runner[case.length] = timed_runner.get(case.length, 0) + 1
            runner_s = _runner_native(r, ids)
        for label, threshold in POINTS:
            t0 = time.perf_counter()
            prep = pool.prepare(case.context, recv, question, tenant=TENANT, sender=sender,
                                quality_threshold=threshold, max_new_tokens=n_new)  # fmt: skip
            kv = engine.payload(prep, TENANT) if prep.relayed else None
            cold = cache_salt(TENANT, f"{label}-{time.monotonic_ns()}")  # a declined relay's prefill is cold too
            res = engine.generate(
                recv, ids, TENANT, t0, n_new, 0.0, None, kv, prep, prep.reason, len(ref.ctx), salt=cold
            )
            row = {
                "relay_ttft_s": res.ttft_s, "engine_native_ttft_s": native.ttft_s,
                "engine_prefix_hit_ttft_s": hit.ttft_s, "runner_native_ttft_s": runner_s, "timings": res.timings,
                "relayed": prep.relayed, "reason": prep.reason, "kind": case.kind,
                "point": prep.decision.point.label if prep.relayed and prep.decision.point else "native",
            }  # fmt: skip
            if case.question:
                row["needle_acc"] = score_answer(res.text, case.answer)["exact"]
                row["native_needle_acc"] = score_answer(native.text, case.answer)["exact"]
            if prep.relayed:  # quality of the very cache the engine got, on the runner (see the docstring)
                o = prep.decision.options
                q = relay_point(rq, state, pool.artifact(prep.decision.edge.artifact_path), ref, case,
                                o.get("selection", "none"), float(o.get("recompute", 0.0)), opts)  # fmt: skip
                row["top1"], row["recompute_fraction"] = q.get("top1_agreement"), q.get("recompute_fraction", 0.0)
            else:
                row["top1"], row["recompute_fraction"] = 1.0, 1.0  # native prefill: the answer native gives
            by_point.setdefault((label, case.length), []).append(row)
    return [_row(sender, recv, label, n, reqs, engine) for (label, n), reqs in by_point.items()]


def _runner_native(r, ids: list[int]) -> float:
    with torch.inference_mode():
        t = time.perf_counter()
        int(runner.forward(r, torch.tensor(ids)).logits[-1].argmax())
        return time.perf_counter() - t


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _row(sender: str, recv: str, label: str, n: int, reqs: list[dict], engine: VllmEngine) -> dict:
    relay, native = _median([q["relay_ttft_s"] for q in reqs]), _median([q["engine_native_ttft_s"] for q in reqs])
    needles = [q for q in reqs if "needle_acc" in q]
    points = sorted({q["point"] for q in reqs})
    comps = sorted({k for q in reqs for k in q["timings"]})
    return {
        "sender": sender, "receiver": recv, "context_tokens": n, "transport": "heterofold" if any(
            q["relayed"] for q in reqs) else "native",
        "point": label, "gate_default": label == "default", "gate_points": points,
        "relayed_requests": sum(q["relayed"] for q in reqs), "requests": len(reqs),
        "recompute_fraction": _mean([q["recompute_fraction"] for q in reqs if q["relayed"]]),
        "engine": "vllm", "engine_mode": engine.servers[recv].config.mode, "engine_dtype": engine.servers[recv].dtype,
        "engine_relay_dtype": str(engine.pool.compute_dtype).removeprefix("torch."),
        "engine_native_ttft_s": native,
        "engine_prefix_hit_ttft_s": _median([q["engine_prefix_hit_ttft_s"] for q in reqs]),
        "runner_native_ttft_s": _median([q["runner_native_ttft_s"] for q in reqs]),
        "relay_ttft_s": relay, "speedup_vs_engine": native / relay if relay and native else None,
        "needle_acc": _mean([q["needle_acc"] for q in needles]),
        "native_needle_acc": _mean([q["native_needle_acc"] for q in needles]),
        "essays_top1": _mean([q["top1"] for q in needles]),
        "sharegpt_top1": _mean([q["top1"] for q in reqs if q["kind"] == "sharegpt"]),
        "timings": {k: _median([q["timings"].get(k) for q in reqs]) for k in comps},
        "reasons": sorted({q["reason"] for q in reqs})[:4],
    }  # fmt: skip
