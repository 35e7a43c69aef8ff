"""Conversations in Redis: several `ctxrelay serve` processes sharing one Redis serve one conversation.

A turn served by one process (one model) continues on any other process (any other model) from
what the first stored, and a process that dies loses nothing it saved. Stored values are plain
data, keyed so that other engines can read them (no Python objects):

- `ctxrelay:conv:<tenant>:<id>`: the record, JSON `{"version": 1, "id", "tenant", "messages":
  [{"role", "content"}, ...], "model" (the one that served the last turn), "state": {"tenant",
  "content_hash", "model_hash"} (the state it left), "turns", "updated" (unix seconds), "building" (unix
  seconds: the state is being built since, after the reply; state_builder.py), "no_state" (why none)}`;
- the state itself lives in the pool's state store (its Redis tier: `ctxrelay:state:<tenant>:
  <content hash>:<weights hash>`, safetensors bytes with a JSON manifest), so the next process
  reads it through the store's tenant and binding checks;
- `ctxrelay:conv-lock:<tenant>:<id>`: the turn lock, a random token set with NX and an expiry,
  renewed while the turn runs and released by compare-and-delete: two processes never run one
  conversation's turn at once (409, as within one process), and a killed process holds it for at
  most `lock_ttl_s`;
- `ctxrelay:conv-build:<tenant>:<id>`: the lease of the process building the state the last turn left,
  renewed as the turn lock is and ended once the record names the state: a record still `building` without
  it was left by a process that went away, and the next turn prefills rather than waits;
- `ctxrelay:conv-lru`: record keys by last use; past `max_sessions` the least recently used
  conversations go (their id then answers 404 like any unknown one);
- `ctxrelay:conv-state-refs`: how many records name each state (conversations with the same
  transcript on the same model share one); a state goes when no record names it any more;
- `ctxrelay:conv-prefix:<tenant>`: the tenant's content index (content_index.py), a hash from a message
  list ending with a reply to the conversation holding it; written after each save, its entries of a
  conversation dropped past `max_sessions` removed (a stale entry is a miss: the reader compares messages).

The record is read again once the lock is taken (another process may have served a turn since
`open`), and `save` writes it only while the lock is still this turn's (one Lua script). The state a
turn leaves is built after its reply and named in the record by `attach` once it is stored whole; a
next turn on another process reads the record again until it is (`refresh`).

Redis unavailable mid-request: reading the record or taking the lock answers 503 (the transcript
and its owner are there; without them the turn could neither be checked nor saved); a state that
cannot be read makes the turn a native prefill of the transcript, and its reason says so; a turn
that cannot be saved answers 503 rather than a reply the next turn would not know about.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass

from ctxrelay.errors import UsageError
from ctxrelay.relay.store import RedisStore, StateKey, StateStore, StoreUnavailable, TieredStore
from ctxrelay.serve.content_index import Messages, RedisIndex
from ctxrelay.serve.errors import ApiError
from ctxrelay.serve.metrics import CountedStore
from ctxrelay.serve.sessions import (
    DROPPED,
    ISSUED,
    NEW,
    Built,
    Conversations,
    Session,
    SessionStore,
    busy,
    chosen,
    new_id,
    unknown,
)
from ctxrelay.state import ContextState

log = logging.getLogger("ctxrelay.serve")

VERSION = 1
GONE = "the process building the conversation's state went away before it was stored"

# only the holder of the lock's token extends it, releases it or writes what it guards
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_UNLOCK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# the save: the record and its last use, and the states' reference counts (ARGV[4] the state it
# names now, '' for none; the one it named is read from the stored record, which a background build may
# have named after this turn began): -1 lock lost, the old state's ref where nothing names it any more, else 0
_SAVE = """if redis.call('get', KEYS[1]) ~= ARGV[1] then return -1 end
local old = ''
local raw = redis.call('get', KEYS[2])
if raw then
  local st = cjson.decode(raw)['state']
  if type(st) == 'table' then old = st['tenant'] .. ':' .. st['content_hash'] .. ':' .. st['model_hash'] end
