"""Request bodies: the size limit (413 before parsing), JSON errors that say where, the request count.

Pure ASGI middleware (not starlette's BaseHTTPMiddleware, which runs the app in a task of its own
and hides a client's disconnect from a streaming response). A body whose Content-Length is over
the limit is refused before the app runs; one sent without a length (chunked) is counted as it
arrives and refused once over, so the server never holds more than the limit of one body.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctxrelay.serve.errors import ApiError, error_body, json_error
from ctxrelay.serve.metrics import Metrics

M = TypeVar("M", bound=BaseModel)


def too_large(limit: int, size: int | None = None) -> ApiError:
    body = "request body" + (f" of {size} bytes" if size is not None else "")
    return ApiError(413, f"{body} is over this server's limit of {limit} bytes (ctxrelay serve --max-body-mb)")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            e = too_large(self.max_bytes, declared)
            # the unread body is not drained: uvicorn closes the connection after this answer
            response = JSONResponse(error_body(413, str(e.detail)), status_code=413, headers={"Connection": "close"})
            return await response(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large(self.max_bytes)  # FastAPI passes it on; errors.py answers it
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


class CountRequests:
    """ctxrelay_requests_total by route template (bounded label values) and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what the client gets when the app crashed before answering

        async def seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, seen)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()


async def parsed(request: Request, model: type[M]) -> M:
    """The body as `model`: read on the event loop (its size is bounded by BodyLimit), parsed, checked."""
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise json_error(e.msg, e.doc, e.pos) from None
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 JSON (byte {e.start} is not UTF-8)") from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None  # errors.py words it
