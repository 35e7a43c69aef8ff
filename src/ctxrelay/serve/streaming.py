"""Server-sent events for streamed completions: `data: {json}\\n\\n` chunks, then `data: [DONE]`.

The turn runs in its own thread (turns.py) and hands each token to the event loop as soon as decode
picks it; the text a token adds is sent once it decodes cleanly (a multi-byte character split
across tokens waits for its last byte). The last text chunk makes the streamed text equal the
non-streamed one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.exceptions import HTTPException

from ctxrelay.errors import CtxrelayError
from ctxrelay.models.sampling import StopText
from ctxrelay.serve.engine import Served
from ctxrelay.serve.errors import error_body
from ctxrelay.serve.turns import Turn

log = logging.getLogger("ctxrelay.serve")


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class TextDeltas:
    """The text each new token adds to the decoded whole; with stop strings, never what could still
    begin one (held back until it does not) nor anything from one on."""

    def __init__(self, tokenizer: Any, stops: StopText | None = None):
        self.tok, self.ids, self.sent = tokenizer, [], ""
        self.stops = stops or StopText()

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.stops.stops:
            cut = self.stops.cut(text, len(self.ids))
            text = text[: len(text) - self.stops.held(text)] if cut is None else text[:cut]
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def rest(self, final: str) -> str:
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


async def stream(turn: Turn, deltas: TextDeltas, chunk: Callable[[str], dict],
                 closing: Callable[[Served], list[dict]]) -> AsyncIterator[str]:  # fmt: skip
    """SSE lines of one streamed turn, after its `ready` event: a chunk per text delta, the closing
    chunks, [DONE]. An error after the 200 (the wait for compute timed out, the turn failed) is an
    error event. Stopping early (starlette cancels the stream when the client disconnects, or the
    send fails) cancels the turn: its decode stops and its place is freed."""
    finished = False
    try:
        while True:
            kind, x = await turn.next()
            if kind == "token":
                if d := deltas.push(x):
                    yield sse(chunk(d))
            elif kind == "done":
                if d := deltas.rest(x.text):
                    yield sse(chunk(d))
                for c in closing(x):
                    yield sse(c)
                break
            elif kind == "error":
                yield sse(_error_event(x))
                break
            else:  # cancelled: nobody reads this stream any more
                return
        finished = True
        yield sse("[DONE]")
    finally:
        if not finished:
            turn.cancel.set()


def _error_event(e: BaseException) -> dict:
    if isinstance(e, HTTPException):
        return error_body(e.status_code, str(e.detail), getattr(e, "param", None))
    if isinstance(e, CtxrelayError):
        return error_body(400, str(e))
    log.error("streamed turn failed", exc_info=e)  # never a traceback to the client; the log has it
    return error_body(500, "internal error while generating (see the server log)")
