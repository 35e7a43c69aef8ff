"""The per-request gate: relay only when it is both faster and good enough, else native prefill.

A candidate is one operating point of an edge (heterofold: a recompute fraction and rule; most
transports have one). It must (1) be calibrated for exactly this sender and receiver version,
(2) find in the state what its transport needs and bound to the same sender, (3) have calibrated
quality at or above the operator's threshold and (4) have a predicted TTFT (plus overhead) at least
`min_speedup` times below the receiver's predicted native prefill (the margin covers the cost
model's error: a predicted 1% gain measured as a 5% loss in the demo). Survivors are ranked by
expected TTFT: the predicted TTFT, plus, where a trusted per-request estimate will check the relay,
native prefill for the share of calibration texts that estimate refused (a refused relay is paid
before native prefill). So a point that is fast when it passes but usually refused ranks behind a
slower one that always serves. The relay layer tries the cheapest first and, when the transport's
estimate for THIS request falls below the threshold, the next one (skipping points of that edge
calibrated no better than the refused one): every candidate's expected TTFT
already beats native prefill by the margin, and what a refused relay cost is paid either way, so it
does not count against the next. An exact transport (a model continuing from its own K/V)
reproduces native prefill and skips it, so it needs no quality or cost check. Every decision
carries its reason. The gate knows transports only through the registry (what each one reads from a
state, whether it is exact).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ctxrelay import transports
from ctxrelay.errors import UsageError
from ctxrelay.metrics import log_length_weight, nearest_length
from ctxrelay.relay.graph import Edge, OperatingPoint, TransportGraph
from ctxrelay.state import ContextState

log = logging.getLogger("ctxrelay.relay")

MIN_SPEEDUP = 1.10  # predicted native / relay TTFT an edge must reach to be chosen over native
# Default quality threshold: calibrated (and per-request estimated) top-1 agreement with the
# receiver's own native prefill. A relay that changes the answer is worse than no relay; 0 is an
# explicit opt-in to gist-only speed. 0.85, not 0.9: on our pairs the recompute fractions that keep
# heterofold several times faster than native measure 0.86-0.88 (docs/notebook.md, faithful relay).
# Where a point also records fact recall (the share of calibration questions answered right natively
# that it answers right too), that must meet the same threshold: top-1 agreement alone passed relays
# into smollm2 that lost every needle fact.
DEFAULT_QUALITY = 0.85


@dataclass
class Candidate:
    edge: Edge
    point: OperatingPoint
    predicted_s: float | None  # None: exact transport without a cost profile (never slower than native)
    quality: dict = field(default_factory=dict)  # the point's calibrated quality at this request's length
    expected_s: float | None = None  # predicted_s + native prefill x the share its estimate refuses
    refused: float = 0.0  # that share: calibration texts its trusted per-request estimate put below the threshold

    @property
    def label(self) -> str:
        return f"{self.edge.transport} {self.point.label}".strip()


@dataclass
class Decision:
    transport: str  # "native" or the chosen edge's transport
    reason: str
    edge: Edge | None = None
    point: OperatingPoint | None = None
    predicted_native_s: float | None = None
    predicted_relay_s: float | None = None
    rejected: list[str] = field(default_factory=list)  # one line per candidate turned down
    candidates: list[Candidate] = field(default_factory=list)  # survivors, cheapest first

    @property
    def options(self) -> dict:
        return dict(self.point.options) if self.point else {}

    def choose(self, c: Candidate, reason: str) -> None:
        self.transport, self.edge, self.point, self.predicted_relay_s = c.edge.transport, c.edge, c.point, c.predicted_s
        self.reason = reason

    def as_dict(self) -> dict:
        return {
            "transport": self.transport,
            "reason": self.reason,
            "edge": self.edge.label if self.edge else None,
            "point": self.point.label if self.point else None,
            "options": self.options,
            "predicted_native_s": self.predicted_native_s,
            "predicted_relay_s": self.predicted_relay_s,
            "rejected": self.rejected,
        }


class Fallback:
    """The gate's policy after a relay is refused for THIS request: which candidate next.

    Each candidate's expected TTFT beats native prefill by the margin (the gate kept no other), and a
    refused relay's time is spent whichever way the request goes, so it does not count against the next
    (counting it sent requests to native prefill when a relay left was still the faster way on). After
    the estimate refuses a point, later points of the same edge calibrated no better are skipped: they
    would serve this request no better (cheapest-first can put the better point first, e.g. when it is
    refused less often)."""

    def __init__(self, d: Decision, threshold: float) -> None:
        self.d, self.threshold = d, threshold
        self.tried: list[str] = []
        self._low: dict[str, float] = {}  # edge -> the best calibrated top-1 its estimate refused here

    def candidates(self):
        """The candidates to relay through, in order, each made the decision's choice in turn."""
        for i, c in enumerate(self.d.candidates):
            top1 = c.quality.get("top1_agreement")
            if top1 is not None and top1 <= self._low.get(c.edge.label, -1.0):
                self.tried.append(f"{c.label}: skipped (calibrated top-1 {top1:.3f}, no better than a refused point)")
                continue
            if i:
                self.d.choose(c, reason_for(c, self.d.predicted_native_s, self.threshold))
            yield c

    def refused(self, c: Candidate, why: str, estimate: float | None) -> None:
        self.tried.append(f"{c.label}: {why}")
        top1 = c.quality.get("top1_agreement")
        if estimate is not None and estimate < self.threshold and top1 is not None:
            self._low[c.edge.label] = max(self._low.get(c.edge.label, -1.0), top1)

    def served(self, estimate: float | None) -> None:
        """The reason of a relay that served, naming its estimate and the refusals before it."""
        if estimate is not None:
            self.d.reason += f"; estimated top-1 for this request {estimate:.2f}"
        if self.tried:
            self.d.reason += " (after " + "; ".join(self.tried) + ")"

    def exhausted(self) -> str:
        return "; ".join(self.tried) + "; native prefill instead (no faster relay passes the checks)"


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
    quality_threshold: float = DEFAULT_QUALITY,
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
        refused = [graph.swapped[h] for h in (state.binding.weights_hash, receiver_hash) if h in graph.swapped]
        if refused:
            d.reason += " (refused: " + "; ".join(refused) + ")"
        return _logged(d)

    for e in edges:
        why = _unusable(e, state, receiver_hash)
        for p in e.points:
            c = Candidate(
                e, p, p.cost.total(n_tokens) + overhead_s if p.cost else None, quality_at(p.quality, n_tokens)
            )
            c.expected_s, c.refused = _expected(c, native_s, quality_threshold)
            if why is None and requested == "auto" and not e.exact:
                why_p = _not_worth_it(c, native_s, quality_threshold, min_speedup)
            else:
                why_p = why
            if why_p is not None:
                d.rejected.append(f"{c.label}: {why_p}")
                continue
            d.candidates.append(c)
    if not d.candidates:
        d.reason = "no transport passes the gate: " + "; ".join(d.rejected)
        return _logged(d)
    # exact first (they skip the prefill and change nothing), then by expected TTFT
    d.candidates.sort(key=lambda c: (not c.edge.exact, c.expected_s if c.expected_s is not None else 0.0))
    best = d.candidates[0]
    d.choose(best, reason_for(best, native_s, quality_threshold, requested))
    return _logged(d)


