"""`ctxrelay bench load`: the OpenAI server under concurrent clients, on loopback.

Starts `ctxrelay serve` as a process of its own (the model(s) of --model, an API key set), waits for
/healthz, then per concurrency level runs `requests` streaming chat completions through the official
`openai` AsyncOpenAI client, at most `concurrency` in flight, bounded in time by `max_s` per level
(what is still running then is cancelled and counted as unfinished). Every request asks about a
held-out essay excerpt of about `prompt_tokens` tokens led by its own request number, so no prefix is
reused (neither ctxrelay's states nor an engine's prefix cache). TTFT: request
sent -> first content chunk; latency: -> last chunk. Per level: requests, ok, 429s (the queue bound
answering, a correct answer), failures (5xx, dropped connections, other errors), throughput (requests/s,
completion chunks/s), P50/P90/P99 TTFT and latency, and whether the server's /metrics request counts
equal the load tool's (by status, over the level). `engines=native,vllm` loads one server per engine in
turn (`ctxrelay serve --engine E`), each row naming its `engine`: with `--engine native` one compute lock
serves all requests, so throughput stays at one model's rate; with `--engine vllm` the engine batches
concurrent requests. `vllm-direct` loads vLLM's own OpenAI server for the model, with nothing of ctxrelay in
front (started as `--engine vllm` starts it): the router's cost is the difference to the `vllm` rows (no
/metrics comparison there: vLLM counts requests its own way). `duration_s` > 0 makes each level closed-loop:
`concurrency` clients each send the next prompt as soon as their last one returns, for that long (the issue's
>= 60 s at concurrency 16).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ctxrelay.errors import UsageError
from ctxrelay.results import write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.harness import serve_process, stop_process
from ctxrelay_bench.plots import cdf_step, save_figure
from ctxrelay_bench.runs import bench_options

OPTIONS = {"concurrency": "1,4,16", "requests": 32, "max_s": 300.0, "max_tokens": 16, "port": 8391, "warmup": 2,
           "start_s": 300.0, "max_queue": 64, "engines": "native", "duration_s": 0.0,
           "engine_mode": "compiled"}  # fmt: skip
# `ctxrelay bench load --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "concurrency": "clients in flight per level (comma list)",
        "requests": "requests per level",
        "max_s": "seconds a level (and a request) may take",
        "max_tokens": "tokens each request asks for",
        "port": "the port the server under test listens on",
        "warmup": "untimed requests first",
        "start_s": "seconds the server may take to start",
        "max_queue": "the server's --max-queue",
        "engines": "the servers loaded in turn: native (ctxrelay's runner), vllm, vllm-direct (vLLM alone; comma list)",
        "duration_s": "> 0: each level's clients send requests back to back for this long (else `requests`)",
        "engine_mode": "vLLM's mode with engines=vllm: compiled (its default) | eager",
    },
)
KEY = "load-test-key"
QUESTION = "\n\nIn one sentence, what is this passage about?"


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics (numpy's default); None for no values."""
    return float(np.percentile(xs, q)) if len(xs) else None


def prompts(model: str, n: int, tokens: int) -> list[str]:
    """`n` held-out essay excerpts of about `tokens` tokens of `model`'s tokenizer, with a question. The held-out
    essays start only a few dozen distinct excerpts, so every prompt opens with its own request number: no two
    share a prefix block an engine's prefix cache could serve (only the chat template's opening)."""
    from ctxrelay import zoo
    from ctxrelay.data.datasets import essay_haystack, essays

    tok = zoo.tokenizer(model)
    texts = [essay_haystack(tok, tokens, split="heldout", seed=i) + QUESTION for i in range(len(essays("heldout")))]
    return [f"[request {i}] {texts[i % len(texts)]}" for i in range(n)]


def start_server(
    models: str, port: int, threads: int, wait_s: float, max_queue: int, engine: str = "native",
    engine_mode: str = "compiled",
) -> subprocess.Popen:  # fmt: skip
    args = ["--models", models, "--threads", str(threads), "--max-queue", str(max_queue), "--engine", engine]
    if engine == "vllm":
        args += ["--engine-mode", engine_mode]
    return serve_process(args, port, f"{KEY}:load", wait_s)


