"""Which stored conversation a chat request continues, and the state it reads: reuse keyed by content.

A client may name its conversation (an id the server issued, or one it chose) or name none and resend
the whole history each turn, as OpenAI's API has it. Either way the messages decide what state is
reusable, within the request's tenant only:

- a named conversation whose messages the request resends and extends: that conversation, its own state
  (`reuse: "id"`). A request that does not begin with them and holds no assistant reply is read as only
  the new messages, which follow the conversation's history (a resend holds the replies);
- otherwise the tenant's content index (content_index.py) gives the longest stored message list, ending
  with a reply, that begins the request. Where that list is a whole conversation and the request names
  none, the request is that conversation's next turn; else the state of the prefix is cut from that
  conversation's state (`prefix_state`) and seeds the request's own conversation, a new one or the one
  its id names (`reuse: "content"`);
- a named conversation resent with an edit (or cut short) continues from the longest common prefix that
  ends with a reply, its own state cut to it (`reuse: "id"`);
- nothing found: a new conversation, whose first turn reads the whole request natively (`reuse: "none"`).

What follows the reused prefix is prefilled natively, in the model's chat template, so a resent or edited
history is never read twice: `usage.prompt_tokens` equals that of the same messages sent fresh.
`store: false` without an id: nothing is looked up and no conversation is kept (stateless).

What is reused is exact. A conversation holds the exact state of its transcript on the model of its last
turn (state_builder.py builds it after the reply; a relayed turn's receiver cache, approximate, is never
kept): the same model continues from it (self_kv), another model relays it through the gate. A cut state
is exact too (causal attention: a prefix's K/V do not depend on what follows), and is only cut where the
prefix's own tokens equal the state's first tokens.

The request's conversation is held for its turn (409 only for a named one that is busy); a conversation
whose state seeds another is held only while that state is read (busy: the next candidate), so a
request that names no conversation never gets 409. A turn that fails or is cancelled leaves its named
conversation as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ctxrelay.models.tokens import tokenize_context
from ctxrelay.relay.api import ModelPool
from ctxrelay.serve.chat import transcript
from ctxrelay.serve.compute import Cancel
from ctxrelay.serve.content_index import Messages
from ctxrelay.serve.errors import ApiError
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.sessions import NEW, Conversations, Session
from ctxrelay.serve.state_builder import StateBuilder
from ctxrelay.state import ContextState

CONTENT, ID, NONE = "content", "id", "none"


@dataclass
class Found:
    """What a chat request continues: its conversation (held; None: stateless) and the reused history."""

    session: Session | None
    by: str = NONE  # how the reused state was found: content | id | none
    upto: int = 0  # the request's messages that state covers: the turn's history
    why: str = ""
    source: Session | None = None  # another conversation whose state seeds `session` (held until `seed`)
    reset: bool = False  # `seed` sets the session's history to `prefix` and its state to match
    prefix: Messages = field(default_factory=list)
    looked_up: bool = False  # the content index was asked (counted in /metrics)
    wait_s: float = 0.0
    undo: tuple | None = None  # what `seed` replaced, put back where the turn is not saved

    def planned(self) -> Session | None:
        """The session as the turn reads it (plan_chat): its history is the reused prefix."""
        if self.session is None or not self.reset:
            return self.session
        return replace(self.session, messages=self.prefix)


class Finder:
    """Finds and holds a chat request's conversation (`open`), gives it the reused state (`seed`), reports."""

    def __init__(self, sessions: Conversations, states: StateBuilder, pool: ModelPool, metrics: Metrics):
        self.sessions, self.states, self.pool, self.metrics = sessions, states, pool, metrics

    # ---- before the queue: the conversation (in the turn's thread) -------------------------------

    def open(self, tenant: str, hint: str | None, messages: Messages, store: bool) -> Found:
        """The conversation `messages` continue (held), from the id the request names (`hint`) and the content."""
        if hint is None and not store:
            return Found(None, why="store: false: nothing looked up or kept")
        if hint is None:
            try:
                found, note = self._by_content(tenant, messages, None, 0)
                return found or self._new(tenant, note)
            except ApiError as e:  # the conversation store is down: this turn still serves, without reuse
                if e.status_code != 503:
                    raise
                return Found(None, why=f"no reuse: {e.detail}")
        s = self._held(self.sessions.open(hint, tenant))
        try:
            return self._named(s, tenant, hint, messages, store)
        except BaseException:
            self.sessions.release(s)
            raise

    def _named(self, s: Session, tenant: str, hint: str, messages: Messages, store: bool) -> Found:
        if hint == NEW:
            return Found(s, why="a new conversation (conversation: new)")
        have = s.messages
        c = _common(have, messages)
        if have and c == len(have):  # resent and extended (a request that only repeats it: plan_chat's 400)
            return Found(s, ID, c, "the conversation's own state")
        if have and not any(m["role"] == "assistant" for m in messages):  # no reply of it: not a resend
            return Found(s, ID, len(have), "only new messages were sent: they follow the conversation's history")
        # a client-chosen id used for the first time, or a resend that differs from the conversation's
        own = _reply_end(messages, min(c, len(messages) - 1))
        found, note = self._by_content(tenant, messages, s, own) if store else (None, "")
        if found is not None:
            return found
        if not have:
            found = Found(s, why=f"a new conversation: no stored one begins these messages{note}")
        elif own:
            why = f"the history differs from message {c + 1} on: the conversation continues from its first {own}"
            found = Found(s, ID, own, why, reset=True, prefix=messages[:own])
        else:
            found = Found(s, why="the history differs from its first message on: the conversation starts again",
                          reset=True)  # fmt: skip
        found.looked_up = store  # the content index had nothing longer: a miss
        return found

    def _by_content(
        self, tenant: str, messages: Messages, target: Session | None, longer_than: int
    ) -> tuple[Found | None, str]:
        """The longest stored prefix of `messages` longer than `longer_than`, held (None where none is), and a
        note on a match passed over because its conversation was serving a turn."""
        busy = ""
        for cid, k in self.sessions.find(tenant, messages, len(messages) - 1):
            if k <= longer_than:
                break
            if target is not None and cid == target.id:
                continue
            try:
                src = self.sessions.open(cid, tenant)
                if src.messages[:k] != messages[:k]:  # a stale entry (rewound, or gone) or a collision
                    continue
                self.sessions.hold(src)
            except ApiError as e:
                if e.status_code not in (404, 409):
                    raise
                busy = busy or (f" (conversation {cid} was serving a turn)" if e.status_code == 409 else "")
                continue
            if src.messages[:k] != messages[:k]:  # moved on between open and hold (another process)
                self.sessions.release(src)
                continue
            if target is None and k == len(src.messages):
                return Found(src, CONTENT, k, f"the next turn of conversation {cid}", looked_up=True), ""
            try:
                target = target or self._held(self.sessions.open(NEW, tenant))
            except BaseException:
                self.sessions.release(src)
                raise
            why = f"the state of its first {k} messages, from conversation {cid}"
            return Found(target, CONTENT, k, why, src, reset=True, prefix=messages[:k], looked_up=True), ""
        return None, busy

    def _new(self, tenant: str, note: str) -> Found:
        why = f"a new conversation: no stored one begins these messages{note}"
        return Found(self._held(self.sessions.open(NEW, tenant)), why=why, looked_up=True)

    def _held(self, s: Session) -> Session:
        self.sessions.hold(s)
        return s

    # ---- in the turn, before it queues for compute ---------------------------------------------

    def seed(self, f: Found, cancel: Cancel | None) -> bool:
        """Give the conversation the state of its reused history (cut from its own state or another's).
        Returns False where that state is not at hand: the turn then reads the whole request natively and
        must be planned again (plan_chat with `f.session`, whose history is now empty)."""
        if not f.reset:
            return True
        t0, s, planned = time.perf_counter(), f.session, f.upto
        self.states.settle(s, cancel)  # its own pending build first: landing later, it would replace what is set here
        f.undo = (s.turns, s.messages, s.state, s.model, s.no_state)
        state, model, why = s.state, s.model, s.no_state
        if f.source is not None:
            try:
                self.states.settle(f.source, cancel)
                state, model, why = f.source.state, f.source.model, f.source.no_state
            finally:
                self._let_go(f)
        cut = None
        if planned and state is not None:
            cut = prefix_state(self.pool, state, transcript(f.prefix))
            why = why if cut is not None else "its state cannot be cut there (the tokens differ at that point)"
        if planned and cut is None:  # nothing to continue from: a first turn over the whole request
            f.why += f"; not reused: {why}"
            f.by, f.upto, f.prefix = NONE, 0, []
        s.messages, s.state = list(f.prefix), cut
        s.model = model if cut is not None else s.model
        f.wait_s = time.perf_counter() - t0
        return not (planned and cut is None)

    # ---- after the turn ------------------------------------------------------------------------

    def report(self, f: Found, report: dict) -> None:
        """The response's reuse fields, and the content index's hits and misses for /metrics."""
        found = f.by != NONE and report.get("state_made") is not None  # the turn had the state at hand
        why = f.why if found or f.by == NONE else f"{f.why}; no state at hand (the reason says why)"
        report.update(reuse=f.by if found else NONE, reused_messages=f.upto if found else 0, reuse_reason=why)
        if f.reset:
            report["state_wait_s"] = f.wait_s + (report.get("state_wait_s") or 0.0)
        if f.looked_up:
            self.metrics.content_reuse.labels("hit" if found and f.by == CONTENT else "miss").inc()

    def release(self, f: Found) -> None:
        """When the request ends: the conversations it holds; a turn that was not saved leaves its conversation
        as it was."""
        self._let_go(f)
        s = f.session
        if s is None:
            return
        if f.undo is not None and s.turns == f.undo[0]:
            s.messages, s.state, s.model, s.no_state = f.undo[1:]
        self.sessions.release(s)

    def _let_go(self, f: Found) -> None:
        if f.source is not None:
            src, f.source = f.source, None
            self.sessions.release(src)


