"""The state a conversation's turn leaves for its next turn, built after the reply has ended.

Why a build of its own: a turn reads the conversation in its model's chat template (a relayed turn's
receiver cache is approximate besides), while the next turn relays from the exact state of the
transcript (chat.transcript), which no part of the turn computed. Built inside the turn, that
prefill doubled a first turn and held a stream's [DONE] 10-20 s after its last token. Here the turn
records that its state is pending (`Session.building`), saves the conversation and ends its reply;
one background thread builds the state under the compute lock, which it takes like any request,
after the reply's turn released it, so the build never delays that reply. Where the same model served
the previous turn and its state is at hand, only the new turn and reply are read over it (`extend`,
capture.extend_state, still off the reply path); otherwise the transcript is prefilled (`prefill`). An
engine may read the transcript itself instead (`prefill=`: vllm_engine.py has vLLM prefill it and leave
its K/V, taking the compute lock only to turn that K/V into the state).

The conversation store names the state once it is whole (`Conversations.attach`): in memory the
session holds it; in Redis it is stored first and the record names it after, so no process reads a
half-built state. The next turn waits for it before it queues for compute (`settle`; waiting while
holding the lock would deadlock the build): in this process on the build's future, in another by
re-reading the record until it names the state or the build's time (the request timeout from its
start) is up. A build that failed, was refused or did not finish in time makes the next turn a
native prefill of the transcript whose reason says so. A cancelled turn leaves no state (it never
gets here); a request with `store: false` leaves none.

A build the server makes only because it was idle (a conversation begun without an id, kept for reuse by
content: openai_api.py) gives way to every other request: it waits, on a thread of its own, until no request
is in and none began for a short quiet time, and a turn of another conversation (or a completion) that
begins while it reads stops it before the runner's next layer and sends it back to waiting. So a client
sending stateless requests one after another never waits for a second read of the last one (measured on the
AMD EPYC: each such request waited 1.1-1.4 s for it, halving the requests/s of one closed-loop client),
while a client that interleaves its conversations still finds each one's state: the conversation's own next
turn ends the wait and the build runs at once. One that waits longer than the request timeout, or past
MAX_WAITING such builds, is dropped (the next turn prefills natively, with the reason).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ctxrelay.errors import UsageError
from ctxrelay.relay.api import ModelPool
from ctxrelay.serve.chat import transcript
from ctxrelay.serve.compute import Cancel, Cancelled
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.sessions import Built, Conversations, Session
from ctxrelay.state import ContextState

log = logging.getLogger("ctxrelay.serve")

NOT_STORED = (
    "the last turn left no state (sent with store: false, or it began a conversation without an id while the "
    "server was busy)"
)
OUTGREW = "the conversation outgrew the model's window (no state of it fits)"
GAVE_WAY = (
    "the last turn's state was not built: other requests kept the server busy (a conversation begun without an "
    "id gets its state only while the server is otherwise idle, or once its next turn asks for it)"
)
QUIET_S = 0.5  # a build that gives way starts only after this long without a new request (a client's next send)
MAX_WAITING = 64  # builds that give way, waiting at once (each holds a transcript and a thread)
# a build starts once its turn's reply has left (the response's last byte), or after this long: an engine's read of
# the transcript takes every core, and started before the reply's closing chunks it delayed their sending
REPLY_SENT_S = 5.0
HURRIED, IDLE, DROPPED = "hurried", "idle", "dropped"  # how a build that gives way ended its wait
POLL_S = 0.05  # how often a turn waiting for another process's build reads the record again
# (model, transcript text, tenant, the model's own last state or None, cancel) -> the state; takes the lock it needs
Prefill = Callable[[str, str, str, ContextState | None, Cancel], ContextState]


class Deferred(Cancelled):
    """A request began while a build that gives way was reading: it goes back to waiting."""


class _Attempt(Cancel):
    """One try of a build that gives way: cancelled with the build (the server stops, the build is dropped), and
    deferred once any request begins after it started, unless the conversation's own next turn waits for it."""

    def __init__(self, b: _Build, arrivals: Callable[[], int]):
        super().__init__()
        self.build, self.arrivals, self.start = b, arrivals, arrivals()

    def is_set(self) -> bool:
        return self.build.cancel.is_set()

    def on_set(self, wake: Callable[[], None]) -> None:
        self.build.cancel.on_set(wake)

    def check(self) -> None:
        self.build.cancel.check()
        if not self.build.hurry.is_set() and self.arrivals() != self.start:
            raise Deferred("a request began")