end
redis.call('set', KEYS[2], ARGV[2])
redis.call('zadd', KEYS[3], ARGV[3], KEYS[2])
if ARGV[4] == old then return 0 end
if ARGV[4] ~= '' then redis.call('hincrby', KEYS[4], ARGV[4], 1) end
if old ~= '' and redis.call('hincrby', KEYS[4], old, -1) <= 0 then
  redis.call('hdel', KEYS[4], old)
  return old
end
return 0"""
_UNREF = """if redis.call('hincrby', KEYS[1], ARGV[1], -1) > 0 then return 0 end
redis.call('hdel', KEYS[1], ARGV[1])
return 1"""


@dataclass
class _Turn:
    token: str  # this turn's lock token


class RedisSessionStore:
    kind = "redis"

    def __init__(
        self, client, states: StateStore, *, prefix: str = "ctxrelay", max_sessions: int = 1000,
        lock_ttl_s: float = 30.0,
    ):  # fmt: skip
        import redis

        self.client, self.states, self.prefix, self.max_sessions = client, states, prefix, max_sessions
        self.lock_ms = max(1, int(lock_ttl_s * 1000))
        self._errors = (redis.exceptions.RedisError, OSError)
        scripts = (_RENEW, _UNLOCK, _SAVE, _UNREF)
        self._renew, self._unlock, self._save, self._unref = (client.register_script(s) for s in scripts)
        self.index = RedisIndex(client, prefix)
        self._turns: dict[str, _Turn] = {}  # lock key -> the turn this process runs under it
        self._builds: dict[str, str] = {}  # build lease key -> its token, for the states this process builds
        self._mutex = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._keep_locks, name="ctxrelay-session-locks", daemon=True).start()

    # ---- keys ---------------------------------------------------------------------------------

    def record_key(self, tenant: str, conversation: str) -> str:
        return f"{self.prefix}:conv:{tenant}:{conversation}"

    def lock_key(self, tenant: str, conversation: str) -> str:
        return f"{self.prefix}:conv-lock:{tenant}:{conversation}"

    def build_key(self, tenant: str, conversation: str) -> str:
        """The lease of the process building a conversation's state (renewed as the turn lock is): without
        it a record that says `building` was left by a process that went away, and nobody waits for it."""
        return f"{self.prefix}:conv-build:{tenant}:{conversation}"

    @property
    def lru_key(self) -> str:
        return f"{self.prefix}:conv-lru"

    @property
    def refs_key(self) -> str:
        """A hash: state (tenant:content_hash:model_hash) -> how many records name it. Conversations
        with the same transcript on the same model share one state; it goes when the last one moves on."""
        return f"{self.prefix}:conv-state-refs"

    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except self._errors as e:
            why = f"the conversation store (redis) is unavailable: cannot {what} ({e}); retry later"
            raise ApiError(503, why) from None

    # ---- the turn -----------------------------------------------------------------------------

    def open(self, conversation: str, tenant: str) -> Session:
        """A new session for "new" or a client-chosen id with no record yet (stored by its first turn's save),
        else the tenant's own (404 otherwise)."""
        if conversation == NEW:
            return Session(new_id(), tenant)
        s = Session(conversation, tenant)
        if self._load_record(s, missing_ok=chosen(conversation)) is _MISSING:
            return Session(conversation, tenant)
        return s

    def find(self, tenant: str, messages: Messages, limit: int) -> list[tuple[str, int]]:
        """The tenant's conversations whose messages begin `messages` (by the content index: the caller
        compares the messages), as (id, how many), longest first, at most `limit` messages."""
        return self._call("read the content index", self.index.find, tenant, messages, limit)

    def hold(self, s: Session) -> None:
        """Take the conversation's lock (409 while another process or request holds it), then read
        the record again and the state it names."""
        lock, token = self.lock_key(s.tenant, s.id), secrets.token_hex(16)
        if not self._call("lock the conversation", self.client.set, lock, token, nx=True, px=self.lock_ms):
            raise busy(s.id)
        with self._mutex:
            self._turns[lock] = _Turn(token)
        try:
            # a conversation that has a record (a client-chosen id may have got one since `open`): what the
            # last turn, on any process, saved
            if s.turns or chosen(s.id):
                key = self._load_record(s, missing_ok=chosen(s.id))
                if key is not _MISSING:
                    self._load_state(s, key)
        except BaseException:
            self.release(s)
            raise

    def save(self, s: Session) -> None:
        """After the turn: its state into the state store, then the record (only while this turn still
        holds the lock). 503 or 409 when it cannot be saved: the client sends the turn again."""
        lock = self.lock_key(s.tenant, s.id)
        turn = self._turns[lock]
        try:
            key = self.states.put(s.state) if s.state is not None else None
        except StoreUnavailable as e:
            raise ApiError(503, f"the conversation's state could not be stored ({e}); this turn was not saved, "
                                "send it again") from None  # fmt: skip
        record = {
            "version": VERSION, "id": s.id, "tenant": s.tenant, "messages": s.messages, "model": s.model,
            "state": None if key is None else {"tenant": key.tenant, "content_hash": key.content_hash,
                                               "model_hash": key.model_hash},
            "turns": s.turns, "updated": time.time(), "building": s.building,
            "no_state": None if key is not None or s.building is not None else s.no_state,
        }  # fmt: skip
        if s.building is not None:  # before the record says so: a reader never sees `building` without a lease
            self._lease(self.build_key(s.tenant, s.id), turn.token)
        keys = [lock, self.record_key(s.tenant, s.id), self.lru_key, self.refs_key]
        args = [turn.token, json.dumps(record), record["updated"], _ref(key)]
        done = self._call("save the conversation (this turn was not saved)", self._save, keys=keys, args=args)
        if done == -1:
            self._forget_unnamed(key)
            ttl = self.lock_ms / 1000
            why = f"conversation {s.id} lost its turn lock (not renewed within {ttl:g} s); this turn was not saved"
            raise ApiError(409, why + ", send it again")
        if isinstance(done, bytes):
            self._forget_state(_key(done.decode()))  # no conversation names it any more
        try:  # after the record: an entry always names a conversation that holds what it says
            self.index.put(s.tenant, s.id, s.messages)
        except self._errors as e:  # the turn is saved; only its reuse by content is lost
            log.warning("conversation %s: content index not written (%s)", s.id, e)
        self._bound()

    def release(self, s: Session) -> None:
        """Release the lock (compare-and-delete: never another turn's); where Redis cannot be reached
        the lock expires by itself within lock_ttl_s."""
        lock = self.lock_key(s.tenant, s.id)
        with self._mutex:
            turn = self._turns.pop(lock, None)
        s.state = None  # between turns the state lives in the store, not in this process
        if turn is None:
            return
        try:
            self._unlock(keys=[lock], args=[turn.token])
        except self._errors as e:
            log.warning("conversation %s: lock not released (%s); it expires in %g s", s.id, e, self.lock_ms / 1000)

    def attach(self, s: Session, turn: int, state: ContextState | None, why: str) -> Built:
        """The state built after turn `turn` was saved (None: `why` not): stored whole first, then named in the
        record, which must still be that turn's (a later turn that stopped waiting for it has moved on;
        WATCH makes the check and the write one step). Other processes read it only once it is named."""
        lease = self.build_key(s.tenant, s.id)
        try:
            return self._attach(s, turn, state, why)
        finally:
            with self._mutex:
                token = self._builds.pop(lease, None)
            if token is not None:
                try:
                    self._unlock(keys=[lease], args=[token])
                except self._errors as e:
                    log.warning("conversation %s: build lease not released (%s); it expires by itself", s.id, e)

    def _attach(self, s: Session, turn: int, state: ContextState | None, why: str) -> Built:
        key = self.states.put(state) if state is not None else None  # StoreUnavailable: the build failed
        rk = self.record_key(s.tenant, s.id)

        def name(pipe) -> bool:
            raw = pipe.get(rk)
            rec = json.loads(raw) if raw else None
            if rec is None or rec.get("turns") != turn or rec.get("building") is None:
                return False
            rec.update(building=None, no_state=why or None, state=None if key is None else {
                "tenant": key.tenant, "content_hash": key.content_hash, "model_hash": key.model_hash})  # fmt: skip
            pipe.multi()
            pipe.set(rk, json.dumps(rec))
            if key is not None:
                pipe.hincrby(self.refs_key, _ref(key), 1)
            return True

        if not self.client.transaction(name, rk, value_from_callable=True):
            self._forget_unnamed(key)
            return None, "a later turn moved on before the state was built"
        return state, why

    def refresh(self, s: Session) -> None:
        """Read the record again while another process builds its state: `s.building`, and the state once named
        (the turn lock is held, so only the state's fields can have changed)."""
        key = self._load_record(s)
        if s.building is not None and not self._call("read the build lease", self.client.exists,
                                                     self.build_key(s.tenant, s.id)):  # fmt: skip
            key = self._load_record(s)  # named in between (attach names it, then ends the lease)?
            if s.building is not None:
                s.building, s.no_state = None, GONE
        if s.building is None:
            self._load_state(s, key)

    def trim(self) -> int:
        """States held by this process between turns: none (Redis bounds its own memory)."""
        return 0

    def __len__(self) -> int:
        try:
            return int(self.client.zcard(self.lru_key))
        except self._errors as e:
            log.warning("conversation count unavailable: %s", e)
            return 0

    def close(self) -> None:
        self._closed.set()

    # ---- internals ----------------------------------------------------------------------------

    def _load_record(self, s: Session, missing_ok: bool = False) -> StateKey | None | object:
        """Fill `s` from its record (404 when there is none for this tenant, or _MISSING where `missing_ok`);
        returns the state key it names."""
        raw = None
        if ISSUED.fullmatch(s.id) or chosen(s.id):
            raw = self._call("read the conversation", self.client.get, self.record_key(s.tenant, s.id))
        if raw is None:
            if missing_ok:
                return _MISSING
            raise unknown(s.id)
        try:
            rec = json.loads(raw)
            if rec["version"] != VERSION:
                raise ValueError(f"record version {rec['version']}, this server reads {VERSION}")
            if rec["tenant"] != s.tenant or rec["id"] != s.id:
                raise unknown(s.id)
            s.messages, s.model, s.turns = list(rec["messages"]), rec["model"], int(rec["turns"])
            s.building = rec.get("building")  # a state being built (by some process) since then
            if rec.get("no_state"):
                s.no_state = rec["no_state"]
            st = rec["state"]
            # the key is rebuilt with the reader's tenant: a record can never name another tenant's state
            return None if st is None else StateKey(s.tenant, str(st["content_hash"]), str(st["model_hash"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ApiError(500, f"conversation {s.id}'s record in redis is unreadable ({e})") from None

    def _load_state(self, s: Session, key: StateKey | None) -> None:
        s.state = None
        if key is None:
            if s.building is None and s.no_state == DROPPED:  # the record gave no reason of its own
                s.no_state = "the conversation's record names no state"
            return
        try:
            s.state = self.states.get(key, s.tenant)
        except StoreUnavailable as e:
            s.no_state = f"the conversation's state could not be read ({e})"
            return
        if s.state is None:
            s.no_state = "the conversation's state is no longer in the state store (evicted or expired)"

    def _forget_unnamed(self, key: StateKey | None) -> None:
        """A state this turn stored but could not name in its record: gone unless a record names it."""
        try:
            if key is not None and not self.client.hexists(self.refs_key, _ref(key)):
                self._forget_state(key)
        except self._errors as e:
            log.warning("unnamed conversation state %s not deleted: %s", key, e)

    def _forget_state(self, key: StateKey) -> None:
        try:
            self.states.delete(key)
        except StoreUnavailable as e:
            log.warning("old conversation state %s not deleted: %s", key, e)

    def _bound(self) -> None:
        """Past max_sessions, drop the least recently used conversations (record and state)."""
        try:
            extra = int(self.client.zcard(self.lru_key)) - self.max_sessions
            for member, _ in self.client.zpopmin(self.lru_key, extra) if extra > 0 else []:
                raw = self.client.getdel(member)
                rec = json.loads(raw) if raw else None
                if rec is not None:
                    self.index.remove(rec["tenant"], rec["id"], rec["messages"])
                st = rec["state"] if rec else None
                key = None if st is None else StateKey(st["tenant"], st["content_hash"], st["model_hash"])
                if key is not None and self._unref(keys=[self.refs_key], args=[_ref(key)]):
                    self._forget_state(key)
        except (*self._errors, ValueError, KeyError, TypeError) as e:
            log.warning("conversation bound not applied: %s", e)

    def _lease(self, key: str, token: str) -> None:
        self._call("take the build lease", self.client.set, key, token, px=self.lock_ms)
        with self._mutex:
            self._builds[key] = token

    def _keep_locks(self) -> None:
        """Extend the locks of the turns and the leases of the builds this process runs, three times per lock_ttl_s."""
        while not self._closed.wait(self.lock_ms / 3000):
            with self._mutex:
                held = [(lock, t.token) for lock, t in self._turns.items()] + list(self._builds.items())
            for lock, token in held:
                try:
                    self._renew(keys=[lock], args=[token, self.lock_ms])
                except self._errors as e:
                    log.warning("conversation lock %s not renewed: %s", lock, e)


_MISSING = object()  # _load_record: no record (a client-chosen id not used yet)


def _ref(key: StateKey | None) -> str:
    return "" if key is None else f"{key.tenant}:{key.content_hash}:{key.model_hash}"


def _key(ref: str) -> StateKey:
    tenant, content_hash, model_hash = ref.rsplit(":", 2)
    return StateKey(tenant, content_hash, model_hash)


def redis_tier(store: StateStore) -> RedisStore | None:
    """The Redis backend of a state store (itself, inside the server's counting wrapper or a tier)."""
    if isinstance(store, RedisStore):
        return store
    if isinstance(store, CountedStore):
        return redis_tier(store.inner)
    if isinstance(store, TieredStore):
        return next((r for t in store.tiers if (r := redis_tier(t)) is not None), None)
    return None


def open_sessions(
    spec: str, states: StateStore, *, max_sessions: int, max_state_bytes: int, lock_ttl_s: float
) -> Conversations:
    """'memory'; 'redis://HOST:PORT/DB'; 'auto' (the default): Redis, on the state store's server,
    when the state store has a Redis tier, else memory."""
    tier = redis_tier(states)
    if spec == "memory" or (spec == "auto" and tier is None):
        return SessionStore(max_sessions, max_state_bytes)
    if spec == "auto":
        client = tier.client
    elif spec.startswith("redis://"):
        if tier is None:
            raise UsageError(
                f"--sessions {spec} keeps conversations in Redis, but their states would stay in this process's "
                "store, where other processes cannot read them: use --store redis://... as well"
            )
        import redis

        client = redis.Redis.from_url(spec, socket_timeout=2.0, socket_connect_timeout=2.0)
    else:
        raise UsageError(f"unknown conversation store {spec!r}: use auto, memory or redis://HOST:PORT/DB")
    return RedisSessionStore(client, states, max_sessions=max_sessions, lock_ttl_s=lock_ttl_s)
