"""The OpenAI API: GET /v1/models, POST /v1/chat/completions and /v1/completions, streamed or not.

What ctxrelay adds rides in fields the openai client passes through (`extra_body=`):
`conversation` ("new" starts one; its id, or an id the client chooses, names it; also `conversation_id`
and the X-Conversation-Id and X-Session-ID headers) and `transport` ("auto" by default, or a transport
name, or "native"). A chat request that names no conversation continues the tenant's stored one its
messages begin with, found by content (reuse.py); OpenAI's `store: false` opts it out (nothing looked
up or kept) and a named conversation's turn out of leaving a state for a next turn. Each response carries a
`ctxrelay` field (transport, reason, TTFT and its components, the conversation id, how a stored state was
found: `reuse`) and the
X-Ctxrelay-* headers; a stream sends the `ctxrelay` field in its last chunk, since its headers
leave before the turn runs. Temperature defaults to 0 (greedy). The sampling fields, logprobs and
the fields refused are fields.py's.

The handlers are async: the body is parsed and the queue slot taken (429) on the event loop; the
turn runs in a thread of its own (turns.py), which first opens the conversation, renders and
tokenizes the prompt and checks it against the window. The handler answers only after that, so a
refused stream is a plain 4xx; a client that disconnects cancels its turn.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from ctxrelay.models.sampling import MAX_LOGPROBS, Sampling, StopText
from ctxrelay.models.spec import LoadedModel
from ctxrelay.relay.gate import requestable
from ctxrelay.serve.bodies import parsed
from ctxrelay.serve.chat import normalise
from ctxrelay.serve.engine import Engine, Prompt, Served
from ctxrelay.serve.errors import ApiError
from ctxrelay.serve.fields import chat_logprobs, completion_logprobs, refuse_unsupported, sampling_of
from ctxrelay.serve.reuse import NONE, Finder, Found
from ctxrelay.serve.sessions import Conversations, Session, checked_id
from ctxrelay.serve.streaming import TextDeltas, sse, stream
from ctxrelay.serve.turns import Turn


@dataclass
class Limits:
    default_max_tokens: int = 64
    max_tokens: int = 1024


class _Generate(BaseModel):
    # undeclared fields are kept (model_extra) so that fields.refuse_unsupported can refuse the known
    # unsupported ones; the others are ignored
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's; -1 or 0: off
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)  # vLLM's: end-of-text and stop strings only from this many tokens on
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    stop: str | list[str] | None = None
    transport: str = "auto"  # ctxrelay: which transport may serve the turn


class ChatRequest(_Generate):
    messages: list[dict]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    conversation: str | None = None  # ctxrelay: "new", an id this server issued, or one the client chooses
    conversation_id: str | None = None  # the same, as some clients name it
    store: bool = True  # false: the turn leaves no state for a next turn; without an id, nothing is looked up


class CompletionRequest(_Generate):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the legacy field: how many top tokens
    conversation: str | None = None  # refused: completions keep no conversation


def report_headers(report: dict) -> dict[str, str]:
    h = {
        "X-Ctxrelay-Transport": report["transport"],
        "X-Ctxrelay-Reason": report["reason"].encode("ascii", "replace").decode()[:512],
        "X-Ctxrelay-TTFT-S": f"{report['ttft_s']:.6f}",
        "X-Ctxrelay-Timings": ";".join(f"{k}={v:.6f}" for k, v in report["timings"].items()),
    }
    if report.get("conversation"):
        h["X-Conversation-Id"] = report["conversation"]
    return h


def usage(s: Served) -> dict:
    n = len(s.result.tokens)
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": n, "total_tokens": s.prompt_tokens + n}


def router(engine: Engine, sessions: Conversations, tenant_of: Callable, limits: Limits) -> APIRouter:
    api = APIRouter(prefix="/v1")
    Tenant = Depends(tenant_of)
    finder = Finder(sessions, engine.states, engine.pool, engine.metrics)

    def checked(req: _Generate, max_tokens: int | None, logprobs: int | None) -> tuple[int, Sampling]:
        engine.model_or_404(req.model)
        refuse_unsupported(req.model_extra)
        if req.n != 1:
            raise ApiError(400, "n must be 1 (one choice per request)", param="n")
        if req.transport not in requestable():
            raise ApiError(400, f"transport must be one of {', '.join(requestable())}", param="transport")
        n = max_tokens or limits.default_max_tokens
        if n > limits.max_tokens:
            raise ApiError(400, f"max_tokens {n} is above this server's limit {limits.max_tokens}", param="max_tokens")
        if req.min_tokens > n:
            raise ApiError(400, f"min_tokens {req.min_tokens} is above max_tokens {n}", param="min_tokens")
        return n, sampling_of(req, logprobs, engine.pool.models[req.model].spec.vocab_size)

    @api.get("/models")
    async def models(tenant: str = Tenant) -> dict:
        return {"object": "list", "data": [_model(m) for m in engine.pool.models.values()]}

    @api.get("/models/{name:path}")
    async def model(name: str, tenant: str = Tenant) -> dict:
        return _model(engine.pool.models[engine.model_or_404(name)])

    @api.post("/chat/completions", openapi_extra=_body(ChatRequest))
    async def chat(request: Request, tenant: str = Tenant) -> Response:
        req = await parsed(request, ChatRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens, sampling = checked(req, req.max_completion_tokens or req.max_tokens,
                                       (req.top_logprobs or 0) if req.logprobs else None)  # fmt: skip
        tok = engine.pool.models[req.model].tokenizer
        conv = _conversation(
            req.conversation, req.conversation_id, request.headers.get("x-conversation-id"),
            request.headers.get("x-session-id"),
        )  # fmt: skip
        held = _Held(engine, finder, engine.admit())  # 429 here, on the event loop
        sent = threading.Event()  # set once the response's last byte has left: the turn's state build starts then
        base = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": req.model}
        messages: list[dict[str, str]] = []

        def prepare() -> Prompt:  # in the turn's thread: the conversation store, the template, the tokenizer
            messages.extend(normalise(req.messages))
            held.found = finder.open(tenant, conv, messages, req.store)  # by id and content, held
            return engine.plan_chat(req.model, messages, held.found.planned(), max_tokens)

        def work(prompt: Prompt, on_token, cancel) -> Served:
            if not finder.seed(held.found, cancel):  # the reused state was not at hand: the whole request is new
                prompt = engine.plan_chat(req.model, messages, held.session, max_tokens)
            # a conversation begun without an id is kept for reuse by content, but its state (a second read of
            # the transcript) is built only when no other request is in, and gives way to the next one that
            # comes: stateless traffic is not read twice
            named = conv is not None or held.found.by != NONE
            keep = req.store and (named or engine.idle())
            opts = dict(max_tokens=max_tokens, temperature=sampling.temperature, transport=req.transport,
                        sampling=sampling, store=keep, state_gives_way=not named, reply_sent=sent)  # fmt: skip
            # the engine saves the conversation before the reply leaves (the next turn may go to another process)
            served = engine.chat(tenant, prompt, held.session, on_token=on_token, cancel=cancel, **opts)
            finder.report(held.found, served.report)
            return served

        turn = Turn(prepare, work, held.release, engine.metrics)
        if req.stream:
            obj = {**base, "object": "chat.completion.chunk"}
            chunk = lambda d: {**obj, "choices": [{"index": 0, "delta": {"content": d}, "finish_reason": None}]}

            def closing(s: Served) -> list[dict]:
                # a stream's logprobs come whole in its last choice chunk (clients concatenate content[])
                lp = chat_logprobs(tok, s.result.logprobs)
                end = {"index": 0, "delta": {}, "logprobs": lp, "finish_reason": s.finish_reason(max_tokens)}
                return _closing(obj, end, s, req.stream_options)

            first = {**obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            return await _streamed(turn, engine, req.model, chunk, closing, first, held, sampling, sent)
        s = await _finished(turn, request)
        msg = {"role": "assistant", "content": s.text}
        lp = chat_logprobs(tok, s.result.logprobs)
        choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": s.finish_reason(max_tokens)}
        body = {**base, "object": "chat.completion", "choices": [choice], "usage": usage(s), "ctxrelay": s.report}
        return _json(body, s.report, sent)

    @api.post("/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request, tenant: str = Tenant) -> Response:
        req = await parsed(request, CompletionRequest)
        max_tokens, sampling = checked(req, req.max_tokens, req.logprobs)
        tok = engine.pool.models[req.model].tokenizer
        if req.conversation or request.headers.get("x-conversation-id"):
            raise ApiError(400, "completions keep no conversation; use /v1/chat/completions", param="conversation")
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1 or not prompts[0]:
            raise ApiError(400, "prompt must be one non-empty string", param="prompt")
        held = _Held(engine, finder, engine.admit())
        base = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": req.model}  # fmt: skip

        def work(prompt: Prompt, on_token, cancel) -> Served:
            return engine.complete(prompt, max_tokens=max_tokens, temperature=sampling.temperature,
                                   on_token=on_token, cancel=cancel, sampling=sampling)  # fmt: skip

        prepare = lambda: engine.plan_completion(req.model, prompts[0], max_tokens)
        turn = Turn(prepare, work, held.release, engine.metrics)
        choice = lambda text, lp, fin: {"index": 0, "text": text, "logprobs": lp, "finish_reason": fin}
        logprobs = lambda s: completion_logprobs(tok, s.result.logprobs)
        if req.stream:
            chunk = lambda d: {**base, "choices": [choice(d, None, None)]}
            end = lambda s: choice("", logprobs(s), s.finish_reason(max_tokens))  # logprobs whole, at the end
            closing = lambda s: _closing(base, end(s), s, req.stream_options)
            return await _streamed(turn, engine, req.model, chunk, closing, None, held, sampling)
        s = await _finished(turn, request)
        one = choice(s.text, logprobs(s), s.finish_reason(max_tokens))
        return _json({**base, "choices": [one], "usage": usage(s), "ctxrelay": s.report}, s.report)

    return api


def _model(m: LoadedModel) -> dict:
    # max_model_len (vLLM's name): the context window, prompt and answer together; None where unstated
    name = m.spec.name
    return {"id": name, "object": "model", "created": 0, "owned_by": "ctxrelay", "root": name, "parent": None,
            "max_model_len": m.spec.context_window}  # fmt: skip


def _body(model: type[BaseModel]) -> dict:
    """The request body's schema for the OpenAPI page (the handlers parse the body themselves)."""
    schema = {"content": {"application/json": {"schema": model.model_json_schema()}}, "required": True}
    return {"requestBody": schema}