def prefix_state(pool: ModelPool, state: ContextState, text: str) -> ContextState | None:
    """The state of `text`, a prefix of `state.text`, cut from `state`: exact, since under causal attention
    a prefix's K/V do not depend on what follows. None where `text` read alone tokenizes differently from
    the state's first tokens (a token spans the cut), or the state has no K/V. Transport parts (mapflow's
    maps) cover the whole text and are left out; the gate then skips the edges that read them."""
    if text == state.text:
        return state
    m = pool.models.get(state.binding.model_name)
    if m is None or m.spec.weights_hash != state.binding.weights_hash or not state.has("kv"):
        return None
    if not state.text.startswith(text):
        return None
    ids, offsets = tokenize_context(m, text)
    n = len(ids)
    if not 0 < n <= state.num_tokens:
        return None
    if not torch.equal(ids, state.tokens[:n]) or not torch.equal(offsets, state.offsets[:n]):
        return None
    return ContextState(
        text=text, tokens=state.tokens[:n], offsets=state.offsets[:n], binding=state.binding,
        keys_pre_rope=state.keys_pre_rope[:, :n], values=state.values[:, :n],
        meta={**state.meta, "cut_from": state.num_tokens},
    )  # fmt: skip


def _common(a: Messages, b: Messages) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _reply_end(messages: Messages, at_most: int) -> int:
    """The longest prefix of at most `at_most` messages that ends with an assistant reply (0: none)."""
    return next((k for k in range(at_most, 0, -1) if messages[k - 1]["role"] == "assistant"), 0)
