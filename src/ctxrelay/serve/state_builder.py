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
from ctxrelay.serve.compute import Cancel
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.sessions import Built, Conversations, Session
from ctxrelay.state import ContextState

log = logging.getLogger("ctxrelay.serve")

NOT_STORED = (
    "the last turn left no state (sent with store: false, or it began a conversation without an id while the "
    "server was busy)"
)
OUTGREW = "the conversation outgrew the model's window (no state of it fits)"
POLL_S = 0.05  # how often a turn waiting for another process's build reads the record again
# (model, transcript text, tenant, the model's own last state or None, cancel) -> the state; takes the lock it needs
Prefill = Callable[[str, str, str, ContextState | None, Cancel], ContextState]


@dataclass
class _Build:
    turn: int  # the conversation's turn count once the turn that asked for it was saved
    future: Future[Built]


class StateBuilder:
    """Builds conversations' states on one background thread (builds queue for compute anyway)."""

    def __init__(
        self, pool: ModelPool, computing: Callable[[Cancel], AbstractContextManager], sessions: Conversations,
        metrics: Metrics, timeout_s: float, prefill: Prefill | None = None,
    ):  # fmt: skip
        self.pool, self.computing, self.sessions, self.metrics = pool, computing, sessions, metrics
        self.prefill = prefill or self.runner_prefill
        self.timeout_s = timeout_s
        self._pending: dict[tuple[str, str], _Build] = {}
        self._lock = threading.RLock()  # a future done at registration runs its callback in the registering thread
        self._cancel = Cancel()  # set on close: a build waiting for compute stops
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="ctxrelay-state")

    @property
    def pending(self) -> int:
        return len(self._pending)

    def leave(self, s: Session, model: str, tenant: str, messages: list[dict], reply: str, store: bool) -> str:
        """After a turn's reply was decoded and the compute lock released: the turn joins the conversation,
        which is saved (the next turn may go to another process), and the state its next turn reads is
        built in the background. Returns how that state is made: "extend", "prefill" or "none"."""
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
        with self._lock:  # registered before its done-callback can remove it
            b = _Build(s.turns, self._threads.submit(self._build, s, s.turns, model, tenant, transcript(turn), own))
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

    def close(self) -> None:
        """Engine shutdown: queued builds are dropped, one waiting for compute stops, a running one is joined."""
        self._cancel.set()
        self._threads.shutdown(wait=True, cancel_futures=True)

    # ---- internals ----------------------------------------------------------------------------

    def _build(self, s: Session, turn: int, model: str, tenant: str, text: str, own: ContextState | None) -> Built:
        """One state, built under the compute lock and handed to the conversation store."""
        try:
            try:
                state, why = self.prefill(model, text, tenant, own, self._cancel), ""
            except UsageError:  # over the window: this reply stands, the next turn is refused at its plan
                state, why = None, OUTGREW
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

    def runner_prefill(
        self, model: str, text: str, tenant: str, own: ContextState | None, cancel: Cancel
    ) -> ContextState:
        """The state read by ctxrelay's runner, under the compute lock (the runner shares the router's cores)."""
        with self.computing(cancel):
            return self.pool.prefill(model, text, tenant, store=False, extend=own)

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