def _conversation(*named: str | None) -> str | None:
    """The conversation a chat request names: the `conversation` or `conversation_id` field, or the
    X-Conversation-Id or X-Session-ID header (400 where two name different ones, or an id is malformed)."""
    ids = {n for n in named if n}
    if len(ids) > 1:
        raise ApiError(400, "the conversation fields and headers name different conversations", param="conversation")
    return checked_id(ids.pop()) if ids else None


class _Held:
    """What a request holds: its queue slot, and its conversation once found (one turn at a time)."""

    def __init__(self, engine: Engine, finder: Finder, release_slot: Callable[[], None]):
        self.engine, self.finder, self.release_slot = engine, finder, release_slot
        self.found: Found | None = None

    @property
    def session(self) -> Session | None:
        return self.found.session if self.found is not None else None

    def release(self) -> None:
        self.release_slot()
        if self.found is not None:
            self.finder.release(self.found)
            sessions = self.finder.sessions
            self.engine.metrics.sessions.set(len(sessions))
            self.engine.metrics.state_bytes.set(sessions.trim())


async def _finished(turn: Turn, request: Request) -> Served:
    """A non-streamed turn's result (compute.Cancelled when its client went away: errors.py answers 499)."""
    await turn.ready()
    return await turn.result(request.receive)


