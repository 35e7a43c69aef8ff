"""The per-request gate: relay only when it is both faster and good enough, else native prefill.

A candidate edge must (1) be calibrated for exactly this sender and receiver version, (2) find in
the state what its transport needs and bound to the same sender, (3) have calibrated quality at or
above the operator's threshold and (4) have a predicted TTFT (plus overhead) at least `min_speedup`
times below the receiver's predicted native prefill (the margin covers the cost model's error: a
predicted 1% gain measured as a 5% loss in the demo). The cheapest survivor wins. An exact
transport (a model continuing from its own K/V) reproduces native prefill and skips it, so it needs
no quality or cost check. Every decision carries its reason. The gate knows transports only
through the registry (what each one reads from a state, whether it is exact).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ctxrelay import transports
from ctxrelay.errors import UsageError
from ctxrelay.relay.graph import Edge, TransportGraph
from ctxrelay.state import ContextState

log = logging.getLogger("ctxrelay.relay")

MIN_SPEEDUP = 1.10  # predicted native / relay TTFT an edge must reach to be chosen over native


@dataclass
class Decision:
    transport: str  # "native" or the chosen edge's transport
    reason: str
    edge: Edge | None = None
    predicted_native_s: float | None = None
    predicted_relay_s: float | None = None
    rejected: list[str] = field(default_factory=list)  # one line per candidate turned down

    def as_dict(self) -> dict:
        return {
            "transport": self.transport,
            "reason": self.reason,
            "edge": self.edge.label if self.edge else None,
            "predicted_native_s": self.predicted_native_s,
            "predicted_relay_s": self.predicted_relay_s,
            "rejected": self.rejected,
        }


def requestable() -> list[str]:
    """What a request may name as its transport."""
    return ["auto", "native", *transports.names()]


def _unusable(edge: Edge, state: ContextState, receiver_hash: str) -> str | None:
    """Why this edge cannot serve this state at all (binding or content), or None."""
    b = state.binding
    if edge.sender["weights_hash"] != b.weights_hash or edge.sender["tokenizer_hash"] != b.tokenizer_hash:
        return f"artifact is bound to sender {edge.sender['name']}, state came from {b.model_name} (hash mismatch)"
    if edge.receiver["weights_hash"] != receiver_hash:
        return f"artifact is bound to another version of receiver {edge.receiver['name']}"
    need = transports.get(edge.transport).needs
    if not state.has(need):
        return f"state holds no {need} (sender prefill did not capture them)"
    return None


def decide(
    graph: TransportGraph,
    state: ContextState,
    receiver_hash: str,
    n_tokens: int,
    *,
    requested: str = "auto",
    quality_threshold: float = 0.0,
    overhead_s: float = 0.0,
    min_speedup: float = MIN_SPEEDUP,
) -> Decision:
    if requested not in requestable():
        raise UsageError(f"transport must be one of {', '.join(requestable())}, not {requested!r}")
    receiver = graph.nodes.get(receiver_hash)
    native_s = receiver.native_cost.total(n_tokens) if receiver and receiver.native_cost else None
    d = Decision("native", "", predicted_native_s=native_s)
    if requested == "native":
        d.reason = "native prefill requested"
        return _logged(d)
    edges = graph.edges_between(state.binding.weights_hash, receiver_hash)
    if requested != "auto":
        edges = [e for e in edges if e.transport == requested]
    if not edges:
        want = "" if requested == "auto" else f"{requested} "
        d.reason = f"no calibrated {want}artifact for this sender -> receiver pair"
        return _logged(d)

    best: tuple[float, Edge] | None = None
    for e in edges:
        why = _unusable(e, state, receiver_hash)
        if why is None and requested == "auto" and not e.exact:
            why = _not_worth_it(e, n_tokens, native_s, quality_threshold, overhead_s, min_speedup)
        if why is not None:
            d.rejected.append(f"{e.label}: {why}")
            continue
        cost = e.cost.total(n_tokens) + overhead_s if e.cost else (0.0 if e.exact else float("inf"))
        if best is None or cost < best[0]:
            best = (cost, e)
    if best is None:
        d.reason = "no transport passes the gate: " + "; ".join(d.rejected)
        return _logged(d)
    cost, edge = best
    d.transport, d.edge = edge.transport, edge
    d.predicted_relay_s = cost if edge.cost is not None else None
    q = edge.quality.get("top1_agreement")
    if edge.exact:
        d.reason = f"{edge.transport}: exact (reproduces the receiver's native prefill) and skips the context prefill"
    elif requested == "auto":
        d.reason = (
            f"{edge.transport} predicted {cost:.2f} s vs native {native_s:.2f} s "
            f"({native_s / cost:.1f}x) with calibrated top-1 agreement {q:.2f} >= {quality_threshold:.2f}"
        )
    else:
        d.reason = f"{edge.transport} requested explicitly (cost and quality gates skipped; bindings checked)"
    return _logged(d)


def _not_worth_it(
    e: Edge, n: int, native_s: float | None, threshold: float, overhead_s: float, min_speedup: float
) -> str | None:
    q = e.quality.get("top1_agreement")
    if q is None:
        return "artifact records no calibrated top-1 agreement"
    if q < threshold:
        return f"calibrated top-1 agreement {q:.2f} is below the threshold {threshold:.2f}"
    if native_s is None:
        return "no native cost profile for the receiver (run `ctxrelay profile`)"
    if e.cost is None:
        return "no cost profile for this edge (run `ctxrelay profile`)"
    relay_s = e.cost.total(n) + overhead_s
    if relay_s * min_speedup >= native_s:
        return (
            f"predicted {relay_s:.2f} s is not {min_speedup:.2f}x below native prefill {native_s:.2f} s at {n} tokens"
        )
    return None


def _logged(d: Decision) -> Decision:
    log.info("relay decision: %s (%s)", d.transport, d.reason)
    for r in d.rejected:
        log.info("  rejected %s", r)
    return d
