"""A local redis-server for the tests that need a real one (a throwaway port, no persistence)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(work_dir: Path) -> tuple[subprocess.Popen, str]:
    """Start redis-server on a free loopback port (skips the test where it is not installed);
    returns the process and its URL. The caller kills it."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (make dev installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"
