"""Errors the server answers with, in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Clients written against the OpenAI API (the official `openai` package first) read `error.message`;
every refusal says what was wrong and what to do, never a traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ctxrelay.errors import BindingError, CtxrelayError
from ctxrelay.serve.compute import Cancelled

log = logging.getLogger("ctxrelay.serve")

# OpenAI's error types by status, so clients that branch on `type` see the usual names
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


CLIENT_CLOSED = 499  # the status of a request whose client went away before its answer (nginx's code)


class ApiError(HTTPException):
    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None):
        super().__init__(status, message, headers=headers)
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def json_error(msg: str, doc: str | bytes, pos: int) -> ApiError:
    """A malformed body's error: what is wrong and where (line, column, character), in the message."""
    text = doc.decode("utf-8", "replace") if isinstance(doc, bytes) else str(doc)
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return ApiError(400, f"the body is not valid JSON: {msg} at line {line}, column {column} (character {pos})")


def install(app: FastAPI) -> None:
    """Every error leaves the server in the OpenAI shape."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        body = error_body(e.status_code, str(e.detail), getattr(e, "param", None))
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # FastAPI's own parse: loc is ("body", character)
            pos = first["loc"][-1] if isinstance(first["loc"][-1], int) else 0
            bad = json_error(first.get("ctx", {}).get("error", "malformed"), e.body or "", pos)
            return JSONResponse(error_body(400, str(bad.detail)), status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed body')}"
        return JSONResponse(error_body(400, msg, where or None), status_code=400)

    @app.exception_handler(Cancelled)
    async def gone(request: Request, e: Cancelled) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; /metrics counts it

    @app.exception_handler(BindingError)
    async def refused(request: Request, e: BindingError) -> JSONResponse:
        return JSONResponse(error_body(403, str(e)), status_code=403)

    @app.exception_handler(CtxrelayError)
    async def usage(request: Request, e: CtxrelayError) -> JSONResponse:
        return JSONResponse(error_body(400, str(e)), status_code=400)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.error("request %s %s failed", request.method, request.url.path, exc_info=e)
        return JSONResponse(error_body(500, "internal error (see the server log)"), status_code=500)