def _closing(obj: dict, end_choice: dict, s: Served, stream_options: dict | None) -> list[dict]:
    out = [{**obj, "choices": [end_choice], "ctxrelay": s.report}]
    if (stream_options or {}).get("include_usage"):
        out.append({**obj, "choices": [], "usage": usage(s)})
    return out


async def _streamed(
    turn: Turn,
    engine: Engine,
    model: str,
    chunk,
    closing,
    first: dict | None,
    held: _Held,
    sampling: Sampling,
    sent: threading.Event | None = None,
):
    """The stream, once the turn was checked: a refusal is raised here, as a plain 4xx."""
    await turn.ready()
    # the stream cuts at stop strings by decode's own rule, so it never shows text the whole answer cuts
    deltas = TextDeltas(engine.pool.models[model].tokenizer, StopText(sampling.stop, sampling.min_tokens))
    body = stream(turn, deltas, chunk, closing)
    if first is not None:
        body = _prepend(sse(first), body)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if held.session is not None:
        headers["X-Conversation-Id"] = held.session.id
    return StreamingResponse(body, media_type="text/event-stream", headers=headers, background=_on_sent(sent))


async def _prepend(head: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """`head` (the role chunk) just before the stream's first line, as vLLM's server sends it: clients that time
    the first chunk (vLLM's `bench serve` does) time the first token, not the plan (the 200 and the headers
    leave at once anyway)."""
    sent = False
    async for line in rest:
        if not sent:
            sent = True
            yield head
        yield line
    if not sent:
        yield head


def _json(body: dict, report: dict, sent: threading.Event | None = None) -> Response:
    return JSONResponse(body, headers=report_headers(report), background=_on_sent(sent))


def _on_sent(sent: threading.Event | None) -> BackgroundTask | None:
    """Starlette runs a response's background task once its last byte has left: then `sent` is set."""
    return BackgroundTask(sent.set) if sent is not None else None
