"""What a peer client's turns did on the server: per turn, from the report the server answered with, and per
run, the summary the rows hold. Pure functions over recorded turns (proxy.py, alternation.py) and /metrics
text, so the tests run them on what a real run recorded."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import numpy as np

from ctxrelay.serve.chat import content_text

SAME_MODEL = ("native", "self")  # transports that are not a relay between models

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def counted(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much a series grew between two scrapes (0 for one that did not exist)."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def reuse_hits(before: dict[str, float], after: dict[str, float]) -> int:
    """Chat requests that read a stored state found by their messages (the server's own count)."""
    return int(counted(before, after, 'ctxrelay_content_reuse_total{result="hit"}'))


def turn_facts(turn: dict, count_tokens: Callable[[str], int]) -> dict:
    """One recorded turn: what the server reused and prefilled, against the tokens no stored state covered
    (the contents of the messages after the reused ones, in the serving model's tokenizer, as vLLM's client
    counts them). `overhead` is what the turn prefilled beyond those: the chat template's tokens."""
    r = turn.get("report") or {}
    msgs = turn["messages"]
    k = int(r.get("reused_messages") or 0)
    # as the server reads them: a string, or OpenAI's text parts (`vllm bench serve` sends those) joined
    uncovered = sum(count_tokens(content_text(m["content"], "content")) for m in msgs[k:])
    prefilled = r.get("prefilled_tokens")
    return {
        "model": turn.get("model"), "messages": len(msgs), "first": len(msgs) == 1, "status": turn.get("status"),
        "reuse": r.get("reuse", "none"), "reused_messages": k, "transport": r.get("transport"),
        "reason": r.get("reason"), "relayed_from": r.get("relayed_from"), "prefilled_tokens": prefilled,
        "uncovered_tokens": uncovered, "overhead": None if prefilled is None else prefilled - uncovered,
        "ttft_ms": turn.get("ttft_ms"),
        # the server's side of the client's TTFT: its compute, the wait for compute and for the state the
        # previous turn left (built after that reply, off its request path)
        "server_ttft_s": r.get("ttft_s"), "queue_wait_s": r.get("queue_wait_s"), "state_wait_s": r.get("state_wait_s"),
        "state_made": r.get("state_made"), "state_build_s": r.get("state_build_s"),
    }  # fmt: skip


def transport_mix(facts: list[dict]) -> str:
    """The row's `transport`: the one transport that served every turn, or `mixed`."""
    seen = {f["transport"] for f in facts}
    return seen.pop() if len(seen) == 1 else "mixed"


def summarize(facts: list[dict], hits: int, slack: int) -> dict:
    """The row's counts from per-turn facts and the server's hit count; with the bar's parts: every turn after
    a conversation's first reused a stored state, and each prefilled at most `slack` tokens beyond what no
    stored state covered."""
    later = [f for f in facts if not f["first"]]
    overheads = [f["overhead"] for f in later if f["overhead"] is not None]
    return {
        "turns": len(facts),
        "first_turns": sum(f["first"] for f in facts),
        "turns_reusing_state": hits,
        "turns_reported_reusing": sum(f["reuse"] != "none" for f in facts),
        "turns_relayed": sum(f["transport"] not in SAME_MODEL for f in facts),
        "failed_turns": sum(f["status"] != 200 for f in facts),
        "transports": dict(Counter(str(f["transport"]) for f in facts)),
        "prefill_overhead_max": max(overheads) if overheads else None,
        "prefill_overhead_min": min(overheads) if overheads else None,
        "later_turns_reusing": sum(f["reuse"] != "none" for f in later),
        "later_turns_within_slack": sum(o <= slack for o in overheads),
        "later_turns": len(later),
    }  # fmt: skip


def reuse_bar(summary: dict) -> bool:
    """vLLM's client against the server: state reused on every turn after the first (the server's count and
    each turn's report agree), and every such turn prefilled only the uncovered tokens plus the slack."""
    n = summary["later_turns"]
    return (
        n > 0 and summary["failed_turns"] == 0 and summary["turns_reusing_state"] == n
        and summary["later_turns_reusing"] == n and summary["later_turns_within_slack"] == n
    )  # fmt: skip


def percentiles_ms(values: list[float]) -> tuple[float | None, float | None]:
    """(p50, p90), linear between order statistics (pandas' describe() and numpy's default alike)."""
    if not values:
        return None, None
    return float(np.percentile(values, 50)), float(np.percentile(values, 90))
