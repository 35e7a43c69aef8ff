"""One turn of compute: admission (the bounded queue), the relay-or-prefill, the state it leaves.

Model compute is serialised by one lock: the pool's models share the machine's cores, and
interleaving two prefills only makes both slower. Requests past the queue bound get 429 with a
Retry-After from the recent service time; a request that waits longer than its timeout for the
compute lock gets 503 (nothing ran). TTFT in a report is measured from the moment the turn got the
compute lock; the wait before it is `queue_wait_s`.

A turn is planned before it queues (`plan_chat`, `plan_completion`: the chat template rendered,
the prompt tokenized and checked against the model's window, 400 otherwise), so a refused
request never waits for compute and a stream is refused before its first event. A turn given a
`Cancel` (compute.py) stops when it is set: while it waits for the lock, or at its next decoded
token; the conversation is updated only after the decode returns, so a cancelled turn leaves it
as it was. The state a turn leaves for the next is built after its reply ends, off the request
path (state_builder.py); the next turn of the conversation waits for it before it queues.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from ctxrelay.errors import UsageError
from ctxrelay.models.sampling import Sampling
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay.api import ModelPool, RelayResult, check_window
from ctxrelay.serve.chat import prompt_ids, render_turn, transcript
from ctxrelay.serve.compute import Cancel, ComputeLock
from ctxrelay.serve.errors import ApiError
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.sessions import Conversations, Session, SessionStore
from ctxrelay.serve.state_builder import StateBuilder

OnToken = Callable[[int], None] | None


@dataclass
class Prompt:
    """A turn rendered and tokenized before it queues for compute."""

    model: str
    history: list[dict[str, str]]  # the conversation so far: its state (or transcript) is the context
    new: list[dict[str, str]]  # what this request adds
    text: str  # the context: the history's transcript, or without history the whole rendered prompt
    suffix: str  # the new turn in the model's template, read after the history ("" without history)
    suffix_tokens: int


@dataclass
class Served:
    result: RelayResult
    report: dict  # the response's `ctxrelay` field
    prompt_tokens: int

    @property
    def text(self) -> str:
        return self.result.text

    def finish_reason(self, max_tokens: int) -> str:
        return self.result.finish_reason  # decode's own: end-of-text and stop strings are "stop"


class Engine:
    """Turns computed by ctxrelay's own runner (`--engine native`); vllm_engine.py decodes in vLLM instead."""

    kind = "native"

    def __init__(
        self, pool: ModelPool, metrics: Metrics, *, max_queue: int = 32, request_timeout_s: float = 300.0,
        sessions: Conversations | None = None,
    ):  # fmt: skip
        self.pool, self.metrics = pool, metrics
        self.max_queue, self.request_timeout_s = max_queue, request_timeout_s
        self.compute = ComputeLock()
        # the states turns leave, built after their replies; the conversation store names them
        sessions = sessions if sessions is not None else SessionStore()  # an empty store is falsy (__len__)
        idle = lambda: self._depth == 0  # noqa: E731  (no request admitted: a deferred state build may read)
        self.states = StateBuilder(pool, self.computing, sessions, metrics, request_timeout_s, self.state_prefill, idle)
        self._admit = threading.Lock()
        self._depth = 0
        self._service_s = 1.0  # running mean of a turn's compute time, for Retry-After

    @property
    def depth(self) -> int:
        """Requests admitted and not finished."""
        return self._depth

    def idle(self) -> bool:
        """No request admitted but the caller's (a state build in the background does not count: it runs
        before the next request's turn anyway)."""
        return self._depth <= 1

    def state_prefill(self, model: str, text: str, tenant: str, own, cancel: Cancel):
        """The state a turn leaves (state_builder.Prefill): read by ctxrelay's runner here."""
        return self.states.runner_prefill(model, text, tenant, own, cancel)

    def close(self) -> None:
        """Stop what the engine started: the state builds (the runner lives in this process)."""
        self.states.close()

    def model_or_404(self, name: str) -> str:
        if name not in self.pool.models:
            served = ", ".join(self.pool.models)
            raise ApiError(404, f"model {name!r} is not served here; served: {served}", param="model")
        return name

    # ---- admission ----------------------------------------------------------------------------

    def admit(self) -> Callable[[], None]:
        """Take a queue slot (429 when full); returns the release, to call once when the request ends."""
        with self._admit:
            if self._depth >= self.max_queue:
                self.metrics.rejected.inc()
                retry = max(1, math.ceil(self._service_s * self._depth))
                raise ApiError(
                    429, f"server busy: {self._depth} requests queued (limit {self.max_queue}); retry in {retry} s",
                    headers={"Retry-After": str(retry)},
                )  # fmt: skip
            self._depth += 1
            self.metrics.queue_depth.set(self._depth)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                with self._admit:
                    self._depth -= 1
                    self.metrics.queue_depth.set(self._depth)

        return release

    @contextmanager
    def computing(self, cancel: Cancel | None = None):
        """Hold the compute lock (503 after request_timeout_s; compute.Cancelled when `cancel` is set)."""
        t0 = time.perf_counter()
        if not self.compute.acquire(timeout=self.request_timeout_s, cancel=cancel):
            raise ApiError(503, f"timed out after {self.request_timeout_s:.0f} s waiting for compute; retry later")
        t1 = time.perf_counter()
        try:
            yield t1 - t0
        finally:
            self._service_s = 0.8 * self._service_s + 0.2 * (time.perf_counter() - t1)
            self.compute.release()

    # ---- plans: before the queue ----------------------------------------------------------------

    def plan_chat(self, model: str, messages: list[dict[str, str]], session: Session | None, max_tokens: int) -> Prompt:
        """The turn's prompt in `model`'s template and its token count, checked against the window (400).
        With a session, the history is what the session holds (read after its turn lock was taken)."""
        history = session.messages if session else []
        new = session.new_messages(messages) if session else messages
        if not new:
            raise ApiError(400, "no new message: the request only repeats the conversation so far", param="messages")
        m = self.pool.models[model]
        rendered = render_turn(m, history, new)
        if history:  # the history is relayed or prefilled as context, the new turn read after it
            p = Prompt(model, history, new, transcript(history), rendered, len(suffix_ids(m, rendered)))
        else:
            p = Prompt(model, history, new, rendered, "", 0)
        self._check_window(model, p, max_tokens, "messages")
        return p

    def plan_completion(self, model: str, prompt: str, max_tokens: int) -> Prompt:
        p = Prompt(model, [], [], prompt, "", 0)
        self._check_window(model, p, max_tokens, "prompt")
        return p

    def _check_window(self, model: str, p: Prompt, max_tokens: int, param: str) -> None:
        m = self.pool.models[model]
        try:
            check_window(m, len(context_ids(m, p.text)) + p.suffix_tokens, max_tokens)
        except UsageError as e:
            raise ApiError(400, str(e), param=param) from None

    # ---- turns --------------------------------------------------------------------------------

    def chat(
        self, tenant: str, p: Prompt, session: Session | None, *, max_tokens: int, temperature: float,
        transport: str = "auto", on_token: OnToken = None, cancel: Cancel | None = None,
        sampling: Sampling | None = None, store: bool = True, state_gives_way: bool = False,
        reply_sent: threading.Event | None = None,
    ) -> Served:  # fmt: skip
        """One chat turn, planned by plan_chat. With a session, the conversation so far is relayed from
        the state the previous turn's model left and only the new turn (in `model`'s template) is prefilled;
        the state this turn leaves is built after its reply (`leave`: once `reply_sent` is set; none with `store`
        false; `state_gives_way`: only while no other request comes in)."""
        model, history = p.model, p.history
        gen = dict(max_new_tokens=max_tokens, temperature=temperature, on_token=cancellable(on_token, cancel),
                   sampling=sampling)  # fmt: skip
        self.states.give_way(session)  # a state built only because the server was idle never delays a request
        settled = self.states.settle(session, cancel) if session else {}  # before the lock: the build needs it
        relay = session is not None and session.state is not None
        with self.computing(cancel) as waited:
            if relay:
                res = self.pool.continue_from(session.state, model, p.suffix, tenant=tenant, transport=transport, **gen)
            elif history:  # a conversation whose state was dropped (memory budget) or cannot be read
                res = self.pool.native(model, p.text, p.suffix, **gen)
                res.reason = res.decision["reason"] = f"{session.no_state}: native prefill of the transcript"
            else:
                res = self.pool.native(model, p.text, "", **gen)
                res.reason = res.decision["reason"] = (
                    "first turn of the conversation: nothing to relay" if session else "no conversation: stateless"
                )
        n_suffix = p.suffix_tokens  # a separate suffix only after a context
        report = self._report(res, model, waited)
        # what this turn prefilled natively: only the new turn when the history was relayed
        report["prefilled_tokens"] = n_suffix if res.transport != "native" else res.context_tokens + n_suffix
        self.leave(session, p, tenant, res.text, store, settled, report, state_gives_way, reply_sent)
        return Served(res, report, self.prompt_tokens(p))

    def leave(
        self, session: Session | None, p: Prompt, tenant: str, reply: str, store: bool, settled: dict, report: dict,
        gives_way: bool = False, reply_sent: threading.Event | None = None,
    ) -> None:  # fmt: skip
        """After the turn (the compute lock released): the conversation takes the turn and its state is built
        in the background (state_builder.py); the report says how that state is made and what this turn read."""
        if session is None:
            report.update(next_state="none", next_state_build=None)
            return
        relayed_from = session.model
        how = self.states.leave(session, p.model, tenant, [*p.history, *p.new], reply, store, gives_way, reply_sent)
        report.update(conversation=session.id, turn=session.turns, relayed_from=relayed_from, **settled)
        # "extend" | "prefill" (built after this reply ends, off the request path) | "none"
        report.update(next_state=how, next_state_build="background" if how != "none" else None)

    def prompt_tokens(self, p: Prompt) -> int:
        """`usage.prompt_tokens`: the receiver's own chat template over the whole conversation, whatever this
        turn read (a relayed turn reads the history in transcript form)."""
        m = self.pool.models[p.model]
        return len(prompt_ids(m, [*p.history, *p.new])) if p.new else len(context_ids(m, p.text))

    def complete(
        self, p: Prompt, *, max_tokens: int, temperature: float, on_token: OnToken = None, cancel: Cancel | None = None,
        sampling: Sampling | None = None,
    ) -> Served:  # fmt: skip
        """A plain completion, planned by plan_completion: the prompt is prefilled natively (completions
        keep no conversation)."""
        model = p.model
        self.states.give_way(None)
        with self.computing(cancel) as waited:
            res = self.pool.native(model, p.text, "", max_new_tokens=max_tokens, temperature=temperature,
                                   on_token=cancellable(on_token, cancel), sampling=sampling)  # fmt: skip
        res.reason = res.decision["reason"] = "completion: stateless prompt"
        return Served(res, self._report(res, model, waited), res.context_tokens)

    def _report(self, res: RelayResult, model: str, waited: float) -> dict:
        self.metrics.observe_turn(model, res.transport, res.reason, res.ttft_s)
        return {
            "model": model, "transport": res.transport, "reason": res.reason, "ttft_s": res.ttft_s,
            "total_s": res.total_s, "timings": res.timings, "context_tokens": res.context_tokens,
            "queue_wait_s": waited, "decision": res.decision,
        }  # fmt: skip


def cancellable(on_token: OnToken, cancel: Cancel | None) -> OnToken:
    """The decode loop's per-token callback, raising compute.Cancelled once `cancel` is set: the
    decode (runner.decode calls it per token) stops at its next token and the turn unwinds."""
    if cancel is None:
        return on_token

    def each(token: int) -> None:
        cancel.check()
        if on_token is not None:
            on_token(token)

    return each
