"""HTTP server over a ModelPool: prefill once, continue on any model, inspect the graph.

The tenant comes from the `X-Tenant` header (put your gateway's authenticated identity there), never
from the body, so one tenant cannot name another's state. Model compute is serialised by a lock:
the pool's models share the machine's cores, and interleaving two prefills only makes both slower.
"""

from __future__ import annotations

import threading

from fastapi import FastAPI, Header, HTTPException
from pydantic import BaseModel, Field

from ctxrelay.errors import BindingError
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.gate import requestable
from ctxrelay.relay.store import StateKey


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


def create_app(pool: ModelPool) -> FastAPI:
    app = FastAPI(title="ctxrelay", version="0.1.0")
    compute = threading.Lock()

    def model_or_404(name: str):
        if name not in pool.models:
            raise HTTPException(404, f"model {name!r} is not served here; served: {', '.join(pool.models)}")
        return pool.models[name]

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True, "models": list(pool.models)}

    @app.get("/models")
    def models() -> list[dict]:
        return [
            {"name": m.spec.name, "family": m.spec.family.name, "layers": m.spec.num_layers,
             "weights_hash": m.spec.weights_hash, "tokenizer_hash": m.spec.tokenizer_hash}
            for m in pool.models.values()
        ]  # fmt: skip

    @app.get("/graph")
    def graph(tokens: int = 2048) -> dict:
        return {"edges": pool.graph.rows(tokens), "skipped": pool.graph.skipped}

    @app.post("/prefill")
    def prefill(req: PrefillRequest, x_tenant: str = Header(...)) -> dict:
        model_or_404(req.sender)
        with compute:
            state = pool.prefill(req.sender, req.text, tenant=x_tenant)
        key = StateKey.of(state)
        return {
            "tenant": key.tenant, "content_hash": key.content_hash, "model_hash": key.model_hash,
            "tokens": state.num_tokens, "prefill_s": state.meta["prefill_s"],
            "captured": [w for w in ("kv", *state.parts) if state.has(w)],
        }  # fmt: skip

    @app.post("/continue")
    def continue_(req: ContinueRequest, x_tenant: str = Header(...)) -> dict:
        model_or_404(req.sender)
        model_or_404(req.receiver)
        if req.transport not in requestable():
            raise HTTPException(400, f"transport must be one of {', '.join(requestable())}")
        try:
            with compute:
                res = pool.continue_from(
                    req.text, req.receiver, req.suffix, tenant=x_tenant, sender=req.sender,
                    transport=req.transport, max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                    quality_threshold=req.quality_threshold,
                )  # fmt: skip
        except BindingError as e:
            raise HTTPException(403, str(e)) from None
        return {
            "text": res.text, "tokens": res.tokens, "transport": res.transport, "reason": res.reason,
            "ttft_s": res.ttft_s, "total_s": res.total_s, "context_tokens": res.context_tokens,
            "timings": res.timings, "decision": res.decision,
        }  # fmt: skip

    return app


def serve(models: list[str], store: str, host: str, port: int, quality_threshold: float) -> None:
    import uvicorn

    pool = ModelPool(models, store=store, quality_threshold=quality_threshold)
    uvicorn.run(create_app(pool), host=host, port=port)
