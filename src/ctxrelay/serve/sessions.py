"""Conversations: per tenant, the messages so far and the state the last serving model left.

Ids are issued by the server (`conversation: "new"`) and unguessable; a request naming an id that
was not issued to ITS tenant gets 404, the same answer as an unknown id, so ids leak nothing across
tenants. The store is bounded twice: past `max_sessions` the least recently used conversation is
dropped (its id then answers 404 like any unknown one); past `max_state_bytes` of held states the
least recently used conversations lose their state but keep their messages (their next turn is a
native prefill of the transcript, and says so). A conversation serves one turn at a time (409
while a turn is running): the next turn needs the state this one leaves.

`SessionStore` keeps conversations in this process (the default); `RedisSessionStore`
(shared_sessions.py) keeps them in Redis so several server processes serve one conversation. Both
answer the same calls, in this order per turn: `open` (404), `hold` (409), the turn, `save`, `release`;
the state the turn leaves is built after its reply (state_builder.py) and named by `attach`.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from ctxrelay.serve.errors import ApiError
from ctxrelay.state import ContextState

NEW = "new"
DROPPED = "the conversation's state was dropped (state memory budget)"
Built = tuple[ContextState | None, str]  # a built state as the conversation store holds it (None: why not)


def unknown(conversation: str) -> ApiError:
    """The one answer to an id that is unknown, expired or another tenant's."""
    return ApiError(
        404,
        f"no conversation {conversation!r} for this API key (start one with conversation='new'; "
        "its id comes back in ctxrelay.conversation and the X-Conversation-Id header)",
        param="conversation",
    )


def busy(conversation: str) -> ApiError:
    return ApiError(409, f"conversation {conversation} is serving another turn; send the next turn after it")


def new_id() -> str:
    return "conv-" + secrets.token_urlsafe(18)


@dataclass
class Session:
    id: str
    tenant: str
    messages: list[dict[str, str]] = field(default_factory=list)  # the transcript so far, replies included
    model: str | None = None  # the model that served the last turn
    state: ContextState | None = None  # that model's state of transcript(messages)
    turns: int = 0
    no_state: str = DROPPED  # why a conversation with messages has no state (its next turn is native)
    building: float | None = None  # when the last turn's state build began (unix s); None: not pending
    busy: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def new_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """What a request adds: the client may resend the whole history (OpenAI style) or only the
        new messages; a request that does not start with the stored history is read as the latter."""
        n = len(self.messages)
        return messages[n:] if messages[:n] == self.messages else messages


class Conversations(Protocol):
    """What the server asks of a conversation store (SessionStore, shared_sessions.RedisSessionStore)."""

    kind: str

    def open(self, conversation: str, tenant: str) -> Session: ...
    def hold(self, s: Session) -> None: ...
    def save(self, s: Session) -> None: ...
    def release(self, s: Session) -> None: ...
    def attach(self, s: Session, turn: int, state: ContextState | None, why: str) -> Built: ...
    def refresh(self, s: Session) -> None: ...
    def trim(self) -> int: ...
    def __len__(self) -> int: ...


class SessionStore:
    """Conversations in this process's memory: the Session object is the record."""

    kind = "memory"

    def __init__(self, max_sessions: int = 1000, max_state_bytes: int = 4 << 30):
        self.max_sessions, self.max_state_bytes = max_sessions, max_state_bytes
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, conversation: str, tenant: str) -> Session:
        """A new session for "new", else the tenant's own session of that id (404 otherwise)."""
        with self._lock:
            if conversation == NEW:
                s = Session(new_id(), tenant)
                self._by_id[s.id] = s
                while len(self._by_id) > self.max_sessions:
                    self._by_id.popitem(last=False)
                return s
            s = self._by_id.get(conversation)
            if s is None or s.tenant != tenant:
                raise unknown(conversation)
            self._by_id.move_to_end(conversation)
            return s

    def hold(self, s: Session) -> None:
        """Take the conversation for one turn (409 while another turn of it runs)."""
        if not s.busy.acquire(blocking=False):
            raise busy(s.id)

    def save(self, s: Session) -> None:
        """After a turn: nothing to write, the session object was updated in place."""

    def release(self, s: Session) -> None:
        """Free the conversation for its next turn; one whose first turn never ran is dropped
        (nobody holds its id yet)."""
        if s.turns == 0:
            with self._lock:
                self._by_id.pop(s.id, None)
        s.busy.release()

    def attach(self, s: Session, turn: int, state: ContextState | None, why: str) -> Built:
        """The state built after turn `turn` (None: `why` not): the session holds it unless a later turn
        moved on (one that stopped waiting for it); the memory budget applies at once. Returns what is held."""
        with self._lock:
            if s.turns != turn:
                return None, "a later turn moved on before the state was built"
            s.state, s.building = state, None
            if state is None:
                s.no_state = why
        self.trim()
        return s.state, s.no_state

    def refresh(self, s: Session) -> None:
        """Nothing to read again: a build in this process updates the session object itself."""

    def trim(self) -> int:
        """Drop the states of the least recently used conversations until the held states fit the
        byte budget; returns the bytes still held."""
        with self._lock:
            held = [(s, s.state.nbytes()) for s in self._by_id.values() if s.state is not None]
            total = sum(n for _, n in held)
            for s, n in held:  # oldest first
                if total <= self.max_state_bytes:
                    break
                s.state, s.no_state, total = None, DROPPED, total - n
            return total
