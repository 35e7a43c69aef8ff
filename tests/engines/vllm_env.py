"""Where the engine tests find vLLM's CPU build (`make vllm` makes its venv), and why they skip without it."""

from __future__ import annotations

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
