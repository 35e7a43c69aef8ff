"""The classes behind `ctxrelay serve --backend ray` (ray_backend.py turns them into Ray Serve deployments).

`ModelReplica`: one replica of one served model. It runs the whole existing server (app.create_app over a
ModelPool, the native engine) and is sent only the requests for its model; conversations and states live in
Redis (shared_sessions.py, the state store's Redis tier), so any replica of any model continues any
conversation and a replica that dies loses nothing its turns saved. The pool loads every served model (a
relay into this model reads the sender's spec and tokenizer), but this replica computes only its own.

`Ingress`: the HTTP entry. It reads the request's `model` (or /continue's `receiver`, /prefill's `sender`)
and hands the request to a replica of that model's deployment, streaming the answer back; requests naming
no model (/healthz, /metrics, /v1/models, ...) go to the first model's. A request whose replica died before
it answered is sent again (the router then picks a live replica; the dead one saved nothing of that turn
unless its answer had been built, see docs/serving.md).

Neither imports Ray at import time: the library imports without the `ray` extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ctxrelay.serve.errors import error_body

log = logging.getLogger("ctxrelay.serve")

REPLICA_HEADER = "x-ctxrelay-replica"  # which replica served the request (its Ray actor name)
_MODEL_FIELD = {"/continue": "receiver", "/prefill": "sender"}  # the model that computes; elsewhere `model`


@dataclass
class RayConfig:
    """What every replica needs to build its server (pickled to the replicas)."""

    models: list[str]  # as given to --models (zoo names or local HF directories)
    store: str  # must hold a redis:// tier: the replicas share states and conversations through it
    quality_threshold: float
    settings: object  # app.Settings (kept untyped here: app.py is imported in the replica only)
    replicas: dict[str, int] = field(default_factory=dict)  # per --models entry; 1 where absent
    replica_cpus: float = 1.0  # Ray's CPU reservation per model replica
    threads: int = 0  # torch threads per replica (0: the replica's CPU reservation, at least 1)
    env: dict[str, str] = field(default_factory=dict)  # CTXRELAY_* (cache, keys) and PYTHONPATH for the replicas
    retry_s: float = 60.0  # how long the ingress resends a request whose replica died


class ModelReplica:
    """One replica of `config.models[index]`: the existing app in this process, reached through `forward`."""

    def __init__(self, config: RayConfig, index: int):
        import torch

        from ctxrelay.relay.api import ModelPool
        from ctxrelay.serve.app import create_app

        torch.set_num_threads(config.threads or max(1, int(config.replica_cpus)))
        pool = ModelPool(config.models, store=config.store, quality_threshold=config.quality_threshold)
        self.model = list(pool.models)[index]  # the pool keys models by spec name, in --models order
        self.app = create_app(pool, config.settings)
        self.replica = _actor_name()

    async def served(self) -> str:
        """The model this replica computes (its spec name: what requests name)."""
        return self.model

    async def forward(self, req: dict) -> AsyncIterator[dict | bytes]:
        """Run one HTTP request through the app: yields its start (`status`, `headers`), then body chunks.
        A caller that stops listening (the client went away) disconnects the app's request, which cancels
        its turn as in a local server."""
        sent: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        body = [{"type": "http.request", "body": req["body"], "more_body": False}]

        async def receive() -> dict:
            if body:
                return body.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await sent.put(message)

        task = asyncio.create_task(self.app(_scope(req), receive, send))
        try:
            while True:
                message = await _next(sent, task)
                if message is None:  # the app ended without a complete response (it raised)
                    return
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                    yield {"status": message["status"], "headers": [*headers, (REPLICA_HEADER, self.replica)]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:
            gone.set()
            try:
                await asyncio.wait_for(task, 5.0)
            except Exception as e:  # the app already answered what it could (its 500 handler logs)
                log.debug("replica request ended with %r", e)


async def _next(queue: asyncio.Queue, task: asyncio.Task) -> dict | None:
    """The app's next ASGI message, or None once the app finished without sending one."""
    getter = asyncio.ensure_future(queue.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return None if queue.empty() else queue.get_nowait()


def _scope(req: dict) -> dict:
    path = req["path"]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req["method"],
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": req["query"].encode(), "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                                           for k, v in req["headers"]],
        "client": tuple(req["client"]), "server": ("127.0.0.1", 80), "state": {},
    }  # fmt: skip


def _actor_name() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_actor_name() or f"pid-{os.getpid()}"
    except Exception:  # outside Ray (a test building the class directly)
        return f"pid-{os.getpid()}"


def model_of(path: str, body: bytes) -> str | None:
    """The model a request computes on, read from its JSON body (None: no model, or not JSON)."""
    if not body:
        return None
    try:
        value = json.loads(body).get(_MODEL_FIELD.get(path, "model"))
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class Ingress:
    """Routes each HTTP request to a replica of the model it names (`handles`: deployment handles, in
    --models order)."""

    def __init__(self, handles: list, max_body_bytes: int, retry_s: float = 60.0):
        from ray.exceptions import ActorUnavailableError, RayActorError

        self.handles, self.max_body_bytes, self.retry_s = handles, max_body_bytes, retry_s
        self._died = (RayActorError, ActorUnavailableError)
        self._routes: dict[str, object] = {}

    async def _route(self, model: str | None):
        if not self._routes:  # each deployment says which model it computes (its spec name)
            names = await asyncio.gather(*(h.served.remote() for h in self.handles))
            self._routes = dict(zip(names, self.handles, strict=True))
        return self._routes.get(model or "", self.handles[0])  # unknown models: the app answers 404

    async def __call__(self, request: Request) -> Response:
        body = await _read(request, self.max_body_bytes)
        if body is None:
            msg = f"request body is over this server's limit of {self.max_body_bytes} bytes (--max-body-mb)"
            return JSONResponse(error_body(413, msg), status_code=413)
        req = {
            "method": request.method, "path": request.url.path, "query": request.url.query, "body": body,
            "headers": list(request.headers.items()), "client": list(request.client or ("127.0.0.1", 0)),
        }  # fmt: skip
        handle = await self._route(model_of(req["path"], body))
        deadline, wait = time.monotonic() + self.retry_s, 0.2
        while True:
            stream = handle.options(stream=True).forward.remote(req)
            try:
                head = await stream.__anext__()
                break
            except self._died as e:  # the replica died before it answered: another one serves it
                if time.monotonic() > deadline:
                    msg = f"no replica of the model answered within {self.retry_s:g} s ({type(e).__name__}); retry"
                    return JSONResponse(error_body(503, msg), status_code=503, headers={"Retry-After": "5"})
                log.warning("replica died before answering (%s); sending the request again", type(e).__name__)
                await asyncio.sleep(wait)
                wait = min(2.0, wait * 2)
        headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
        return StreamingResponse(_rest(stream), status_code=head["status"], headers=headers)


async def _rest(stream) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk


async def _read(request: Request, limit: int) -> bytes | None:
    """The whole body, or None once it is over `limit` (declared or counted)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    out = bytearray()
    async for chunk in request.stream():
        out += chunk
        if len(out) > limit:
            return None
    return bytes(out)
