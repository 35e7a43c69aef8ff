"""`ctxrelay serve` as a real process, for the tests where the process is the point (its command
line, its signals, several of them sharing one Redis, one of them killed)."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from server_fixture import TEMPLATE

from local_redis import free_port

SRC = Path(__file__).resolve().parents[2] / "src"


def save_chat_model(m, path: Path) -> Path:
    """A tiny model as a local HF directory with a chat template (so the tokenizer's template path runs)."""
    tok = copy.deepcopy(m.tokenizer)
    tok.chat_template = TEMPLATE
    m.hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def serve_env(cache: Path, keys: str) -> dict[str, str]:
    """This checkout's code, its own cache (artifacts, profile), API keys, one torch thread."""
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "CTXRELAY_API_KEYS": keys, "CTXRELAY_CACHE": str(cache), "PYTHONPATH": path,
            "CTXRELAY_THREADS": "1"}  # fmt: skip


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_up(self, timeout_s: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"ctxrelay serve exited:\n{self.log()}"
            try:
                if httpx.get(self.url + "/healthz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"ctxrelay serve did not come up:\n{self.log()}"
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` (if still running) and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)


def launch(args: list[str], env: dict[str, str], log_dir: Path) -> Server:
    """Start `ctxrelay serve ARGS --port P` on loopback (not yet waiting for it: see Server.wait_up)."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "ctxrelay.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return Server(proc, f"http://127.0.0.1:{port}", log_path)
