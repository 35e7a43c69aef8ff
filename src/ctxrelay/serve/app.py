"""The HTTP server over a ModelPool: the OpenAI API (openai_api.py) and ctxrelay's own endpoints.

Every endpoint but /healthz and /metrics needs an API key (auth.py); the tenant comes from the key,
never from the request, so one tenant cannot name another's state or conversation. /prefill and
/continue are the relay's own JSON API (prefill a text once, continue it on any model).

The handlers that compute are async: admission (429), /healthz and /metrics answer on the event
loop whatever the models are doing, and the compute runs in a thread per admitted request
(turns.py). Bodies over `max_body_bytes` are refused (413) before they are parsed (bodies.py).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from ctxrelay.engines.vllm_server import EngineConfig
from ctxrelay.errors import UsageError
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.gate import requestable
from ctxrelay.relay.store import StateKey
from ctxrelay.serve import errors
from ctxrelay.serve.auth import Auth
from ctxrelay.serve.bodies import BodyLimit, CountRequests
from ctxrelay.serve.compute import one_malloc_arena
from ctxrelay.serve.engine import Engine
from ctxrelay.serve.errors import ApiError
from ctxrelay.serve.health import Health, down
from ctxrelay.serve.metrics import CountedStore, Metrics
from ctxrelay.serve.openai_api import Limits, router
from ctxrelay.serve.sessions import Conversations
from ctxrelay.serve.shared_sessions import open_sessions
from ctxrelay.serve.tokenize_api import router as tokenize_router
from ctxrelay.serve.turns import in_thread


@dataclass
class Settings:
    keys: dict[str, str] = field(default_factory=dict)  # sha256(key) -> tenant (auth.load_keys); empty: open
    max_queue: int = 32  # requests admitted (running or waiting); more get 429
    request_timeout_s: float = 300.0  # longest wait for the compute lock before 503
    max_sessions: int = 1000  # conversations held; the least recently used goes first
    max_state_bytes: int = 4 << 30  # states they hold; past it the least recently used lose theirs
    # where conversations live: "auto" (Redis when the state store has a Redis tier, else memory),
    # "memory" (this process), "redis://HOST:PORT/DB" (shared by every process using it; shared_sessions.py)
    sessions: str = "auto"
    session_lock_ttl_s: float = 30.0  # how long a killed process can keep a Redis conversation locked
    max_body_bytes: int = 4 << 20  # larger request bodies get 413 before they are read in full
    limits: Limits = field(default_factory=Limits)
    # who prefills and decodes: "native" (ctxrelay's runner, in this process) or "vllm" (one vLLM engine per
    # model, started by the server; vllm_engine.py); the vLLM engines' mode, dtype and KV space
    engine: str = "native"
    engine_config: EngineConfig = field(default_factory=EngineConfig)


class PrefillRequest(BaseModel):
    sender: str
    text: str = Field(min_length=1)


class ContinueRequest(BaseModel):
    sender: str = Field(description="the model whose stored state of `text` to continue from")
    receiver: str
    text: str = Field(min_length=1, description="the shared context, exactly as the sender read it")
    suffix: str = ""
    transport: str = "auto"
    max_new_tokens: int = Field(32, ge=1, le=1024)
    temperature: float = Field(0.0, ge=0.0)
    quality_threshold: float | None = Field(None, ge=0.0, le=1.0)


def create_app(pool: ModelPool, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    one_malloc_arena()  # before the app's threads: a turn's thread computes from the warm main arena
    app = FastAPI(title="ctxrelay", version="0.1.0", lifespan=_closes_engine)
    errors.install(app)
    metrics = Metrics()
    inner = pool.store.inner if isinstance(pool.store, CountedStore) else pool.store
    pool.store = CountedStore(inner, metrics)  # the server owns its pool: count what it stores
    sessions = open_sessions(
        settings.sessions, pool.store, max_sessions=settings.max_sessions, max_state_bytes=settings.max_state_bytes,
        lock_ttl_s=settings.session_lock_ttl_s,
    )  # fmt: skip
    engine = _engine(pool, metrics, settings, sessions)
    auth = Auth(settings.keys)
    tenant_of = Depends(auth)
    app.state.engine, app.state.sessions = engine, sessions
    app.include_router(router(engine, sessions, auth, settings.limits))
    app.include_router(tokenize_router(engine, auth))  # /tokenize, /detokenize (vLLM's)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CountRequests, metrics=metrics)  # outermost: counts the 413s too
    health = Health(pool.store, sessions)

    @app.get("/healthz")
    async def healthz() -> Response:
        deps = await health.dependencies()
        out = down(deps)
        body = {
            "ok": not out, "status": "degraded" if out else "ok", "down": out, "models": list(pool.models),
            "conversations": sessions.kind, "dependencies": deps, "engine": engine.kind,
            "queue": {"depth": engine.depth, "max": engine.max_queue, "computing": engine.compute.held,
                      "state_builds": engine.states.pending},  # conversations' states built after replies
        }  # fmt: skip
        return JSONResponse(body, status_code=503 if out else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/models")
    def models(tenant: str = tenant_of) -> list[dict]:
        return [
            {"name": m.spec.name, "family": m.spec.family.name, "layers": m.spec.num_layers,
             "weights_hash": m.spec.weights_hash, "tokenizer_hash": m.spec.tokenizer_hash}
            for m in pool.models.values()
        ]  # fmt: skip

    @app.get("/graph")
    def graph(tokens: int = 2048, tenant: str = tenant_of) -> dict:
        return {"edges": pool.graph.rows(tokens), "skipped": pool.graph.skipped}

    @app.post("/prefill")
    async def prefill(req: PrefillRequest, request: Request, tenant: str = tenant_of) -> dict:
        engine.model_or_404(req.sender)

        def work(cancel) -> object:
            with engine.computing(cancel):
                return pool.prefill(req.sender, req.text, tenant=tenant)

        state = await in_thread(work, engine.admit(), request.receive, metrics)
        key = StateKey.of(state)
        return {
            "tenant": key.tenant, "content_hash": key.content_hash, "model_hash": key.model_hash,
            "tokens": state.num_tokens, "prefill_s": state.meta["prefill_s"],
            "captured": [w for w in ("kv", *state.parts) if state.has(w)],
        }  # fmt: skip

    @app.post("/continue")
    async def continue_(req: ContinueRequest, request: Request, tenant: str = tenant_of) -> dict:
        engine.model_or_404(req.sender)
        engine.model_or_404(req.receiver)
        if req.transport not in requestable():
            raise ApiError(400, f"transport must be one of {', '.join(requestable())}", param="transport")

        def work(cancel) -> object:
            with engine.computing(cancel):
                return pool.continue_from(
                    req.text, req.receiver, req.suffix, tenant=tenant, sender=req.sender,
                    transport=req.transport, max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                    quality_threshold=req.quality_threshold, on_token=lambda _: cancel.check(),
                )  # fmt: skip

        res = await in_thread(work, engine.admit(), request.receive, metrics)
        return {
            "text": res.text, "tokens": res.tokens, "transport": res.transport, "reason": res.reason,
            "ttft_s": res.ttft_s, "total_s": res.total_s, "context_tokens": res.context_tokens,
            "timings": res.timings, "decision": res.decision,
        }  # fmt: skip

    return app


@asynccontextmanager
async def _closes_engine(app: FastAPI):
    yield
    app.state.engine.close()  # the engines a server started end with it


def _engine(pool: ModelPool, metrics: Metrics, settings: Settings, sessions: Conversations) -> Engine:
    kw = dict(max_queue=settings.max_queue, request_timeout_s=settings.request_timeout_s, sessions=sessions)
    if settings.engine == "native":
        return Engine(pool, metrics, **kw)
    if settings.engine != "vllm":
        raise UsageError(f"engine must be native or vllm, not {settings.engine!r}")
    from ctxrelay import paths
    from ctxrelay.results import machine_facts
    from ctxrelay.serve.vllm_engine import VllmEngine

    logger = logging.getLogger("ctxrelay")
    if not logger.handlers:  # starting engines and measuring their costs takes minutes: say what is going on
        logger.addHandler(logging.StreamHandler())
        logger.setLevel(logging.INFO)

    isa = machine_facts()["isa"]
    return VllmEngine.start(pool, metrics, settings.engine_config, isa, paths.cache_dir(), **kw)


def serve(pool: ModelPool, settings: Settings, host: str, port: int, graceful_s: float = 30.0) -> None:
    """Run until SIGINT/SIGTERM; uvicorn then stops accepting and lets in-flight requests finish
    (up to `graceful_s`)."""
    import uvicorn

    uvicorn.run(create_app(pool, settings), host=host, port=port, timeout_graceful_shutdown=graceful_s)
