"""`ctxrelay bench serving-checks`: what stock clients expect of the server, measured on a real model.

Starts `ctxrelay serve` as a process of its own (--model, an API key, `--max-queue 128`) on loopback and
drives it with real HTTP clients (httpx; the official openai client for the refusal). One row per check:

- `next_queue_wait_after_disconnect_s`: a client streams a long answer, reads a few events and closes the
  connection; a request sent at once reports how long it waited for compute (`ctxrelay.queue_wait_s`; with
  vLLM, which batches and has no compute lock, its whole time to first token, `ctxrelay.ttft_s`). The
  worst of `repeats` tries; passes under 0.5 s. The same long turn, not cancelled, is timed once for
  comparison (`uncancelled_turn_s`): that is what the next request waited behind before cancellation.
- `healthz_s_100_waiting`: while one long turn computes and 100 more long turns wait for it, the slowest
  of `healthz_samples` GET /healthz, each on a new connection from one client made beforehand; passes
  under 0.1 s. The clients then close, and the queue must
  drain (`drained_s`: every turn cancelled, the running one at its next token).
- `overwindow_stream_status`: a streamed chat whose prompt is over the model's window: the HTTP status
  (400 passes) and that no event was streamed.
- `first_turn_end_ratio` (first_turn.py): a 4096-token first turn's reply end leaving its state against the
  same turn with `store: false`, medians of `repeats`; passes at 1.10 or less.
- `edited_history_prompt_tokens_equal` (edited_history.py): a resent history with one character edited in an
  earlier message: its `usage.prompt_tokens` minus that of the same messages sent fresh (`store: false`); 0 passes.

`engines=native,vllm` runs every check on one server per engine in turn (`ctxrelay serve --engine E`; vLLM
in `engine_mode`, eager by default: these checks time the router, not the engine's prefill), each row
naming its `engine`. The server runs with this process's torch threads; the clients mostly wait on sockets.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ctxrelay.errors import UsageError
from ctxrelay.results import write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.harness import serve_process, stop_process
from ctxrelay_bench.runs import bench_options, wait_until_quiet
from ctxrelay_bench.serving_checks.edited_history import edited_history_check
from ctxrelay_bench.serving_checks.first_turn import end_ratio_check

OPTIONS = {"port": 8393, "max_queue": 128, "waiting": 100, "long_tokens": 1024, "read_events": 8,
           "healthz_samples": 20, "start_s": 300.0, "overwindow_words": 12000, "quiet_busy": 0.25,
           "quiet_wait_s": 600.0, "first_turn_tokens": 4096, "first_turn_max_tokens": 16,
           "end_ratio_max": 1.10, "engines": "native", "engine_mode": "eager"}  # fmt: skip
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "port": "the port the server under test listens on",
        "max_queue": "the server's --max-queue",
        "waiting": "requests waiting for compute while /healthz is timed",
        "long_tokens": "max_tokens of the long turn (the one cancelled, the one others wait behind)",
        "read_events": "content events the disconnecting client reads before it closes",
        "healthz_samples": "GET /healthz timed while the requests wait (the slowest is reported)",
        "start_s": "seconds the server may take to start",
        "overwindow_words": "words of the over-window prompt",
        "quiet_busy": "busy share of the cores under which the machine counts as quiet",
        "quiet_wait_s": "seconds to wait for a quiet machine before the checks (its busy share is recorded)",
        "first_turn_tokens": "prompt tokens of the first turn timed by first_turn_end_ratio",
        "first_turn_max_tokens": "max_tokens of that turn",
        "end_ratio_max": "the largest first_turn_end_ratio that passes",
        "engines": "the servers checked in turn: native (ctxrelay's runner) and/or vllm (comma list)",
        "engine_mode": "vLLM's mode with engines=vllm: eager | compiled",
    },
)
KEY = "serving-checks-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a prompt a small instruct model answers at length, so a turn of long_tokens decodes long_tokens
LONG_PROMPT = [{"role": "user", "content": "List the numbers from 1 to 1000, separated by commas."}]
SHORT_PROMPT = [{"role": "user", "content": "Say hi."}]


def start_server(
    model: str, port: int, threads: int, wait_s: float, max_queue: int, max_tokens: int, engine: str = "native",
    engine_mode: str = "eager",
):  # fmt: skip
    args = ["--models", model, "--threads", str(threads), "--max-queue", str(max_queue),
            "--max-tokens", str(max_tokens), "--engine", engine]  # fmt: skip
    if engine == "vllm":
        args += ["--engine-mode", engine_mode]
    return serve_process(args, port, f"{KEY}:checks", wait_s)


def chat(url: str, model: str, messages: list[dict], max_tokens: int, timeout: float = 600) -> dict:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=timeout)
    r.raise_for_status()
    return r.json()


def read_then_close(url: str, model: str, max_tokens: int, events: int) -> int:
    """Stream a long turn, read `events` content events, close the connection; returns the events read."""
    import httpx

    body = {"model": model, "messages": LONG_PROMPT, "max_tokens": max_tokens, "stream": True}
    seen = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                seen += 1
                if seen >= events:
                    break
    return seen


def queue(url: str) -> dict:
    import httpx

    return httpx.get(url + "/healthz", timeout=10).json()["queue"]


def wait_for(url: str, pred, seconds: float) -> float:
    """Seconds until pred(queue) holds (UsageError past `seconds`)."""
    t0 = time.perf_counter()
    while not pred(queue(url)):
        if time.perf_counter() - t0 > seconds:
            raise UsageError(f"the server's queue did not reach the expected state in {seconds:.0f} s: {queue(url)}")
        time.sleep(0.02)
    return time.perf_counter() - t0


def disconnect_check(url: str, model: str, opts: dict, repeats: int, engine: str = "native") -> tuple[dict, dict]:
    """With vLLM no turn waits for a compute lock (the engine batches): the value is then the next turn's whole
    time to its first token (its own prefill included), which stays under the bar only if the abandoned turn
    was not still holding the engine."""
    waits, reads = [], []
    for _ in range(repeats):
        reads.append(read_then_close(url, model, int(opts["long_tokens"]), int(opts["read_events"])))
        nxt = chat(url, model, SHORT_PROMPT, 1)  # sent at once
        waits.append(nxt["ctxrelay"]["queue_wait_s" if engine == "native" else "ttft_s"])
        wait_for(url, lambda q: q["depth"] == 0, 60)
    full = chat(url, model, LONG_PROMPT, int(opts["long_tokens"]))
    row = {"check": "next_queue_wait_after_disconnect_s", "value": max(waits), "passed": max(waits) < 0.5}
    extra = {"samples_s": waits, "events_read": reads, "uncancelled_turn_s": full["ctxrelay"]["total_s"],
             "uncancelled_turn_tokens": full["usage"]["completion_tokens"]}  # fmt: skip
    return row, extra


def healthz_check(url: str, model: str, opts: dict, engine: str = "native") -> tuple[dict, dict]:
    """With vLLM the turns are in the engine (batched) rather than waiting for the compute lock."""
    import httpx

    n, loop = int(opts["waiting"]), asyncio.new_event_loop()
    stop = asyncio.Event()

    async def clients() -> None:
        async with httpx.AsyncClient(headers=AUTH, timeout=600, limits=httpx.Limits(max_connections=n + 1)) as c:

            async def one() -> None:
                body = {"model": model, "messages": LONG_PROMPT, "max_tokens": int(opts["long_tokens"])}
                await c.post(url + "/v1/chat/completions", json=body)

            # every turn long: whichever computes, the others keep waiting while /healthz is timed
            tasks = [asyncio.ensure_future(one()) for _ in range(n + 1)]
            await stop.wait()
            for t in tasks:  # the clients give up: their connections close, their turns are cancelled
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    worker = threading.Thread(target=lambda: loop.run_until_complete(clients()), daemon=True)
    worker.start()
    try:
        wait_for(url, lambda q: q["depth"] >= n + 1 and (q["computing"] or engine != "native"), 120)
        times = []
        # one client made beforehand (making one costs httpx tens of ms: not the server's time); a new
        # connection per probe, as a load balancer's health check opens
        with httpx.Client(timeout=10, headers={"Connection": "close"}) as probe:
            for _ in range(int(opts["healthz_samples"])):
                t = time.perf_counter()
                r = probe.get(url + "/healthz")
                times.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise UsageError(f"/healthz answered {r.status_code} under load: {r.text[:500]}")
        depth = queue(url)["depth"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        worker.join(60)
    drained = wait_for(url, lambda q: q["depth"] == 0 and not q["computing"], 60)
    row = {"check": "healthz_s_100_waiting", "value": max(times), "passed": max(times) < 0.1}
    return row, {"samples_s": times, "median_s": statistics.median(times), "queue_depth": depth, "drained_s": drained}


def overwindow_check(url: str, model: str, opts: dict) -> tuple[dict, dict]:
    import httpx

    words = "word " * int(opts["overwindow_words"])
    body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 16, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        raw = r.read().decode()
    events = raw.count("data: ")
    ok = r.status_code == 400 and events == 0
    detail = {"content_type": r.headers.get("content-type", ""), "sse_events": events, "body": raw[:300]}
    return {"check": "overwindow_stream_status", "value": r.status_code, "passed": ok}, detail


def bench(
    model: str = "smollm2-135m",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (),
    repeats: int = 3,
    out: str = "serving-checks",
    options: dict | None = None,
    command: str = "",
) -> Path:
    """Serve --model with --max-queue 128 and run the checks -> serving-checks.json (no plot: one number each)."""
    if sender or receiver:
        raise UsageError("bench serving-checks serves one --model; not --sender/--receiver")
    opts = bench_options("serving-checks", options, OPTIONS)
    model = (model or "smollm2-135m").split(",")[0]
    import torch

    threads = torch.get_num_threads()
    command = command or f"ctxrelay bench serving-checks --model {model} --repeats {repeats}"
    port = int(opts["port"])
    url = f"http://127.0.0.1:{port}"
    # response times: another job's load would be measured too
    busy = wait_until_quiet(float(opts["quiet_busy"]), float(opts["quiet_wait_s"]))
    rows: list[dict] = []
    details: dict[str, dict] = {}
    for engine in [e for e in str(opts["engines"]).split(",") if e]:
        start_s = float(opts["start_s"]) if engine == "native" else max(float(opts["start_s"]), 1800.0)
        proc = start_server(model, port, threads, start_s, int(opts["max_queue"]), int(opts["long_tokens"]), engine,
                            str(opts["engine_mode"]))  # fmt: skip
        try:
            chat(url, model, SHORT_PROMPT, 4)  # warm-up: the first turn pays one-time costs
            for check, args in (
                (disconnect_check, (url, model, opts, max(1, repeats), engine)),
                (healthz_check, (url, model, opts, engine)),
                (overwindow_check, (url, model, opts)),
                (end_ratio_check, (url, model, AUTH, opts, max(1, repeats))),
                (edited_history_check, (url, model, AUTH)),
            ):
                row, detail = check(*args)
                rows.append({"engine": engine, "transport": "native", "model": model, **row})
                details[f"{engine} {row['check']}"] = detail
        finally:
            stop_process(proc, 120)
    extra = {"options": opts, "model": model, "server_threads": threads, "details": details}
    if busy is not None:
        extra["machine_busy_before"] = busy
    return write_results(out, rows, command, extra)
