"""Prometheus metrics of one server (its own registry, so two apps in one process never clash).

Gate reasons are free text (they name models and numbers); the `reason` label is the short class
of the decision so the series stay few.
"""

from __future__ import annotations

from contextlib import contextmanager

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ctxrelay.relay.store import StateKey, StateStore
from ctxrelay.state import ContextState

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# (substring of the reason, class) in the order checked; relayed turns are "relayed"
_REASONS = [
    ("stateless", "stateless"),
    ("first turn", "first_turn"),
    ("state was dropped", "state_dropped"),
    ("native prefill requested", "requested_native"),
    ("no calibrated", "no_edge"),
    ("no transport passes the gate", "gate_rejected"),
    ("estimated top-1", "estimate_below_threshold"),
    ("failed", "relay_failed"),
    ("unavailable", "store_unavailable"),
    ("no stored state", "no_state"),
]


def reason_class(transport: str, reason: str) -> str:
    if transport != "native":
        return "relayed"
    return next((c for s, c in _REASONS if s in reason), "other")


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "ctxrelay_ttft_seconds", "Time to first token (relay or prefill, decode step included)",
            ["transport", "receiver"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "ctxrelay_gate_decisions_total", "What served each turn", ["transport", "reason"], registry=r
        )
        self.requests = Counter("ctxrelay_requests_total", "HTTP requests", ["path", "status"], registry=r)
        self.queue_depth = Gauge("ctxrelay_queue_depth", "Requests admitted and not finished", registry=r)
        self.rejected = Counter("ctxrelay_queue_rejected_total", "Requests refused with 429 (queue full)", registry=r)
        self.cancelled = Counter("ctxrelay_cancelled_total", "Turns stopped because their client went away", registry=r)
        self.sessions = Gauge("ctxrelay_conversations", "Conversations held", registry=r)
        self.store_reads = Counter("ctxrelay_store_reads_total", "State store reads", ["result"], registry=r)
        self.store_bytes = Counter("ctxrelay_store_written_bytes_total", "Bytes of states stored", registry=r)
        self.state_bytes = Gauge("ctxrelay_conversation_state_bytes", "Bytes of conversation states", registry=r)
        # the states turns leave for their next turns, built after the replies (state_builder.py)
        self.state_builds = Gauge("ctxrelay_state_builds_pending", "Conversation states being built", registry=r)
        self.state_build_s = Histogram(
            "ctxrelay_state_build_seconds", "A conversation state's build (compute only), after the reply",
            ["made"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        # chat requests that looked for a stored prefix of their messages (reuse.py): hit, a state was read
        self.content_reuse = Counter(
            "ctxrelay_content_reuse_total", "Chat requests looked up in the content index (hit: a stored state read)",
            ["result"], registry=r,
        )  # fmt: skip
        self.state_build_failures = Counter(
            "ctxrelay_state_build_failures_total", "Conversation states not built (the next turn prefills)", registry=r
        )
        self.state_builds_deferred = Counter(
            "ctxrelay_state_builds_deferred_total",
            "States of conversations begun without an id that waited for other requests", registry=r,
        )  # fmt: skip
        self.state_builds_given_way = Counter(
            "ctxrelay_state_builds_given_way_total",
            "States of conversations begun without an id, dropped: requests kept the server busy", registry=r,
        )  # fmt: skip

    def observe_turn(self, receiver: str, transport: str, reason: str, ttft_s: float) -> None:
        self.ttft.labels(transport, receiver).observe(ttft_s)
        self.decisions.labels(transport, reason_class(transport, reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountedStore(StateStore):
    """A pool's state store, its hits, misses and bytes written counted for /metrics."""

    def __init__(self, inner: StateStore, metrics: Metrics):
        self.inner, self.metrics, self.name = inner, metrics, inner.name

    def put(self, state: ContextState) -> StateKey:
        key = self.inner.put(state)
        self.metrics.store_bytes.inc(state.nbytes())
        return key

    def _counted(self, state: ContextState | None) -> ContextState | None:
        self.metrics.store_reads.labels("hit" if state is not None else "miss").inc()
        return state

    def get(self, key: StateKey, tenant: str) -> ContextState | None:
        return self._counted(self.inner.get(key, tenant))

    def delete(self, key: StateKey) -> None:
        self.inner.delete(key)

    def keys(self, tenant: str) -> list[StateKey]:
        return self.inner.keys(tenant)

    @contextmanager
    def using(self, key: StateKey, tenant: str):
        with self.inner.using(key, tenant) as state:
            yield self._counted(state)