def direct_server(model: str, mode: str):
    """vLLM's own OpenAI server for `model`, started as `ctxrelay serve --engine vllm` starts it (its dtype,
    KV space, prefix caching and connector), answering on its own port."""
    from ctxrelay import paths, zoo
    from ctxrelay.engines.vllm_server import EngineConfig, VllmServer
    from ctxrelay.results import machine_facts

    spec = zoo.load(model).spec  # its weights hash binds the connector; its window bounds the engine's
    config = EngineConfig(compiled=mode == "compiled")
    server = VllmServer(model, zoo.pull(model), spec.weights_hash, config, machine_facts()["isa"],
                        paths.cache_dir() / "logs", spec.context_window)  # fmt: skip
    server.start()
    return server


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    import openai

    t0 = time.perf_counter()
    first = None
    chunks = 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                first = first or time.perf_counter()
    except openai.RateLimitError:
        return {"status": "429", "latency_s": time.perf_counter() - t0}
    except openai.APIStatusError as e:
        return {"status": f"http {e.status_code}", "latency_s": time.perf_counter() - t0}
    except openai.APIConnectionError:
        return {"status": "dropped", "latency_s": time.perf_counter() - t0}
    end = time.perf_counter()
    if first is None:
        return {"status": "empty", "latency_s": end - t0}
    return {"status": "ok", "ttft_s": first - t0, "latency_s": end - t0, "chunks": chunks}


async def run_level(
    url: str, model: str, texts: list[str], concurrency: int, max_tokens: int, max_s: float, duration_s: float = 0.0
):
    """(results, unfinished, wall seconds) of one level: every text once, at most `concurrency` in flight; or,
    with `duration_s`, `concurrency` clients each sending the next text as its last one returns, until then."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=max_s)
    if duration_s > 0:
        try:
            return await _closed_loop(client, model, texts, concurrency, max_tokens, duration_s, max_s)
        finally:
            await client.close()
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(texts), desc=f"concurrency {concurrency}", unit="req")

    async def limited(text: str) -> dict:
        async with gate:
            r = await one_request(client, model, text, max_tokens)
            bar.update(1)
            return r

    tasks = [asyncio.create_task(limited(t)) for t in texts]
    t0 = time.perf_counter()
    done, pending = await asyncio.wait(tasks, timeout=max_s)
    wall = time.perf_counter() - t0
    for p in pending:
        p.cancel()
    bar.close()
    await client.close()
    return [t.result() for t in done], len(pending), wall


async def _closed_loop(client, model: str, texts: list[str], concurrency: int, max_tokens: int, duration_s: float,
                       max_s: float):  # fmt: skip
    order = iter(texts)
    results: list[dict] = []
    t0 = time.perf_counter()
    bar = tqdm(desc=f"concurrency {concurrency}, {duration_s:.0f} s", unit="req")

    async def client_loop() -> None:
        while time.perf_counter() - t0 < duration_s:
            text = next(order, None)
            if text is None:
                return
            results.append(await one_request(client, model, text, max_tokens))
            bar.update(1)

    tasks = [asyncio.create_task(client_loop()) for _ in range(concurrency)]
    done, pending = await asyncio.wait(tasks, timeout=duration_s + max_s)
    for p in pending:
        p.cancel()
    bar.close()
    return results, len(pending), time.perf_counter() - t0


CHAT_PATH = "/v1/chat/completions"


def served_counts(url: str) -> dict[str, int]:
    """The server's own count of chat requests by HTTP status (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "ctxrelay_requests_total" and smp.labels.get("path") == CHAT_PATH:
                out[smp.labels["status"]] = int(smp.value)
    return out


def counts_match(tool: dict[str, int], before: dict[str, int], after: dict[str, int]) -> bool:
    """Whether the server counted what the load tool saw: ok -> 200, 429 -> 429, nothing else either side."""
    served = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    served = {k: v for k, v in served.items() if v}
    want = {("200" if k == "ok" else k): v for k, v in tool.items() if v}
    return served == want


def summarize(results: list[dict], unfinished: int, wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r["status"] == "ok"]
    statuses = sorted({r["status"] for r in results})
    counts = {s: sum(1 for r in results if r["status"] == s) for s in statuses}
    ttft = [r["ttft_s"] for r in ok]
    lat = [r["latency_s"] for r in ok]
    failed = sum(v for k, v in counts.items() if k not in ("ok", "429")) + unfinished
    row = {"transport": "native", "method": "serve-load", "concurrency": concurrency,
           "requests": len(results) + unfinished, "ok": len(ok), "rejected_429": counts.get("429", 0),
           "failed": failed, "unfinished": unfinished, "statuses": counts, "wall_s": wall,
           "requests_per_s": len(ok) / wall, "chunks_per_s": sum(r["chunks"] for r in ok) / wall}  # fmt: skip
    for name, xs in (("ttft", ttft), ("latency", lat)):
        for q in (50, 90, 99):
            v = percentile(xs, q)
            if v is not None:
                row[f"{name}_p{q}_s"] = v
    if ttft:
        row["ttft_mean_s"] = statistics.mean(ttft)
    return row


