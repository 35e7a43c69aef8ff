"""A tiny relay pool, a real server in a thread and a throwaway redis-server: what the tests and the
reliability bench run.

llama -> qwen2 has a heterofold edge that passes the gate: a zero-map artifact with a recorded
top-1 agreement, a cost profile that predicts it 10x faster than native prefill, and the quality
threshold at 0 (the explicit opt-in to gist-only speed; the maps are wrong by design).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ctxrelay.artifact import Artifact, model_binding
from ctxrelay.models.spec import LoadedModel
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.graph import CostModel, Profile, edge_key
from ctxrelay.serve.app import Settings, create_app
from ctxrelay.transports.heterofold import ARTIFACT_VERSION, TRANSPORT
from ctxrelay.transports.heterofold.align import layer_sources
from ctxrelay.transports.heterofold.kv_maps import AffineMap, FoldMaps
from ctxrelay.transports.heterofold.transfer import pair_params


def zero_artifact(sender: LoadedModel, receiver: LoadedModel) -> Artifact:
    """Cross-family artifact whose maps output zeros: whatever survives is native (the sink)."""
    sources = layer_sources(sender.spec.num_layers, receiver.spec.num_layers)
    dx = 3 * sender.spec.num_kv_heads * sender.spec.head_dim
    dy = receiver.spec.num_kv_heads * receiver.spec.head_dim
    zero = AffineMap(torch.zeros(dy), weight=torch.zeros(dx, dy))
    maps = FoldMaps(sources, {"k": [zero] * len(sources), "v": [zero] * len(sources)})
    return Artifact(
        TRANSPORT,
        ARTIFACT_VERSION,
        model_binding(sender),
        model_binding(receiver),
        maps.to_tensors(),
        pair_params(sender, receiver, sources, method="zero", pairing="ta"),
    )


def relay_pool(sender: LoadedModel, receiver: LoadedModel, artifact_dir: Path) -> ModelPool:
    art = zero_artifact(sender, receiver)
    art.quality = {"top1_agreement": 0.9}
    art.save(artifact_dir / "heterofold-zero.safetensors")
    samples = lambda per, key: [(n, {key: per * n}) for n in (64, 128, 256)]
    profile = Profile(
        native={receiver.spec.weights_hash: CostModel.fit(samples(1e-3, "prefill_s"))},
        edges={
            edge_key("heterofold", sender.spec.weights_hash, receiver.spec.weights_hash): CostModel.fit(
                samples(1e-4, "translate_s")
            )
        },
    )
    return ModelPool([sender, receiver], artifact_dirs=[artifact_dir], profile=profile, quality_threshold=0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(
    args: list[str], port: int, keys: str, wait_s: float, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`ctxrelay serve ARGS --port PORT` as a process of its own with API keys `keys` (key:tenant,...), once it
    answers /healthz; a server that exits or stays silent for `wait_s` is a UsageError with its stderr tail.
    `env`: variables set for it over this process's (a cache folder of its own, say)."""
    import os
    import sys
    import urllib.request

    from ctxrelay.errors import UsageError

    env = {**os.environ, **(env or {}), "CTXRELAY_API_KEYS": keys}
    cmd = [sys.executable, "-m", "ctxrelay.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UsageError(f"the server exited while starting: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise UsageError(f"the server did not answer /healthz within {wait_s:.0f} s")


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (a server lets in-flight requests finish, its engines stop)."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_redis(work_dir: Path) -> tuple[subprocess.Popen, str] | None:
    """redis-server on a free loopback port, no persistence (None where it is not installed); returns the
    process and its URL. The caller kills it."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    port = free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
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


def start(pool: ModelPool, settings: Settings) -> tuple[str, Callable[[], None]]:
    """Serve `pool` on a free loopback port in a thread; returns (url, stop)."""
    return serve_app(create_app(pool, settings))


def serve_app(app) -> tuple[str, Callable[[], None]]:
    """Serve an app made by create_app (a test reaches its engine) on a free loopback port in a thread."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop
