"""API keys -> tenants. A request's tenant comes only from its key, never from the body.

Keys come from a keys file (`--keys FILE`: one `KEY TENANT` or `KEY:TENANT` a line, `#` comments)
and/or CTXRELAY_API_KEYS="key1:tenantA,key2:tenantB"; clients send `Authorization: Bearer KEY`
(what the openai client sends for `api_key=`). Only SHA-256 digests of the keys are kept.

With no keys at all the server runs open as the single tenant `local`, and only on a loopback
host: anyone who can reach an open port would share that tenant's conversations, so binding any
other address without keys refuses to start.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from pathlib import Path

from fastapi import Request

from ctxrelay.errors import UsageError
from ctxrelay.serve.errors import ApiError

ENV = "CTXRELAY_API_KEYS"
OPEN_TENANT = "local"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _pair(item: str, where: str) -> tuple[str, str]:
    key, sep, tenant = item.strip().replace(" ", ":", 1).partition(":")
    key, tenant = key.strip(), tenant.strip()
    if not sep or not key or not tenant:
        raise UsageError(f"{where}: expected KEY:TENANT (or KEY TENANT), got {item.strip()[:8]!r}...")
    return key, tenant


def load_keys(path: str | Path | None = None, env: str | None = None) -> dict[str, str]:
    """{sha256(key): tenant} from the keys file and the env var (None: read CTXRELAY_API_KEYS)."""
    pairs: list[tuple[str, str]] = []
    if path:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"keys file {p} does not exist (one `KEY TENANT` a line)")
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                pairs.append(_pair(line, f"{p}:{n}"))
    env = os.environ.get(ENV, "") if env is None else env
    pairs += [_pair(item, ENV) for item in env.split(",") if item.strip()]
    return {_digest(k): t for k, t in pairs}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, keys: dict[str, str]) -> None:
    if not keys and not is_loopback(host):
        raise UsageError(
            f"no API keys configured: refusing to serve on {host} open to anyone who reaches it; "
            f"pass --keys FILE or set {ENV}=key:tenant,..., or bind 127.0.0.1"
        )


class Auth:
    """The FastAPI dependency that turns a request's key into its tenant (401 otherwise)."""

    def __init__(self, keys: dict[str, str]):
        self.keys = keys

    async def __call__(self, request: Request) -> str:  # async: no worker thread for a dict lookup
        if not self.keys:
            return OPEN_TENANT
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send `Authorization: Bearer KEY` (openai client: api_key=KEY)")
        tenant = self.keys.get(_digest(key.strip()))
        if tenant is None:
            raise ApiError(401, "invalid API key: ask the operator for a key listed in the server's keys")
        return tenant
