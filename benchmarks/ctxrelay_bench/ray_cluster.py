"""A local Ray cluster for the tests and benchmarks of `serve --backend ray`: a head and one more node
process on 127.0.0.1, inside a network namespace that has only loopback.

Ray finds its node address by a UDP connect towards a public resolver; in a namespace with only `lo`
nothing can leave the machine, and every address Ray picks is 127.0.0.1. `in_loopback_namespace` wraps a
command so it runs there (root, `unshare --net`, then `ip link set lo up`); everything the command starts
(redis-server, the Ray nodes, the server, the client) lives in that namespace and ends with it.

Each node is a `ray start --block` process in a session of its own: stopping a node ends its process group
(GCS, raylet, the workers and replicas it started), by the id of the process this module started.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ctxrelay_bench.harness import free_port


def in_loopback_namespace(cmd: list[str]) -> list[str]:
    """`cmd` run inside a fresh network namespace with only loopback up."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]


def auth_env() -> dict[str, str]:
    """The environment of a driver that starts a LocalCluster: a token of this cluster's own for its nodes and
    the driver (Ray reads it when imported; without it `ray start` would write ~/.ray/auth_token)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def namespace_missing() -> str | None:
    """Why a loopback-only namespace cannot be made here (None: it can)."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return "unshare or ip is not installed (util-linux, iproute2)"
    try:
        r = subprocess.run(in_loopback_namespace(["true"]), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --net failed: {e}"
    return None if r.returncode == 0 else f"unshare --net failed (needs root): {r.stderr.strip()[:200]}"


def ray_missing() -> str | None:
    """Why Ray Serve cannot run here (None: it can): the server's own check, as its message."""
    from ctxrelay.errors import UsageError
    from ctxrelay.serve.ray_backend import require_ray

    try:
        require_ray()
    except UsageError as e:
        return str(e)
    return None


def namespace_rss_bytes() -> int:
    """Resident memory of every process in this process's network namespace: inside a loopback-only one, the
    Ray nodes with all they started (replicas included), redis-server and the driver."""
    mine = os.readlink("/proc/self/ns/net")
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.readlink(d / "ns" / "net") == mine:
                total += int((d / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class LocalCluster:
    """A head and `nodes - 1` more node processes on 127.0.0.1 (call inside a loopback-only namespace)."""

    work_dir: Path
    cpus_per_node: int = 2
    nodes: int = 2
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    procs: list[subprocess.Popen] = field(default_factory=list)
    address: str = ""
    temp_dir: str = ""

    def start(self, timeout_s: float = 120.0) -> str:
        """Start the nodes; returns the head's address once every node joined."""
        import ray

        port = free_port()
        self.address = f"127.0.0.1:{port}"
        if os.environ.get("RAY_AUTH_MODE") != "token" or not os.environ.get("RAY_AUTH_TOKEN"):
            raise RuntimeError("start the driver with auth_env() in its environment (Ray reads it at import)")
        base = ["ray", "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus_per_node}",
                "--disable-usage-stats"]  # fmt: skip
        # Ray's socket paths sit under its temp dir and must stay under 107 bytes: a short one of its own
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        head = [*base, "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
        self._launch(head, "head")
        _wait_port(port, timeout_s, self.procs[0])
        for i in range(1, self.nodes):
            self._launch([*base, f"--address={self.address}"], f"node{i}")
        ray.init(address=self.address, namespace="ctxrelay", logging_level="WARNING")
        deadline = time.monotonic() + timeout_s
        while sum(n["Alive"] for n in ray.nodes()) < self.nodes:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the Ray nodes did not all come up; see {self.work_dir}/ray-*.log")
            time.sleep(0.5)
        return self.address

    def _launch(self, cmd: list[str], name: str) -> None:
        ray_bin = str(Path(sys.executable).with_name("ray"))  # the ray of this interpreter's environment
        env = {**os.environ, **self.env, "RAY_USAGE_STATS_ENABLED": "0"}
        with (self.work_dir / f"ray-{name}.log").open("w") as log:
            p = subprocess.Popen([ray_bin, *cmd[1:]], env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        self.procs.append(p)
        with (self.work_dir / "ray-pgids").open("a") as f:  # for a caller that must clean up after a crash
            f.write(f"{p.pid}\n")

    @property
    def pgids(self) -> set[int]:
        return {p.pid for p in self.procs}

    def stop(self, grace_s: float = 10.0) -> None:
        """End every process the nodes started: SIGTERM to each node's group, SIGKILL after `grace_s`."""
        try:
            import ray

            ray.shutdown()
        except Exception:
            pass
        kill_groups(self.pgids, grace_s, reap=lambda: [p.poll() for p in self.procs])
        for p in self.procs:
            p.wait(timeout=5)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def kill_groups(pgids: set[int], grace_s: float = 10.0, reap=None) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, to each of these process groups (ids this caller started).
    `reap` collects the exited leaders that are this process's children (a zombie still counts as alive)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, sig)
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            if reap is not None:
                reap()
            if not _alive(pgids):
                break
            time.sleep(0.2)


def _alive(pgids: set[int]) -> bool:
    for g in pgids:
        try:
            os.killpg(g, 0)
            return True
        except ProcessLookupError:
            continue
    return False


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head did not open port {port} (exit {proc.poll()})")
        time.sleep(0.2)
