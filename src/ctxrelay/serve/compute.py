"""The compute lock and cancellation: a turn whose client went away stops and frees its place.

Model compute is serialised by one lock (engine.py says why). A request waits for it in its own
thread; a `Cancel` set by the event loop (the client closed the connection) wakes that wait at
once, and the decode loop's per-token callback raises `Cancelled` at its next token, so the
lock goes to the next request within one decode step. A cancelled turn changes nothing it has
not finished: the engine updates a conversation only after its decode returns.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

M_ARENA_MAX = -8  # glibc's mallopt parameter: how many malloc arenas threads may use


def one_malloc_arena() -> bool:
    """Every thread allocates from glibc's main arena (called before the server starts its threads). Each turn
    computes in a thread of its own (turns.py); with glibc's default of an arena per thread, a turn's tensors came
    from a fresh arena whose pages fault in anew: the same bf16 relay (4096 tokens) read 2.2-2.7 s in a fresh
    thread against 1.1-1.2 s in the main thread, and 1.1-1.2 s in both with one arena (scripts/relay_threads.py).
    Returns whether it applied (glibc only)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


class Cancelled(Exception):
    """The client went away: the turn stops (nothing is sent, nothing is saved)."""


class Cancel:
    """Set once, from any thread, when nobody waits for the turn's answer any more."""

    def __init__(self, reason: str = "the client closed the connection") -> None:
        self.reason = reason
        self._event = threading.Event()
        self._wakers: list[Callable[[], None]] = []

    def set(self) -> None:
        self._event.set()
        for wake in list(self._wakers):
            wake()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled(self.reason)

    def on_set(self, wake: Callable[[], None]) -> None:
        self._wakers.append(wake)


class ComputeLock:
    """One holder at a time; a waiter gives up at its timeout (False) or when its Cancel is set (Cancelled).

    A Condition rather than a Lock so that a cancelled waiter leaves the wait at once instead of
    polling: many waiting requests then cost no wake-ups while the holder computes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def acquire(self, timeout: float | None = None, cancel: Cancel | None = None) -> bool:
        if cancel is not None:
            cancel.on_set(self._wake)
        with self._cond:
            stop = cancel.is_set if cancel is not None else (lambda: False)
            got = self._cond.wait_for(lambda: not self._held or stop(), timeout)
            if cancel is not None:
                cancel.check()
            if not got:
                return False
            self._held = True
            return True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()  # every waiter re-checks: a cancelled one must not swallow the wake-up

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
