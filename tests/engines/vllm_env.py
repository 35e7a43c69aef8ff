"""Where the engine tests find vLLM's CPU build (`make vllm` makes its venv), and why they skip without it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("CTXRELAY_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    if not VLLM_PYTHON.exists():
        return f"no vLLM venv at {VLLM_PYTHON} (`make vllm` makes it)"
    res = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    return None if res.returncode == 0 else f"vLLM does not import here: {res.stderr.strip().splitlines()[-1:]}"


def record_checks(name: str, rows: list[dict], command: str, extra: dict | None = None) -> Path:
    """Merge check rows (`check`, `passed`, `detail`) into benchmarks/results/NAME.json: each row carries the
    command that made it, the file keeps the rows of other checks (several scripts and tests write one checks
    file) and its command lists every row's."""
    from ctxrelay.results import results_file, write_results

    rows = [{**r, "command": command} for r in rows]
    path = results_file(name)
    if path.exists():
        ours, old = {r["check"] for r in rows}, json.loads(path.read_text())
        rows = [{"command": old["command"], **r} for r in old["rows"] if r.get("check") not in ours] + rows
    commands = " && ".join(dict.fromkeys(r["command"] for r in rows))
    return write_results(name, rows, commands, extra)
