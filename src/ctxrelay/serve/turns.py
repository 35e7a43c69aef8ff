"""A request's turn in a thread of its own, its events handed to the event loop.

The HTTP handlers are async: body, admission (429) and answers such as /healthz and /metrics stay
on the event loop and never wait behind compute. What blocks (the conversation store, rendering and
tokenizing, waiting for and holding the compute lock) runs in a thread started per admitted
request rather than in starlette's shared pool, which requests waiting for compute would exhaust;
the queue bound caps these threads. The handler awaits the turn's first event (`ready`, after the
request was checked, or its error) before answering, so a refused request is a plain 4xx, never a
200 stream that ends in an error event. A client that goes away sets the turn's Cancel
(compute.py); the turn then stops and frees its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from starlette.types import Receive

from ctxrelay.serve.compute import Cancel, Cancelled
from ctxrelay.serve.metrics import Metrics

log = logging.getLogger("ctxrelay.serve")

Events = Callable[[str, Any], None]


class Turn:
    """`prepare()` (may raise: the request is refused), then `work(prepared, on_token, cancel)`;
    `release()` runs once when the thread ends, before the last event is handed over (a client that
    read it may send its next turn at once)."""

    def __init__(self, prepare: Callable[[], Any], work: Callable[..., Any], release: Callable[[], None],
                 metrics: Metrics | None = None):  # fmt: skip
        self.cancel = Cancel()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._prepare, self._work, self._release, self._metrics = prepare, work, release, metrics
        # started now: the slot is released even if nobody reads the events
        threading.Thread(target=self._run, name="ctxrelay-turn", daemon=True).start()

    def _put(self, kind: str, x: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (server shutting down): nobody reads this
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, x))

    def _run(self) -> None:
        last: tuple[str, Any]
        try:
            prepared = self._prepare()
            self._put("ready", None)
            last = ("done", self._work(prepared, lambda t: self._put("token", t), self.cancel))
        except Cancelled:
            last = ("cancelled", None)
            if self._metrics is not None:
                self._metrics.cancelled.inc()
        except BaseException as e:  # handed to the handler, which answers it (errors.py) or streams it
            last = ("error", e)
        finally:
            self._release()
        self._put(*last)

    async def next(self) -> tuple[str, Any]:
        """The next event: ("ready"|"token"|"done"|"cancelled"|"error", value). A handler cancelled
        while it waits (the server stops, starlette saw the client go) cancels the turn."""
        try:
            return await self._events.get()
        except asyncio.CancelledError:
            self.cancel.set()
            raise

    async def ready(self) -> None:
        """Wait until the request was checked; its refusal is raised here, before any answer."""
        kind, x = await self.next()
        if kind == "error":
            raise x
        if kind == "cancelled":
            raise Cancelled("the client closed the connection")

    async def result(self, receive: Receive) -> Any:
        """The work's result, cancelling the turn if the client disconnects first (the body was read:
        the next ASGI message is the disconnect)."""
        watch = asyncio.create_task(_disconnected(receive, self.cancel))
        try:
            while True:
                kind, x = await self.next()
                if kind == "done":
                    return x
                if kind == "error":
                    raise x
                if kind == "cancelled":
                    raise Cancelled("the client closed the connection")
        finally:
            watch.cancel()


async def _disconnected(receive: Receive, cancel: Cancel) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel.set()


async def in_thread(fn: Callable[[Cancel], Any], release: Callable[[], None], receive: Receive,
                    metrics: Metrics | None = None) -> Any:  # fmt: skip
    """`fn(cancel)` in a turn thread (no preparation), cancelled if the client disconnects first."""
    turn = Turn(lambda: None, lambda _, __, cancel: fn(cancel), release, metrics)
    await turn.ready()
    return await turn.result(receive)