def reason_for(c: Candidate, native_s: float | None, threshold: float, requested: str = "auto") -> str:
    if c.edge.exact:
        return f"{c.edge.transport}: exact (reproduces the receiver's native prefill) and skips the context prefill"
    if requested != "auto":
        return f"{c.label} requested explicitly (cost and quality gates skipped; bindings checked)"
    q = c.quality.get("top1_agreement")
    facts = c.quality.get("fact_recall")
    kept = "" if facts is None else f" and fact recall {_recall(c.quality)}"
    at = f" ({c.quality['at_tokens']})" if "at_tokens" in c.quality else ""
    refusals = f", {c.expected_s:.2f} s expected with its estimate's refusals" if c.refused else ""
    return (
        f"{c.label} predicted {c.predicted_s:.2f} s{refusals} vs native {native_s:.2f} s "
        f"({native_s / c.predicted_s:.1f}x) with calibrated top-1 agreement {q:.2f}{at}{kept} >= {threshold:.2f}"
    )


def _recall(q: dict) -> str:
    at = f" at {q['facts_tokens']} tokens" if "facts_tokens" in q else ""
    return f"{q['fact_recall']:.2f} ({q.get('kept')}/{q.get('native_right')} facts{at})"


def _below(q: float, threshold: float) -> str:
    """q for a refusal: two decimals, more where fewer would print the threshold itself (0.847 < 0.85,
    0.8499 < 0.85)."""
    for digits in range(2, 7):
        if f"{q:.{digits}f}" != f"{threshold:.{digits}f}":
            return f"{q:.{digits}f}"
    return f"{q:.6f}"