def plot(rows: list[dict], samples: dict[str, list[float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, xs in samples.items():
        cdf_step(ax[0], xs, label=label)
    ax[0].set(xlabel="TTFT (s)", ylabel="share of requests", title="TTFT CDF")
    ax[0].legend()
    for engine in sorted({r.get("engine", "native") for r in rows}):
        mine = [r for r in rows if r.get("engine", "native") == engine]
        cs = [r["concurrency"] for r in mine]
        ax[1].plot(cs, [r["requests_per_s"] for r in mine], marker="o", label=f"{engine} engine")
        ax[1].set_xticks(cs, [str(c) for c in cs])
    ax[1].set(xlabel="concurrent clients", ylabel="requests / s", xscale="log", title="throughput by concurrency")
    ax[1].legend()
    return save_figure(fig, path)


def bench(
    model: str = "smollm2-135m",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (512,),
    repeats: int = 1,
    out: str = "load",
    options: dict | None = None,
    command: str = "",
) -> Path:
    """Serve --model (first length = prompt tokens) and load it at each concurrency -> load.json + .png."""
    try:
        import openai  # noqa: F401  (the load tool)
    except ImportError:
        raise UsageError("bench load drives the server with the official openai client: pip install openai") from None
    opts = bench_options("load", options, OPTIONS)
    if sender or receiver:
        raise UsageError("bench load serves --model (one zoo name or a comma list); not --sender/--receiver")
    levels = [int(c) for c in str(opts["concurrency"]).split(",") if c]
    n, tokens = int(opts["requests"]), int(list(lengths)[0]) if lengths else 512
    if not levels or min(levels) < 1 or n < 1 or tokens < 16:
        raise UsageError(f"need concurrency levels >= 1, requests >= 1 and a length >= 16 (got {opts}, {tokens})")
    model = model or "smollm2-135m"
    served = model.split(",")[0]
    import torch

    threads = torch.get_num_threads()  # the server runs with the threads this run was given
    command = command or f"ctxrelay bench load --model {model} --lengths {tokens}"
    engines = [e for e in str(opts["engines"]).split(",") if e]
    duration = float(opts["duration_s"])
    w = int(opts["warmup"])
    # closed-loop levels need as many distinct prompts as the fastest engine can serve in the time
    per_level = n if duration <= 0 else max(n, int(duration * 40))
    texts = prompts(served, w + per_level * len(levels), tokens)
    rows: list[dict] = []
    samples: dict[str, list[float]] = {}
    extra = {"options": opts, "prompt_tokens": tokens, "model": served, "server_threads": threads}
    path = None
    for engine in engines:
        port = int(opts["port"])
        start_s = float(opts["start_s"]) if engine == "native" else max(float(opts["start_s"]), 1800.0)
        if engine == "vllm-direct":
            proc = direct_server(served, str(opts["engine_mode"]))
            url = proc.url
        else:
            proc = start_server(model, port, threads, start_s, int(opts["max_queue"]), engine, str(opts["engine_mode"]))
            url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(run_level(url, served, texts[:w], 1, int(opts["max_tokens"]), float(opts["max_s"])))
            for i, c in enumerate(levels):
                batch = texts[w + i * per_level : w + (i + 1) * per_level][: n if duration <= 0 else None]
                direct = engine == "vllm-direct"
                before = {} if direct else served_counts(url)
                res, pending, wall = asyncio.run(
                    run_level(url, served, batch, c, int(opts["max_tokens"]), float(opts["max_s"]), duration)
                )
                row = {"engine": engine, **summarize(res, pending, wall, c)}
                if engine != "native":
                    row["engine_mode"] = opts["engine_mode"]
                if not direct:
                    after = served_counts(url)
                    row["server_counts"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                    row["server_counts_match"] = counts_match(row["statuses"], before, after)
                rows.append(row)
                samples[f"{engine}, concurrency {c}"] = [r["ttft_s"] for r in res if r["status"] == "ok"]
                path = write_results(out, rows, command, extra)
        finally:
            proc.stop() if engine == "vllm-direct" else stop_process(proc, 120)
    if path is None:
        raise UsageError("no concurrency level finished")
    plot(rows, samples, path.with_suffix(".png"))
    return path
