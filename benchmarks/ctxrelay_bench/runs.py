"""Helpers every benchmark shares: its options over defaults, the command that reproduces a run,
markdown tables, and the timing guards (a quiet machine, the CPU share a timed call got)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ctxrelay.errors import UsageError


def bench_options(bench: str, options: dict | None, defaults: dict) -> dict:
    """A benchmark's options over its defaults; an unknown key is a clear error, not ignored."""
    unknown = sorted(set(options or {}) - set(defaults))
    if unknown:
        raise UsageError(f"unknown {bench} bench option(s) {unknown}; known: {sorted(defaults)}")
    return {**defaults, **(options or {})}


def bench_command(bench: str, sender: str, receiver: str, lengths, repeats: int, options: dict | None) -> str:
    """The `ctxrelay bench` line that reproduces a sender -> receiver run (when the caller passes none)."""
    sets = " ".join(f"--set {k}={v}" for k, v in (options or {}).items())
    return (
        f"ctxrelay bench {bench} --sender {sender} --receiver {receiver} "
        f"--lengths {','.join(map(str, lengths))} --repeats {repeats} {sets}"
    ).strip()


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies over all cores since boot, from /proc/stat (None off Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def machine_busy(sample_s: float = 1.0) -> float | None:
    """Share of all cores busy over `sample_s` seconds (call it while this process is idle)."""
    a = _cpu_ticks()
    time.sleep(sample_s)
    b = _cpu_ticks()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def wait_until_quiet(threshold: float = 0.25, max_wait_s: float = 0.0, poll_s: float = 10.0) -> float | None:
    """Wait (up to max_wait_s) until other work leaves the cores mostly idle; returns the last busy share.

    The machine is shared: a timing taken while another job computes measures that job too.
    """
    busy = machine_busy()
    deadline = time.monotonic() + max_wait_s
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        time.sleep(poll_s)
        busy = machine_busy()
    return busy


def timed_run(fn: Callable[[], object], threads: int | None = None) -> tuple[float, float]:
    """(wall seconds, CPU share) of one call; share = process CPU time / (wall x threads).

    A share well below 1 means other work took our cores during the call (the wall time then
    measures that contention, not our code). Single-threaded Python overhead also lowers it.
    """
    import torch

    threads = threads or torch.get_num_threads()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu / (wall * threads) if wall > 0 else 1.0