def quality_at(quality: dict, n_tokens: int) -> dict:
    """A point's calibrated quality for a request of n_tokens. A point calibrated at several context
    lengths lists them in quality["by_tokens"] ({"tokens", "top1_agreement", "calibrated_estimates"}
    each): top-1 agreement is interpolated linearly in log-length between the two calibrated lengths
    around n_tokens (the nearest one outside their range: no extrapolation), the estimates are those of
    the nearest length, and "at_tokens" says which lengths decided. Quality can fall with length (into
    qwen-0.5b, top-1 at f = 0.3: 0.86 at 2048 tokens, lower at 4096), so a point judged at one length
    only would pass requests it serves worse. A point measured at fewer lengths than its artifact's other
    points (quality["serves_tokens"]: [shortest, longest) request) is out of its range beyond the middle
    towards a length it was not measured at: "outside" says so and quality_refusal refuses it. Fact
    recall measured at several lengths (quality["facts_by_tokens"]) is read at the one nearest n_tokens,
    apart from top-1's lengths ("facts_tokens" says which)."""
    lo, hi = quality.get("serves_tokens") or (None, None)
    if (lo is not None and n_tokens < lo) or (hi is not None and n_tokens >= hi):
        at = sorted(x["tokens"] for x in quality.get("by_tokens") or []) or [quality.get("tokens")]
        span = f"{lo}+" if hi is None else f"under {hi}" if lo is None else f"{lo}-{hi - 1}"
        where = " and ".join(str(x) for x in at)
        return {**quality, "outside": f"measured at {where} tokens, it serves requests of {span} tokens"}
    out = dict(quality)
    levels = {x["tokens"]: x for x in quality.get("by_tokens") or []}
    if levels:
        a, b, w = log_length_weight(levels, n_tokens)
        near = levels[a if w <= 0.5 else b]
        out.update({k: v for k, v in near.items() if k != "tokens"})
        out["at_tokens"] = f"calibrated at {near['tokens']} tokens"
        if a != b:
            out["top1_agreement"] = (1 - w) * levels[a]["top1_agreement"] + w * levels[b]["top1_agreement"]
            out["at_tokens"] = f"interpolated between {a} and {b} tokens"
    facts = {x["tokens"]: x for x in quality.get("facts_by_tokens") or []}
    if facts:  # fact recall at the fact stage's length nearest the request's, wherever top-1 was measured
        near = facts[nearest_length(list(facts), n_tokens)]
        out.update({k: v for k, v in near.items() if k != "tokens"}, facts_tokens=near["tokens"])
    return out


def quality_refusal(quality: dict, threshold: float) -> str | None:
    """Why a point's calibrated quality fails the threshold (top-1 agreement, and fact recall where the
    point records it), or None."""
    if "outside" in quality:
        return f"not calibrated for this request's length ({quality['outside']})"
    if quality.get("facts_missing"):
        return "the artifact's fact stage did not measure this point (run its --set stage=facts)"
    q = quality.get("top1_agreement")
    if q is None:
        return "artifact records no calibrated top-1 agreement"
    if q < threshold:
        at = f" ({quality['at_tokens']})" if "at_tokens" in quality else ""
        return f"calibrated top-1 agreement {_below(q, threshold)}{at} is below the threshold {threshold:.2f}"
    facts = quality.get("fact_recall")
    if facts is not None and facts < threshold:
        return f"calibrated fact recall {_recall(quality)} is below the threshold {threshold:.2f}"
    return None


def _not_worth_it(c: Candidate, native_s: float | None, threshold: float, min_speedup: float) -> str | None:
    why = quality_refusal(c.quality, threshold)
    if why is not None:
        return why
    if native_s is None:
        return "no native cost profile for the receiver (run `ctxrelay profile`)"
    if c.predicted_s is None and c.point.stale_cost:
        return (
            "its cost profile was measured with another artifact than the one installed "
            "(run `ctxrelay profile --only-missing`)"
        )
    if c.predicted_s is None:
        return "no cost profile for this edge (run `ctxrelay profile`)"
    if c.predicted_s * min_speedup >= native_s:
        return f"predicted {c.predicted_s:.2f} s is not {min_speedup:.2f}x below native prefill {native_s:.2f} s"
    if c.refused and c.expected_s * min_speedup >= native_s:
        return (
            f"expected {c.expected_s:.2f} s (the per-request estimate refused {c.refused:.0%} of the calibration "
            f"texts, each a relay paid before native prefill) is not {min_speedup:.2f}x below native "
            f"prefill {native_s:.2f} s"
        )
    return None


def _expected(c: Candidate, native_s: float | None, threshold: float) -> tuple[float | None, float]:
    """(expected TTFT, refused share): its predicted TTFT, plus native prefill for the share of requests
    its trusted per-request estimate would refuse (a refused relay is paid, then native prefill)."""
    ests = c.quality.get("calibrated_estimates")
    if c.predicted_s is None or native_s is None or not ests:
        return c.predicted_s, 0.0
    return expected_with_refusals(c.predicted_s, native_s, ests, threshold)


def expected_with_refusals(relay_s: float, native_s: float, estimates: list[float], threshold: float):
    """(expected seconds, refused share): the relay always, plus native prefill for the share of
    calibration texts the per-request estimate put below the threshold."""
    refused = sum(e < threshold for e in estimates) / len(estimates)
    return relay_s + refused * native_s, refused


def _logged(d: Decision) -> Decision:
    log.info("relay decision: %s (%s)", d.transport, d.reason)
    for r in d.rejected:
        log.info("  rejected %s", r)
    return d
