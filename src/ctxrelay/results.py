"""Results files (schema: docs/results-schema.md) and the machine facts every timing records.

`write_results` writes benchmarks/results/NAME.json: {"command", "machine", "rows", ...extra}.
Rows carry only keys that were measured; NaN or infinite numbers are refused rather than written.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

from ctxrelay import results_index
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


@functools.cache  # a machine's flags do not change while a process runs
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AMX or AVX512-bf16); elsewhere it is emulated, slower than fp32."""
    return bool({"amx_tile", "avx512_bf16"} & cpu_flags())


def bf16_native(isa: str, bf16: bool | None = None) -> bool:
    """Whether a CPU of ISA class `isa` multiplies bf16 natively (`bf16`: its AVX512-bf16 flag; default: this
    CPU's): AMX, or AVX512 with its bf16 extension (AMD Zen 4, Intel Cooper Lake on)."""
    return isa == "amx" or (isa == "avx512" and (cpu_bf16() if bf16 is None else bf16))


def cpu_isa() -> str:
    """The fastest matrix ISA this CPU offers to torch's and vLLM's kernels: amx | avx512 | avx2 | other.

    Timings differ about 3x between these classes, so every results file names it."""
    flags = cpu_flags()
    if "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


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
        "isa": cpu_isa(),
        "bf16": cpu_bf16(),
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
    name: str | Path, rows: list[dict], command: str, extra: dict | None = None, machine: dict | None = None
) -> Path:
    """Write benchmarks/results/NAME.json (or $CTXRELAY_RESULTS_DIR/NAME.json; NAME may also be a .json path)
    atomically. `machine`: the facts of the machine that measured the rows, where this process only re-derives
    tables."""
    if not command or not isinstance(command, str):
        raise UsageError("write_results needs the exact command that reproduces the rows")
    validate_rows(rows)
    extra = dict(extra or {})
    clash = [k for k in extra if k in RESERVED]
    if clash:
        raise UsageError(f"extra may not override {clash}: they are written by write_results itself")
    _check_value("extra", extra)
    path = results_file(name)
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
    results_index.refresh(path.parent)
    return path


def results_file(name_or_path: str | Path) -> Path:
    """A results name (under benchmarks/results) or a .json path, as the file it names."""
    path = Path(name_or_path)
    return path if path.suffix == ".json" else results_path(str(name_or_path))


def read_results(name_or_path: str | Path) -> dict:
    path = results_file(name_or_path)
    if not path.exists():
        raise UsageError(f"no results file at {path}; run the benchmark that writes it first")
    return json.loads(path.read_text())
