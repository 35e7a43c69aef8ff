"""POST /tokenize and /detokenize, as vLLM serves them (vllm.entrypoints.openai.protocol).

/tokenize takes {model, prompt, add_special_tokens} or {model, messages, add_generation_prompt} and
answers {count, max_model_len, tokens[, token_strs]}; the tokens of `messages` are the receiver's own
chat template over them, exactly what a native prefill reads and `usage.prompt_tokens` counts (the
template's BOS once). /detokenize takes {model, tokens} and answers {prompt}. Both need an API key,
like the rest of the API, and run no model: no queue slot, no compute lock.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict

from ctxrelay.models.spec import LoadedModel
from ctxrelay.serve.chat import normalise, prompt_ids
from ctxrelay.serve.engine import Engine
from ctxrelay.serve.errors import ApiError


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # vLLM's chat_template, tools, ... would be ignored silently

    model: str | None = None  # vLLM's: may be left out where one model is served
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True  # prompt only: the template writes a chat's special tokens
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def router(engine: Engine, tenant_of: Callable) -> APIRouter:
    api = APIRouter()
    Tenant = Depends(tenant_of)

    def served(name: str | None) -> LoadedModel:
        if name is None:
            if len(engine.pool.models) != 1:
                raise ApiError(400, "model must name one of the served models", param="model")
            return next(iter(engine.pool.models.values()))
        return engine.pool.models[engine.model_or_404(name)]

    @api.post("/tokenize")
    def tokenize(req: TokenizeRequest, tenant: str = Tenant) -> dict:
        m = served(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send either prompt or messages", param="prompt")
        if req.messages is not None:
            ids = prompt_ids(m, normalise(req.messages), generation_prompt=req.add_generation_prompt)
        else:
            ids = m.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        out = {"count": len(ids), "max_model_len": m.spec.context_window, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = m.tokenizer.convert_ids_to_tokens(ids)
        return out

    @api.post("/detokenize")
    def detokenize(req: DetokenizeRequest, tenant: str = Tenant) -> dict:
        m = served(req.model)
        vocab = len(m.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"tokens must be ids of {m.spec.name}'s vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": m.tokenizer.decode(req.tokens)}

    return api
