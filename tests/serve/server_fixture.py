"""A real server on loopback for the serve tests: uvicorn in a thread over a tiny two-model pool
(ctxrelay_bench.harness, which the reliability bench shares)."""

from __future__ import annotations

from dataclasses import dataclass

from ctxrelay.relay import ModelPool
from ctxrelay.serve.app import Settings
from ctxrelay.serve.auth import load_keys
from ctxrelay_bench import harness as testing
from ctxrelay_bench.harness import free_port, relay_pool  # noqa: F401 - the serve tests import them from here

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


def start(pool: ModelPool, settings: Settings | None = None):
    """Serve `pool` on a free loopback port; returns (url, stop)."""
    return testing.start(pool, settings or Settings(keys=load_keys(env=KEYS)))
