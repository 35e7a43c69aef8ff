"""Conversations: per tenant, the messages so far and the state the last serving model left.

Ids are issued by the server (`conversation: "new"`: `conv-` and 24 unguessable characters), or chosen
by the client (any other id of letters, digits and `._~-`, up to 128). Ids live in their tenant's
namespace: two tenants may choose the same id and get two conversations. A request naming an issued id
that is not ITS tenant's gets 404, the same answer as an unknown id, so ids leak nothing across
tenants; a client-chosen id that is not there yet names a new conversation (stored by its first turn).
Each store keeps a content index of its conversations (content_index.py), so a request that names no
conversation finds the one whose messages it continues (reuse.py). The store is bounded twice: past
`max_sessions` the least recently used conversation is dropped (an issued id then answers 404 like any
unknown one; its content index entries go with it); past `max_state_bytes` of held states the
least recently used conversations lose their state but keep their messages (their next turn is a
native prefill of the transcript, and says so). A conversation serves one turn at a time (409
while a turn is running): the next turn needs the state this one leaves.

`SessionStore` keeps conversations in this process (the default); `RedisSessionStore`
(shared_sessions.py) keeps them in Redis so several server processes serve one conversation. Both
answer the same calls, in this order per turn: `open` (404), `hold` (409), the turn, `save`, `release`;
the state the turn leaves is built after its reply (state_builder.py) and named by `attach`.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from ctxrelay.serve.content_index import MemoryIndex, Messages
from ctxrelay.serve.errors import ApiError
from ctxrelay.state import ContextState

NEW = "new"
ISSUED = re.compile(r"conv-[A-Za-z0-9_-]{1,64}")  # what new_id issues
_CHOSEN = re.compile(r"[A-Za-z0-9_.~-]{1,128}")  # ids a client may choose (no ':', the Redis keys' separator)
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


def checked_id(conversation: str) -> str:
    """A conversation id as a request names it: "new", an issued id, or one the client chose (400 otherwise)."""
    if conversation == NEW or ISSUED.fullmatch(conversation) or chosen(conversation):
        return conversation
    raise ApiError(400, "a conversation id is 'new' or 1-128 letters, digits and . _ ~ - (ids starting 'conv-' "
                        "are the server's)", param="conversation")  # fmt: skip


def chosen(conversation: str) -> bool:
    """An id the client chose (not the server's form, which answers 404 when unknown)."""
    return conversation != NEW and not conversation.startswith("conv-") and bool(_CHOSEN.fullmatch(conversation))


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
    def find(self, tenant: str, messages: Messages, limit: int) -> list[tuple[str, int]]: ...
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
        self._by_id: OrderedDict[tuple[str, str], Session] = OrderedDict()  # (tenant, id): ids are per tenant
        self._index = MemoryIndex()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, conversation: str, tenant: str) -> Session:
        """A new session for "new" or a client-chosen id not seen yet, else the tenant's own session of
        that id (404 otherwise)."""
        with self._lock:
            s = self._by_id.get((tenant, conversation))
            if s is not None:
                self._by_id.move_to_end((tenant, conversation))
                return s
            if conversation != NEW and not chosen(conversation):
                raise unknown(conversation)
            s = Session(new_id() if conversation == NEW else conversation, tenant)
            self._by_id[(tenant, s.id)] = s
            while len(self._by_id) > self.max_sessions:
                (t, i), _ = self._by_id.popitem(last=False)
                self._index.remove(t, i)
            return s

    def find(self, tenant: str, messages: Messages, limit: int) -> list[tuple[str, int]]:
        """The tenant's conversations whose messages begin `messages` (by the content index: the caller
        compares the messages), as (id, how many), longest first, at most `limit` messages."""
        with self._lock:
            return self._index.find(tenant, messages, limit)

    def hold(self, s: Session) -> None:
        """Take the conversation for one turn (409 while another turn of it runs)."""
        if not s.busy.acquire(blocking=False):
            raise busy(s.id)

    def save(self, s: Session) -> None:
        """After a turn: the session object was updated in place; the content index learns its messages."""
        with self._lock:
            if self._by_id.get((s.tenant, s.id)) is s:  # not dropped meanwhile (max_sessions)
                self._index.put(s.tenant, s.id, s.messages)

    def release(self, s: Session) -> None:
        """Free the conversation for its next turn; one whose first turn never ran is dropped
        (nobody holds its id yet)."""
        if s.turns == 0:
            with self._lock:
                if self._by_id.get((s.tenant, s.id)) is s:
                    del self._by_id[(s.tenant, s.id)]
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
