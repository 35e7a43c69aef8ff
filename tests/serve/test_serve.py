"""The HTTP server on tiny models: prefill, continue (self and native), tenants, bad input."""

import pytest
from fastapi.testclient import TestClient

from conftest import SAMPLE_TEXT
from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay.serve.app import create_app


@pytest.fixture(scope="module")
def client(tiny_by_family):
    pool = ModelPool([tiny_by_family["llama"], tiny_by_family["qwen2"]], artifact_dirs=[], profile=Profile())
    return TestClient(create_app(pool)), pool


def test_prefill_then_continue(client):
    c, pool = client
    llama, qwen = list(pool.models)
    r = c.post("/prefill", json={"sender": llama, "text": SAMPLE_TEXT}, headers={"X-Tenant": "acme"})
    assert r.status_code == 200 and r.json()["tokens"] > 10 and "kv" in r.json()["captured"]
    body = {"sender": llama, "receiver": llama, "text": SAMPLE_TEXT, "suffix": " Answer:", "max_new_tokens": 3}
    r = c.post("/continue", json=body, headers={"X-Tenant": "acme"})
    assert r.status_code == 200 and r.json()["transport"] == "self" and len(r.json()["tokens"]) == 3
    r = c.post("/continue", json=dict(body, receiver=qwen), headers={"X-Tenant": "acme"})
    assert r.json()["transport"] == "native" and "no calibrated artifact" in r.json()["reason"]


def test_other_tenant_gets_no_state(client):
    c, pool = client
    llama = next(iter(pool.models))
    c.post("/prefill", json={"sender": llama, "text": SAMPLE_TEXT}, headers={"X-Tenant": "acme"})
    body = {"sender": llama, "receiver": llama, "text": SAMPLE_TEXT, "suffix": " Answer:", "max_new_tokens": 1}
    r = c.post("/continue", json=body, headers={"X-Tenant": "globex"})
    assert r.status_code == 200 and r.json()["transport"] == "native" and "no stored state" in r.json()["reason"]


def test_bad_requests_are_clear(client):
    c, pool = client
    llama = next(iter(pool.models))
    r = c.post("/prefill", json={"sender": "gpt-99", "text": "x"}, headers={"X-Tenant": "acme"})
    assert r.status_code == 404 and "not served here" in r.json()["detail"]
    r = c.post("/prefill", json={"sender": llama, "text": ""}, headers={"X-Tenant": "acme"})
    assert r.status_code == 422
    r = c.post("/prefill", json={"sender": llama, "text": "x"})
    assert r.status_code == 422  # no tenant header
    body = {"sender": llama, "receiver": llama, "text": "x", "transport": "telepathy"}
    r = c.post("/continue", json=body, headers={"X-Tenant": "acme"})
    assert r.status_code == 400 and "transport must be one of" in r.json()["detail"]
    assert c.get("/graph").json()["edges"] == []
