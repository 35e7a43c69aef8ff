"""The content index: per tenant, which conversation holds a given message list, so a client that only
resends its history (no conversation id) finds the conversation, and the state, it continues.

A key is a hash of the tenant and a message list up to and including an assistant reply: the points
where a conversation's state can stand (a stored conversation always ends with a reply; a turn reads its
history from a state and renders what follows, a user message first, in its model's chat template). The
value is the conversation id; where several conversations share a prefix, the last one saved names it.
An entry is a pointer, never proof: the reader opens the conversation and compares the messages
themselves, so a stale entry (a conversation gone or rewound) or a collision is a miss, never a wrong
state. Only conversation records are indexed, and a record only ever names the exact state the state
builder made of its transcript (state_builder.py); a relayed turn's receiver cache, which is approximate,
is never a state, so it can be in no index.

`MemoryIndex` serves the in-process conversation store (sessions.py), `RedisIndex` the shared one
(shared_sessions.py): one hash per tenant, `<prefix>:conv-prefix:<tenant>`, field = prefix hash, value =
conversation id.
"""

from __future__ import annotations

import hashlib
import json

Messages = list[dict[str, str]]

# remove the fields (ARGV[2..]) that still name conversation ARGV[1]: another conversation may have taken them
_DROP = """local n = 0
for i = 2, #ARGV do
  if redis.call('hget', KEYS[1], ARGV[i]) == ARGV[1] then n = n + redis.call('hdel', KEYS[1], ARGV[i]) end
end
return n"""


def prefix_hashes(tenant: str, messages: Messages) -> list[tuple[int, str]]:
    """(k, hash) for each k such that messages[:k] ends with an assistant reply, shortest first. The hash
    covers the tenant and every role and content exactly (one character changed is another key)."""
    h = hashlib.sha256(b"ctxrelay-prefix\0" + json.dumps(tenant).encode())
    out = []
    for i, m in enumerate(messages):
        h.update(json.dumps([m["role"], m["content"]], ensure_ascii=False).encode() + b"\n")  # self-delimiting
        if m["role"] == "assistant":
            out.append((i + 1, h.copy().hexdigest()))
    return out


def candidates(tenant: str, messages: Messages, limit: int) -> list[tuple[int, str]]:
    """The prefixes of `messages` worth looking up, longest first: at most `limit` messages (a request
    keeps at least one message of its own to answer)."""
    return [(k, h) for k, h in reversed(prefix_hashes(tenant, messages)) if k <= limit]


class MemoryIndex:
    """The index in this process (the caller holds its store's lock)."""

    def __init__(self) -> None:
        self._by_hash: dict[str, tuple[str, str]] = {}  # prefix hash -> (tenant, conversation)
        self._of: dict[tuple[str, str], list[str]] = {}  # (tenant, conversation) -> the hashes it put

    def __len__(self) -> int:
        return len(self._by_hash)

    def put(self, tenant: str, conversation: str, messages: Messages) -> None:
        """Index a conversation's messages as they are now (the entries of a rewound past are dropped)."""
        key = (tenant, conversation)
        hashes = [h for _, h in prefix_hashes(tenant, messages)]
        self._drop(key, set(self._of.get(key, ())) - set(hashes))
        for h in hashes:
            self._by_hash[h] = key
        self._of[key] = hashes

    def remove(self, tenant: str, conversation: str) -> None:
        key = (tenant, conversation)
        self._drop(key, self._of.pop(key, ()))

    def find(self, tenant: str, messages: Messages, limit: int) -> list[tuple[str, int]]:
        """(conversation, k) for the indexed prefixes of `messages`, longest first."""
        out = []
        for k, h in candidates(tenant, messages, limit):
            hit = self._by_hash.get(h)
            if hit is not None and hit[0] == tenant:
                out.append((hit[1], k))
        return out

    def _drop(self, key: tuple[str, str], hashes) -> None:
        for h in hashes:
            if self._by_hash.get(h) == key:
                del self._by_hash[h]


class RedisIndex:
    """The index in Redis, shared by every server process on it. Errors are the caller's to handle."""

    def __init__(self, client, prefix: str):
        self.client, self.prefix = client, prefix
        self._drop = client.register_script(_DROP)

    def key(self, tenant: str) -> str:
        return f"{self.prefix}:conv-prefix:{tenant}"

    def put(self, tenant: str, conversation: str, messages: Messages) -> None:
        hashes = prefix_hashes(tenant, messages)
        if hashes:
            self.client.hset(self.key(tenant), mapping={h: conversation for _, h in hashes})

    def remove(self, tenant: str, conversation: str, messages: Messages) -> None:
        """Drop the entries of a conversation that is gone (those another conversation took stay)."""
        self.forget(tenant, conversation, [h for _, h in prefix_hashes(tenant, messages)])

    def forget(self, tenant: str, conversation: str, hashes: list[str]) -> None:
        if hashes:
            self._drop(keys=[self.key(tenant)], args=[conversation, *hashes])

    def find(self, tenant: str, messages: Messages, limit: int) -> list[tuple[str, int]]:
        wanted = candidates(tenant, messages, limit)
        if not wanted:
            return []
        ids = self.client.hmget(self.key(tenant), [h for _, h in wanted])
        return [(i.decode(), k) for (k, _), i in zip(wanted, ids, strict=True) if i is not None]
