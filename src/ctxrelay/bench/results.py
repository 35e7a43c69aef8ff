"""Benchmark results files (DESIGN.md section 5) and the machine facts every timing records.

`write_results` writes benchmarks/results/NAME.json: {"command", "machine", "rows", ...extra}.
Rows carry only keys that were measured; NaN or infinite numbers are refused rather than written.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ctxrelay.errors import UsageError
from ctxrelay.paths import repo_root, results_path

RESERVED = ("command", "machine", "rows")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def git_commit(root: Path) -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() or None if res.returncode == 0 else None


def machine_facts() -> dict:
    """Facts that decide a timing: cores, torch threads, device, CPU model, library versions."""
    import torch
    import transformers

    facts = {
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if facts["device"] == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def _check_value(where: str, value) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UsageError(f"{where} is {value}: leave a key out instead of writing a non-finite number")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise UsageError(f"{where} has a non-string key {k!r}")
            _check_value(f"{where}.{k}", v)
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_value(f"{where}[{i}]", v)
        return
    raise UsageError(f"{where} is a {type(value).__name__}; results hold only JSON numbers, strings, lists, dicts")


def validate_rows(rows: list[dict]) -> None:
    """Every row is a dict naming its transport, with plain finite JSON values."""
    if not isinstance(rows, list):
        raise UsageError(f"rows must be a list of dicts, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UsageError(f"rows[{i}] is a {type(row).__name__}, not a dict")
        if not isinstance(row.get("transport"), str):
            raise UsageError(f"rows[{i}] lacks a 'transport' string (native, mapflow, heterofold, ...)")
        if "context_tokens" in row and not (isinstance(row["context_tokens"], int) and row["context_tokens"] > 0):
            raise UsageError(f"rows[{i}].context_tokens must be a positive int, got {row['context_tokens']!r}")
        _check_value(f"rows[{i}]", row)


def write_results(
    name: str, rows: list[dict], command: str, extra: dict | None = None, machine: dict | None = None
) -> Path:
    """Write benchmarks/results/NAME.json (or $CTXRELAY_RESULTS_DIR/NAME.json) atomically. `machine`:
    the facts of the machine that measured the rows, where this process only re-derives tables."""
    if not command or not isinstance(command, str):
        raise UsageError("write_results needs the exact command that reproduces the rows")
    validate_rows(rows)
    extra = dict(extra or {})
    clash = [k for k in extra if k in RESERVED]
    if clash:
        raise UsageError(f"extra may not override {clash}: they are written by write_results itself")
    _check_value("extra", extra)
    path = results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": command, "machine": machine or machine_facts(), "rows": list(rows)}
    root = repo_root()
    commit = git_commit(root) if root else None
    if commit:
        doc["git_commit"] = commit
    doc["written"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc.update(extra)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


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


def results_file(name_or_path: str | Path) -> Path:
    """A results name (under benchmarks/results) or a .json path, as the file it names."""
    path = Path(name_or_path)
    return path if path.suffix == ".json" else results_path(str(name_or_path))


def read_results(name_or_path: str | Path) -> dict:
    path = results_file(name_or_path)
    if not path.exists():
        raise UsageError(f"no results file at {path}; run the benchmark that writes it first")
    return json.loads(path.read_text())


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
