"""`first_turn_end_ratio`: a long first turn's reply end with the state it leaves against the same turn with none.

A streamed first turn of a conversation (`first_turn_tokens` prompt tokens, the model's own chat template)
is timed from the request to its last SSE event ([DONE]), once leaving the state its next turn reads
(`conversation: "new"`: the state is built after the reply) and once with `store: false` (no state).
Before the state was built after the reply, the first took about two prefills. Each try starts on an
idle server (no turn computing, no state being built), the two alternate, and the row holds the ratio
of their medians over `repeats` tries; it passes at `end_ratio_max` or less.
"""

from __future__ import annotations

import statistics
import time

from ctxrelay.data.datasets import essays


def prompt_of(url: str, model: str, auth: dict, n_tokens: int) -> list[dict]:
    """One user message (training-split essays) whose chat-templated prompt is `n_tokens` tokens (within a
    few), counted by the server's own /tokenize."""
    import httpx

    words = " ".join(e.text for e in essays("train")).split()[:n_tokens]
    messages: list[dict] = []
    for _ in range(4):  # the count scales with the words: a few corrections converge
        messages = [{"role": "user", "content": " ".join(words)}]
        body = {"model": model, "messages": messages}
        count = httpx.post(url + "/tokenize", json=body, headers=auth, timeout=60).json()["count"]
        if abs(count - n_tokens) <= 8:
            break
        words = (words * 2)[: max(1, round(len(words) * n_tokens / count))]
    return messages


def idle(url: str, seconds: float = 600.0) -> float:
    """Wait until nothing computes and no state is being built; returns the seconds waited."""
    import httpx

    t0 = time.perf_counter()
    while True:
        q = httpx.get(url + "/healthz", timeout=10).json()["queue"]
        if q["depth"] == 0 and not q["computing"] and not q.get("state_builds"):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > seconds:
            raise TimeoutError(f"the server did not go idle in {seconds:.0f} s: {q}")
        time.sleep(0.02)


def reply_end(
    url: str, model: str, auth: dict, messages: list[dict], max_tokens: int, extra: dict
) -> tuple[float, dict]:
    """Seconds from sending a streamed chat to its last event, and the `ctxrelay` report of its last chunk."""
    import json

    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, **extra}
    report: dict = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"ctxrelay"' in line:
                report = json.loads(line[6:])["ctxrelay"]
    return time.perf_counter() - t0, report


def end_ratio_check(url: str, model: str, auth: dict, opts: dict, repeats: int) -> tuple[dict, dict]:
    messages = prompt_of(url, model, auth, int(opts["first_turn_tokens"]))
    max_tokens = int(opts["first_turn_max_tokens"])
    kinds = {"state": {"conversation": "new"}, "no_state": {"conversation": "new", "store": False}}
    ends: dict[str, list[float]] = {k: [] for k in kinds}
    built_after: list[float] = []  # from the reply's end until its state was built
    reports = {}
    for _ in range(max(1, repeats)):
        for kind, extra in kinds.items():
            idle(url)
            s, reports[kind] = reply_end(url, model, auth, messages, max_tokens, extra)
            ends[kind].append(s)
            if kind == "state":
                built_after.append(idle(url))
    ratio = statistics.median(ends["state"]) / statistics.median(ends["no_state"])
    row = {"check": "first_turn_end_ratio", "value": ratio, "passed": ratio <= float(opts["end_ratio_max"])}
    detail = {
        "samples_s": ends, "median_s": {k: statistics.median(v) for k, v in ends.items()},
        "state_built_after_end_s": built_after, "prompt_tokens": reports["state"].get("context_tokens"),
        "next_state": {k: r.get("next_state") for k, r in reports.items()},
        "ttft_s": {k: r.get("ttft_s") for k, r in reports.items()},
    }  # fmt: skip
    return row, detail
