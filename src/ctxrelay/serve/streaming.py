"""Server-sent events for streamed completions: `data: {json}\\n\\n` chunks, then `data: [DONE]`.

The turn runs in a worker thread and hands each token over as soon as decode picks it; the text
a token adds is sent once it decodes cleanly (a multi-byte character split across tokens waits for
its last byte). The last text chunk makes the streamed text equal the non-streamed one.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from starlette.exceptions import HTTPException

from ctxrelay.errors import CtxrelayError
from ctxrelay.models.sampling import StopText
from ctxrelay.serve.engine import Served
from ctxrelay.serve.errors import error_body

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


def stream(
    work: Callable[[Callable[[int], None]], Served],
    deltas: TextDeltas,
    chunk: Callable[[str], dict],
    closing: Callable[[Served], list[dict]],
    release: Callable[[], None],
) -> Iterator[str]:
    """SSE lines of one streamed turn: a chunk per text delta, the closing chunks, [DONE].

    `release` (the queue slot) runs when the worker ends, also when the client went away mid-stream."""
    events: queue.Queue = queue.Queue()

    def target() -> None:
        try:
            last = ("done", work(lambda t: events.put(("token", t))))
        except HTTPException as e:
            last = ("error", error_body(e.status_code, str(e.detail)))
        except CtxrelayError as e:
            last = ("error", error_body(400, str(e)))
        except Exception:  # never a traceback to the client; the log has it
            log.exception("streamed turn failed")
            last = ("error", error_body(500, "internal error while generating (see the server log)"))
        finally:
            release()  # before the last event: a client that read it may send its next turn at once
        events.put(last)

    # started now, not on the first read: the slot is released even if the client never reads
    threading.Thread(target=target, name="ctxrelay-turn", daemon=True).start()
    return _lines(events, deltas, chunk, closing)


def _lines(events: queue.Queue, deltas: TextDeltas, chunk, closing) -> Iterator[str]:
    while True:
        kind, x = events.get()
        if kind == "token":
            if d := deltas.push(x):
                yield sse(chunk(d))
        elif kind == "done":
            if d := deltas.rest(x.text):
                yield sse(chunk(d))
            for c in closing(x):
                yield sse(c)
            break
        else:
            yield sse(x)
            break
    yield sse("[DONE]")
