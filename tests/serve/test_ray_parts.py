"""The parts of `serve --backend ray` that need no Ray cluster: the options, the refusals before Ray starts,
how the ingress reads a request's model, and a replica's bridge from a handle call to the app (the same
app a local server runs, over the tiny relay pool)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from server_fixture import KEYS, relay_pool

from ctxrelay.errors import UsageError
from ctxrelay.serve.app import Settings, create_app
from ctxrelay.serve.auth import load_keys
from ctxrelay.serve.ray_backend import check, parse_replicas, require_ray
from ctxrelay.serve.ray_models import REPLICA_HEADER, ModelReplica, RayConfig, model_of


def test_replicas_per_model():
    models = ["a", "b"]
    assert parse_replicas("", models) == {"a": 1, "b": 1}
    assert parse_replicas("3", models) == {"a": 3, "b": 3}
    assert parse_replicas("b=2", models) == {"a": 1, "b": 2}
    for bad in ("c=2", "a=0", "a", "a=x"):
        with pytest.raises(UsageError, match="--replicas"):
            parse_replicas(bad, models)


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as on an install without the extra: import ray fails
    with pytest.raises(UsageError, match=r'pip install "ctxrelay\[ray\]"'):
        require_ray()


def test_the_ray_backend_needs_a_redis_store_and_the_native_engine():
    pytest.importorskip("ray.serve", reason='Ray Serve is not installed: pip install "ctxrelay[ray]"')
    config = RayConfig(["a"], "memory", 0.85, Settings())
    with pytest.raises(UsageError, match="redis://"):
        check(config, "native")
    config.store = "memory+redis://127.0.0.1:6379/0"
    with pytest.raises(UsageError, match="--engine native"):
        check(config, "vllm")
    check(config, "native")


def test_the_ingress_routes_by_the_model_that_computes():
    body = lambda **kw: json.dumps(kw).encode()
    assert model_of("/v1/chat/completions", body(model="m", messages=[])) == "m"
    assert model_of("/continue", body(sender="s", receiver="r")) == "r"
    assert model_of("/prefill", body(sender="s", text="t")) == "s"
    assert model_of("/v1/chat/completions", b"not json") is None
    assert model_of("/v1/chat/completions", body(model=3)) is None
    assert model_of("/healthz", b"") is None


def _replica(pool) -> ModelReplica:
    """A replica's request bridge over an app built here (the Ray deployment builds the same in __init__)."""
    r = ModelReplica.__new__(ModelReplica)
    r.model, r.app, r.replica = pool.models[next(iter(pool.models))].spec.name, None, "replica-1"
    r.app = create_app(pool, Settings(keys=load_keys(env=KEYS)))
    return r


def _forward(r: ModelReplica, path: str, body: dict | None, method: str = "POST") -> tuple[dict, bytes]:
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [("authorization", "Bearer k-acme"), ("content-type", "application/json"),
               ("content-length", str(len(raw)))]  # fmt: skip
    req = {"method": method, "path": path, "query": "", "body": raw, "headers": headers, "client": ["127.0.0.1", 1]}

    async def run() -> tuple[dict, bytes]:
        parts = [p async for p in r.forward(req)]
        return parts[0], b"".join(parts[1:])

    return asyncio.run(run())


def test_a_replica_runs_the_app_for_a_handle_call(tiny_by_family, tmp_path):
    pool = relay_pool(tiny_by_family["llama"], tiny_by_family["qwen2"], tmp_path)
    r = _replica(pool)
    model = r.model
    head, body = _forward(r, "/v1/chat/completions", {"model": model, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "Hi?"}]})  # fmt: skip
    assert head["status"] == 200 and (REPLICA_HEADER, "replica-1") in head["headers"]
    assert json.loads(body)["ctxrelay"]["transport"] == "native"
    head, body = _forward(r, "/v1/chat/completions", {"model": model, "max_tokens": 4, "stream": True,
                                                      "messages": [{"role": "user", "content": "Hi?"}]})  # fmt: skip
    assert head["status"] == 200 and body.rstrip().endswith(b"data: [DONE]")  # the stream, chunk by chunk
    head, body = _forward(r, "/v1/chat/completions", {"model": "nope", "messages": []})
    assert head["status"] == 404 and "not served here" in json.loads(body)["error"]["message"]
    head, _ = _forward(r, "/healthz", None, "GET")
    assert head["status"] == 200
