"""`ctxrelay bench reliability`: fuzzed files, injected faults, crash safety, tenant isolation and bad
input at every door, on tiny models; writes benchmarks/results/reliability.json.

Every number in the file is counted while the cases run (fuzz.py, store_checks.py,
interfaces.py); the targets are checked from them and written beside them.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ctxrelay.errors import UsageError
from ctxrelay.transports.base import keys_from

OPTIONS = {"fuzz_cases": 1000, "tenant_cases": 300, "kills": 25, "contexts": 300, "cli_cases": "all"}
# `ctxrelay bench reliability --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "fuzz_cases": "fuzzed inputs per deserializer",
        "tenant_cases": "cross-tenant requests",
        "kills": "SIGKILLs mid-write",
        "contexts": "contexts the memory-budget check stores",
        "cli_cases": "CLI bad-input cases run (all, or the first N)",
    },
)
BAR = {"fuzz_cases_per_deserializer": 1000, "fault_kinds": 5, "sigkill_repeats": 20}
FUZZ_CATEGORY = "fuzz: "
TOTALS = ("cases", "faults_injected", "requests", "requests_failed", "entries_lost", "entries_corrupt", "unhandled")
COLUMNS = TOTALS  # the README table's columns


def run(options: dict | None = None, root: Path | None = None) -> list[dict]:
    """Every category once; the rows of reliability.json."""
    try:
        from ctxrelay_bench.reliability import fuzz
        from ctxrelay_bench.reliability import interfaces as doors
        from ctxrelay_bench.reliability import store_checks as stores
    except ImportError as e:  # hypothesis is in the dev extra
        raise UsageError(f"bench reliability needs the dev extra (pip install -e '.[dev]'): {e}") from None
    from ctxrelay.models.tiny import tiny_model
    from ctxrelay.relay.api import ModelPool
    from ctxrelay.relay.graph import Profile

    opts = {**OPTIONS, **(options or {})}
    root = root or Path(tempfile.mkdtemp(prefix="ctxrelay-reliability-"))
    llama, qwen, other = tiny_model("llama"), tiny_model("qwen2"), tiny_model("llama", seed=1)
    pool = ModelPool([llama], artifact_dirs=[root / "no-artifacts"], profile=Profile())
    rows = []

    def add(category: str, fn) -> None:
        t = time.perf_counter()
        count = fn()
        rows.append({**count.row(category), "seconds": round(time.perf_counter() - t, 2)})

    for name, target in fuzz.targets().items():
        add(FUZZ_CATEGORY + name, lambda t=target: _fuzz_count(fuzz.run(t, opts["fuzz_cases"]), stores.Count))
    add("tenant isolation", lambda: stores.tenant_isolation(pool, llama.name, root / "tenants", opts["tenant_cases"]))
    add("disk faults (ENOSPC, EROFS, EIO at each write call)", lambda: stores.disk_faults(pool, llama.name, root))
    add("tampered store entries", lambda: stores.tampered_entries(pool, llama.name, root))
    add("SIGKILL mid-write", lambda: stores.sigkill_mid_write(root / "kill", opts["kills"]))
    add("two processes, one key", lambda: stores.same_key_race(root / "race"))
    add("memory budget (LRU, pins)", lambda: stores.memory_budget(opts["contexts"]))
    add("redis faults (maxmemory, slowed, SIGSTOP, killed)", lambda: stores.redis_faults(pool, llama.name, root))
    add("model swap under an artifact", lambda: doors.model_swap(llama, other, qwen, root / "swap"))
    add("bad input: Python API", lambda: doors.python_api(pool, llama.name))
    only = None if opts["cli_cases"] == "all" else int(opts["cli_cases"])
    add("bad input: CLI", lambda: doors.cli(root / "cli", only))
    with doors.server(llama, qwen, root / "http", max_queue=2) as (url, _):
        add("bad input and keys: HTTP", lambda: doors.http_doors(url, llama.name, qwen.name))
        add("concurrency: one conversation, a burst past the queue", lambda: doors.concurrency(url, llama.name))
    return rows


def _fuzz_count(tally, Count):
    c = Count(cases=tally.cases, unhandled=tally.outcomes.get("unhandled", 0))
    c.entries_corrupt = tally.outcomes.get("corrupt", 0)  # damaged content accepted as valid
    c.details = {k: v for k, v in tally.as_dict().items() if k != "cases"}
    return c


def summary(rows: list[dict]) -> dict:
    """Totals, and the bar checked against the counts."""
    totals = {k: sum(r[k] for r in rows) for k in TOTALS}
    fuzz_rows = [r for r in rows if r["category"].startswith(FUZZ_CATEGORY)]
    kinds = {k for r in rows if r["faults_injected"] for k in r["details"]["kinds"]}
    kill = next((r for r in rows if r["category"] == "SIGKILL mid-write"), {"cases": 0})
    checks = {
        "fuzz_cases_per_deserializer": min((r["cases"] for r in fuzz_rows), default=0),
        "fault_kinds": len(kinds),
        "sigkill_repeats": kill["cases"],
    }
    met = all(checks[k] >= v for k, v in BAR.items()) and not any(
        totals[k] for k in ("unhandled", "requests_failed", "entries_lost", "entries_corrupt")
    )
    return {"totals": totals, "fault_kinds": sorted(kinds), "bar": BAR, "measured": checks, "bar_met": met}


def table(doc: dict) -> str:
    """The README's reliability table, from a results file: one row per category and the totals."""
    from ctxrelay_bench.runs import markdown_table

    head = ["category", "cases tried", "faults injected", "requests made", "requests failed",
            "entries lost", "entries corrupt", "unhandled"]  # fmt: skip
    rows = [[r["category"], *(str(r[k]) for k in COLUMNS)] for r in doc["rows"]]
    rows.append(["**total**", *(f"**{doc['totals'][k]}**" for k in COLUMNS)])
    return "\n".join(markdown_table(head, rows))


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (),
    repeats: int = 1,
    out: str = "reliability",
    options: dict | None = None,
    command: str = "",
) -> Path:
    from ctxrelay.results import read_results, write_results
    from ctxrelay_bench.runs import bench_options

    opts = bench_options("reliability", options, OPTIONS)
    if model or sender or receiver:
        raise UsageError("bench reliability runs on tiny random models: it takes no --model/--sender/--receiver")
    logging.getLogger("ctxrelay").setLevel(logging.ERROR)  # the injected faults log a warning each
    rows = run(opts)
    extra = {"options": opts, **summary(rows)}
    path = write_results(out, rows, command or "ctxrelay bench reliability", extra)
    print(table(read_results(path)))
    return path