@dataclass
class _Build:
    turn: int  # the conversation's turn count once the turn that asked for it was saved
    gives_way: bool  # to other requests (built only because the server was idle)
    cancel: Cancel
    hurry: threading.Event  # ends the quiet time (set by the cancel too)
    sent: threading.Event  # the reply has left (or its next turn waits, or the server stops): the build may start
    future: Future[Built] | None = None
    dropped: bool = False  # one that gave way too long: never built

    def start_now(self) -> None:
        """Its state is wanted now (its next turn asks, or the server stops): no quiet time, no wait for the reply."""
        self.hurry.set()
        self.sent.set()


class StateBuilder:
    """Builds conversations' states on one background thread (builds queue for compute anyway)."""

    def __init__(
        self, pool: ModelPool, computing: Callable[[Cancel], AbstractContextManager], sessions: Conversations,
        metrics: Metrics, timeout_s: float, prefill: Prefill | None = None, idle: Callable[[], bool] | None = None,
    ):  # fmt: skip
        self.pool, self.computing, self.sessions, self.metrics = pool, computing, sessions, metrics
        self.prefill = prefill or self.runner_prefill
        self.idle = idle or (lambda: True)  # no request in (the engine's admission count)
        self.timeout_s = timeout_s
        self._arrivals = 0  # requests begun (give_way)
        self._idle_reader = threading.Lock()  # held by the one build that gives way reading while the server idles
        self._waiting: list[threading.Thread] = []  # the threads of builds that give way
        self._pending: dict[tuple[str, str], _Build] = {}
        self._lock = threading.RLock()  # a future done at registration runs its callback in the registering thread
        self.quiet_s = QUIET_S
        self._closing = False
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="ctxrelay-state")

    @property
    def pending(self) -> int:
        return len(self._pending)

    def leave(
        self, s: Session, model: str, tenant: str, messages: list[dict], reply: str, store: bool,
        gives_way: bool = False, sent: threading.Event | None = None,
    ) -> str:  # fmt: skip
        """After a turn's reply was decoded and the compute lock released: the turn joins the conversation,
        which is saved (the next turn may go to another process), and the state its next turn reads is
        built in the background, once `sent` is set (the reply has left; at most REPLY_SENT_S) and, with
        `gives_way`, only while no request comes in. Returns how that state is made: "extend", "prefill" or
        "none"."""
        turn = [*messages, {"role": "assistant", "content": reply}]
        own = s.state if s.model == model else None  # a relayed cache is approximate: never extended
        s.model, s.messages, s.state = model, turn, None
        s.turns += 1
        s.building = time.time() if store else None
        if not store:
            s.no_state = NOT_STORED
        self.sessions.save(s)  # records `building`, so other processes wait for the state rather than prefill
        if not store:
            return "none"
        b = _Build(s.turns, gives_way, Cancel("the server is stopping"), threading.Event(), sent or threading.Event())
        if sent is None:
            b.sent.set()
        b.cancel.on_set(b.start_now)
        job = (s, model, tenant, transcript(turn), own, b)
        with self._lock:  # registered before its done-callback can remove it
            if self._closing:
                b.cancel.set()
            b.future = self._wait_for_idle(job) if gives_way else self._threads.submit(self._build, *job)
            self._pending[(s.tenant, s.id)] = b
            b.future.add_done_callback(lambda _: self._done((s.tenant, s.id), b))
            self.metrics.state_builds.set(len(self._pending))
        return "extend" if own is not None else "prefill"

    def settle(self, s: Session, cancel: Cancel | None) -> dict:
        """Before a conversation's next turn queues for compute: wait for the state its last turn left
        (bounded, and cancelled with the request). Returns the report's fields about that state."""
        if s.building is None:
            return self._facts(s, 0.0)
        t0 = time.perf_counter()
        with self._lock:
            b = self._pending.get((s.tenant, s.id))
        if b is not None and b.turn == s.turns:  # built by this process
            b.start_now()  # its quiet time is for other requests
            self._wait(b.future, s.building + self.timeout_s - time.time(), cancel)
            s.state, s.no_state = self._outcome(b.future)
            s.building = None
        else:  # by another process (or done here already): the record names it once it is stored
            while True:
                self.sessions.refresh(s)
                if s.building is None:
                    break
                if time.time() >= s.building + self.timeout_s:
                    s.state, s.no_state = None, f"the conversation's state was not built within {self.timeout_s:g} s"
                    break
                if cancel is not None:
                    cancel.check()
                time.sleep(POLL_S)
        return self._facts(s, time.perf_counter() - t0)

    def give_way(self, to: Session | None) -> None:
        """A turn of `to` (None: a request of no conversation) begins: builds that give way wait (one reading
        stops at its next layer), except the one of `to`'s own last turn (settle hurries it)."""
        with self._lock:
            own = self._pending.get((to.tenant, to.id)) if to is not None else None
            if own is not None and own.turn == to.turns:
                own.start_now()
            self._arrivals += 1

    def close(self) -> None:
        """Engine shutdown: queued builds are dropped, one waiting for compute stops, a running one is joined."""
        with self._lock:
            self._closing = True
            builds, waiting = list(self._pending.values()), list(self._waiting)
        for b in builds:
            b.cancel.set()
        self._threads.shutdown(wait=True, cancel_futures=True)
        for t in waiting:
            t.join(self.timeout_s)

    # ---- internals ----------------------------------------------------------------------------

    def _build(self, s: Session, model: str, tenant: str, text: str, own: ContextState | None, b: _Build) -> Built:
        """One state, built under the compute lock and handed to the conversation store."""
        turn = b.turn
        b.sent.wait(REPLY_SENT_S)
        try:
            state, why = self._read(model, text, tenant, own, b)
        except BaseException as e:  # the store says why, so another process's next turn can too
            self.metrics.state_build_failures.inc()
            log.warning("conversation %s: state not built (%s: %s)", s.id, type(e).__name__, e)
            self.sessions.attach(s, turn, None, f"the conversation's state could not be built ({_why(e)})")
            raise
        if state is not None:
            made = _made(state)
            self.metrics.state_build_s.labels(made).observe(state.meta.get("prefill_s", 0.0))
            log.info("conversation %s turn %d: state %s in %.3f s", s.id, turn, made, state.meta.get("prefill_s", 0.0))
        out = self.sessions.attach(s, turn, state, why)
        self.metrics.state_bytes.set(self.sessions.trim())
        return out

    def _read(self, model: str, text: str, tenant: str, own: ContextState | None, b: _Build) -> Built:
        """The state, or None and why not: over the window, or (one that gives way) dropped while it waited."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            slot = self._quiet(b, deadline) if b.gives_way else HURRIED
            if slot == DROPPED:
                self.metrics.state_builds_given_way.inc()
                return None, GAVE_WAY
            try:
                b.cancel.check()
                cancel = _Attempt(b, lambda: self._arrivals) if b.gives_way else b.cancel
                return self.prefill(model, text, tenant, own, cancel), ""
            except UsageError:  # over the window: this reply stands, the next turn is refused at its plan
                return None, OUTGREW
            except Deferred:
                continue
            finally:
                if slot == IDLE:
                    self._idle_reader.release()

    def _quiet(self, b: _Build, deadline: float) -> str:
        """Until the build may read: HURRIED (its next turn waits for it), IDLE (no request in, none begun for
        quiet_s, and no other idle build reading: it holds `_idle_reader`), or DROPPED (or past `deadline`)."""
        waited = False
        while not b.hurry.is_set():
            seen = self._arrivals
            b.hurry.wait(self.quiet_s)
            if b.hurry.is_set():
                break
            # one idle build reads at a time: a burst's waiting builds never flood the engine when it quiets
            if seen == self._arrivals and self.idle() and self._idle_reader.acquire(blocking=False):
                return IDLE
            if time.monotonic() >= deadline:
                return DROPPED
            if not waited:
                waited = True
                self.metrics.state_builds_deferred.inc()
        return DROPPED if b.dropped else HURRIED

    def _wait_for_idle(self, job: tuple) -> Future[Built]:
        """A build that gives way, on a thread of its own (it may wait long; other builds must not queue
        behind it); the oldest waiting one is dropped past MAX_WAITING."""
        future: Future[Built] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._build(*job))
                except BaseException as e:
                    future.set_exception(e)
            with self._lock:
                self._waiting.remove(thread)

        thread = threading.Thread(target=run, name="ctxrelay-state-idle", daemon=True)
        with self._lock:
            waiting = [b for b in self._pending.values() if b.gives_way and not b.future.done()]
            for b in waiting[: max(0, len(waiting) - MAX_WAITING + 1)]:
                b.dropped = True
                b.hurry.set()
            self._waiting.append(thread)
        thread.start()
        return future

    def runner_prefill(
        self, model: str, text: str, tenant: str, own: ContextState | None, cancel: Cancel
    ) -> ContextState:
        """The state read by ctxrelay's runner, under the compute lock (the runner shares the router's cores)."""
        with self.computing(cancel):
            return self.pool.prefill(model, text, tenant, store=False, extend=own, check=cancel.check)

    def _done(self, key: tuple[str, str], b: _Build) -> None:
        with self._lock:
            if self._pending.get(key) is b:
                del self._pending[key]
            self.metrics.state_builds.set(len(self._pending))

    @staticmethod
    def _wait(future: Future, timeout: float, cancel: Cancel | None) -> None:
        """Until the future is done, `timeout` passes, or `cancel` is set (then compute.Cancelled)."""
        if cancel is None:
            wait_futures([future], max(0.0, timeout))
            return
        woken = threading.Event()
        future.add_done_callback(lambda _: woken.set())
        cancel.on_set(woken.set)
        woken.wait(max(0.0, timeout))
        cancel.check()

    def _outcome(self, future: Future[Built]) -> Built:
        if not future.done():
            return None, f"the conversation's state was not built within {self.timeout_s:g} s"
        if future.cancelled():
            return None, "the conversation's state build was cancelled (the server is stopping)"
        if (e := future.exception()) is not None:
            return None, f"the conversation's state could not be built ({_why(e)})"
        return future.result()

    @staticmethod
    def _facts(s: Session, waited: float) -> dict:
        """How the state this turn reads was made, and how long the turn waited for it."""
        st = s.state
        made = None if st is None else _made(st)
        return {"state_wait_s": waited, "state_made": made, "state_build_s": st.meta.get("prefill_s") if st else None}


def _made(state: ContextState) -> str:
    how = "extended" if "extended_from" in state.meta else "prefilled"
    return f"{how} by {state.meta['captured_by']}" if state.meta.get("captured_by") else how


def _why(e: BaseException) -> str:
    detail = getattr(e, "detail", None) or str(e)  # an ApiError (compute timed out) carries its text as detail
    return f"{type(e).__name__}: {detail}"
