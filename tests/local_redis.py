"""A local redis-server for the tests that need a real one (a throwaway port, no persistence)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ctxrelay_bench import harness as testing
from ctxrelay_bench.harness import free_port  # noqa: F401 - tests import it from here


def start_redis(work_dir: Path) -> tuple[subprocess.Popen, str]:
    """Start redis-server on a free loopback port (skips the test where it is not installed);
    returns the process and its URL. The caller kills it."""
    started = testing.start_redis(work_dir)
    if started is None:
        pytest.skip("redis-server is not installed (make dev installs it)")
    return started
