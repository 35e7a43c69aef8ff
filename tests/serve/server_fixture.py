"""A real server on loopback for the serve tests: uvicorn in a thread over a tiny two-model pool.

llama -> qwen2 has a heterofold edge that passes the gate: a zero-map artifact (conftest) with a
recorded top-1 agreement, a cost profile that predicts it 10x faster than native prefill, and the
quality threshold at 0 (the explicit opt-in to gist-only speed; the maps are wrong by design).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from conftest import zero_artifact
from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import CostModel, Profile, edge_key
from ctxrelay.serve.app import Settings, create_app
from ctxrelay.serve.auth import load_keys

KEYS = "k-acme:acme,k-globex:globex"
# a chat template of the usual shape: writes BOS, refuses a conversation that starts with the assistant
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' and loop.first %}"
    "{{ raise_exception('must start with user') }}{% endif %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    pool: ModelPool
    sender: str
    receiver: str


def relay_pool(sender, receiver, artifact_dir) -> ModelPool:
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


def start(pool: ModelPool, settings: Settings | None = None):
    """Serve `pool` on a free loopback port; returns (url, stop)."""
    settings = settings or Settings(keys=load_keys(env=KEYS))
    port = free_port()
    config = uvicorn.Config(create_app(pool, settings), host="127.0.0.1", port=port, log_level="warning")
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
