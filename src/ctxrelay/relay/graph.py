"""The transport graph: model versions as nodes, calibrated transports as edges, each with a cost model.

Nodes are identified by weights hash (a model version), edges by (transport, sender hash, receiver
hash) and carry the artifact's measured quality. Edges come from artifacts on disk and from
transports that serve a pair without one (a model continuing from its own K/V). Costs are fitted
per component to measurements on this machine (`ctxrelay profile`): t(n) = c0 + c1*n + c2*n^2 with
non-negative coefficients, so a prediction never goes below the fixed overhead and stays monotone in context length.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from ctxrelay import transports
from ctxrelay.artifact import Artifact, model_binding
from ctxrelay.errors import UsageError
from ctxrelay.models.spec import LoadedModel
from ctxrelay.tensorfile import TensorFileError

NATIVE_KEY = "prefill_s"


@dataclass
class CostModel:
    """Per-component quadratic fits of seconds vs context tokens."""

    coeffs: dict[str, list[float]]
    samples: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    # the digest of the artifact the samples were measured with ("" where none or not recorded: profiles
    # written before 2026-12-06 are trusted as they were); a swapped artifact makes them another edge's costs
    artifact: str = ""

    @staticmethod
    def fit(samples: list[tuple[int, dict[str, float]]], artifact: str = "") -> CostModel:
        """Non-negative quadratic per component, fitted to relative error: the gate compares times as
        ratios, and an absolute fit let the longest lengths' seconds decide the short ones (profiled at
        524-8003 tokens, qwen-0.5b's native prefill at 1027 tokens was predicted 22% high by an absolute
        fit, 13% by this one)."""
        if not samples:
            raise ValueError("cannot fit a cost model to no measurements")
        comps = sorted({c for _, d in samples for c in d})
        n = np.array([s[0] for s in samples], dtype=float)
        basis = np.stack([np.ones_like(n), n / 1e3, (n / 1e3) ** 2], axis=1)  # scaled for conditioning
        coeffs = {}
        for c in comps:
            y = np.array([d.get(c, 0.0) for _, d in samples])
            w = 1.0 / np.maximum(y, max(1e-3 * float(y.max()), 1e-9))  # a near-zero time gets no huge weight
            x, _ = nnls(basis * w[:, None], y * w)
            coeffs[c] = [float(x[0]), float(x[1]) / 1e3, float(x[2]) / 1e6]
        return CostModel(coeffs, list(samples), artifact)

    def predict(self, n_tokens: int) -> dict[str, float]:
        return {c: a + b * n_tokens + q * n_tokens**2 for c, (a, b, q) in self.coeffs.items()}

    def total(self, n_tokens: int) -> float:
        return sum(self.predict(n_tokens).values())

    def to_json(self) -> dict:
        out = {"coeffs": self.coeffs, "samples": [[n, d] for n, d in self.samples]}
        return {**out, "artifact": self.artifact} if self.artifact else out

    @staticmethod
    def from_json(d: dict) -> CostModel:
        """A stored cost model, checked: three finite coefficients per component, samples of (tokens, seconds)."""
        coeffs, samples, artifact = d["coeffs"], d.get("samples", []), d.get("artifact", "")
        if not isinstance(coeffs, dict) or not isinstance(samples, list) or not isinstance(artifact, str):
            raise ValueError("coeffs must be an object, samples a list and artifact a string")
        for c, v in coeffs.items():
            if not isinstance(v, list) or len(v) != 3 or not all(_finite(x) for x in v):
                raise ValueError(f"component {c!r} needs three finite coefficients")
        out = []
        for n, x in samples:
            if type(n) is not int or not isinstance(x, dict) or not all(_finite(t) for t in x.values()):
                raise ValueError("a sample is [tokens, {component: seconds}]")
            out.append((n, dict(x)))
        return CostModel({c: [float(a) for a in v] for c, v in coeffs.items()}, out, artifact)


def _finite(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


@dataclass
class Node:
    name: str
    weights_hash: str
    tokenizer_hash: str
    native_cost: CostModel | None = None


@dataclass
class OperatingPoint:
    """One way a transport serves an edge (heterofold: a recompute fraction and selection rule)."""

    label: str  # "" for a transport's only way, else e.g. "f=0.10 mix"
    options: dict  # relay_prefill keywords
    quality: dict  # calibrated against native: top1_agreement, ...
    cost: CostModel | None = None
    stale_cost: bool = False  # the profile holds a cost for it, measured with another artifact (not used)


@dataclass
class Edge:
    transport: str
    sender: dict  # artifact's binding of the sender: name, weights_hash, tokenizer_hash
    receiver: dict
    artifact_path: Path | None  # None: the transport serves this pair without an artifact
    quality: dict
    params: dict
    exact: bool = False  # the transport reproduces native prefill (no quality or cost gate)
    points: list[OperatingPoint] = field(default_factory=list)
    artifact_digest: str = ""  # Artifact.digest of the file at artifact_path

    @property
    def key(self) -> str:
        return edge_key(self.transport, self.sender["weights_hash"], self.receiver["weights_hash"])

    def point_key(self, p: OperatingPoint) -> str:
        """Profile key of one operating point's cost model (the edge key for a transport's only way)."""
        return self.key if not p.label else f"{self.key}@{p.label}"

    @property
    def cost(self) -> CostModel | None:
        """The cost model of the edge's first (cheapest calibrated) operating point."""
        return self.points[0].cost if self.points else None

    @property
    def label(self) -> str:
        return f"{self.transport}: {self.sender['name']} -> {self.receiver['name']}"


def edge_key(transport: str, sender_hash: str, receiver_hash: str) -> str:
    return f"{transport}:{sender_hash}:{receiver_hash}"


@dataclass
class Profile:
    """Measured costs on this machine, keyed by model / edge version. Stored as JSON."""

    native: dict[str, CostModel] = field(default_factory=dict)  # weights hash -> cost
    edges: dict[str, CostModel] = field(default_factory=dict)  # edge key -> cost
    machine: dict = field(default_factory=dict)

    @staticmethod
    def load(path: Path) -> Profile:
        if not path.exists():
            return Profile()
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UsageError(f"cost profile {path} is unreadable ({e}); rerun `ctxrelay profile`") from None
        return Profile.from_json_bytes(data, str(path))

    @staticmethod
    def from_json_bytes(data: bytes, what: str = "cost profile") -> Profile:
        """A profile.json's content; anything but a well-formed profile is one UsageError."""
        try:
            d = json.loads(data.decode("utf-8"))
            sections = ("native", "edges", "machine")
            if not isinstance(d, dict) or not all(isinstance(d.get(k, {}), dict) for k in sections):
                raise ValueError("native, edges and machine must be JSON objects")
            return Profile(
                {k: CostModel.from_json(v) for k, v in d.get("native", {}).items()},
                {k: CostModel.from_json(v) for k, v in d.get("edges", {}).items()},
                d.get("machine", {}),
            )
        except (KeyError, TypeError, ValueError, RecursionError, OverflowError) as e:  # JSON and Unicode errors too
            msg = str(e)[:200]
            raise UsageError(f"cost profile {what} is unreadable ({msg}); rerun `ctxrelay profile`") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        d = {
            "machine": self.machine,
            "native": {k: v.to_json() for k, v in self.native.items()},
            "edges": {k: v.to_json() for k, v in self.edges.items()},
        }
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two processes saving at once each rename a whole file
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(path)


def _not_in_pool(art: Artifact, nodes: dict[str, Node], swapped: dict[str, str]) -> str:
    """Why an artifact's models are not the pool's: absent, or loaded with other weights under the same
    name (recorded in `swapped` by the loaded model's hash)."""
    why = []
    for role, b in (("sender", art.sender), ("receiver", art.receiver)):
        if b["weights_hash"] in nodes:
            continue
        other = next((n for n in nodes.values() if n.name == b["name"]), None)
        if other is None:
            why.append(b["name"])
            continue
        why.append(
            f"{art.transport} artifact's {role} {b['name']} has weights {b['weights_hash'][:12]}, the loaded "
            f"{b['name']} has {other.weights_hash[:12]}: a different checkpoint"
        )
        swapped[other.weights_hash] = why[-1]
    return "calibrated for model versions not in the pool (" + "; ".join(why) + ")"


def measured_with(cost: CostModel, edge: Edge) -> bool:
    """Whether `cost` was measured with the edge's installed artifact (or either does not say)."""
    return not cost.artifact or not edge.artifact_digest or cost.artifact == edge.artifact_digest


def _with_points(edge: Edge, t, profile: Profile, engine: bool = False) -> Edge:
    """The transport's operating points for this edge, each with its measured cost model: none where the
    profile measured another artifact (a recalibrated or upgraded one; its relay may cost differently).
    `engine`: only the points a serving engine can take through its KV connector."""
    for p in t.operating_points(edge.params, edge.quality):
        if engine and not t.engine_servable(dict(p.get("options", {}))):
            continue
        point = OperatingPoint(p.get("label", ""), dict(p.get("options", {})), dict(p.get("quality", {})))
        cost = profile.edges.get(edge.point_key(point))
        if cost is not None and not measured_with(cost, edge):
            cost, point.stale_cost = None, True
        point.cost = cost
        edge.points.append(point)
    return edge


@dataclass
class TransportGraph:
    nodes: dict[str, Node]  # weights hash -> node
    edges: list[Edge]
    skipped: list[str] = field(default_factory=list)  # artifacts found but not usable, with why
    # loaded weights hash -> why an artifact calibrated for another checkpoint of that model was refused
    swapped: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def build(
        models: list[LoadedModel], artifact_dirs: list[Path], profile: Profile, load=Artifact.load, engine: bool = False
    ) -> TransportGraph:
        """`load` reads an artifact; a pool passes its own cache so the relay path reuses what was read here.
        `engine`: the graph of a pool whose receivers run in a serving engine (engine-servable points only)."""
        nodes = {
            m.spec.weights_hash: Node(
                m.spec.name, m.spec.weights_hash, m.spec.tokenizer_hash, profile.native.get(m.spec.weights_hash)
            )
            for m in models
        }
        edges, skipped, swapped = [], [], {}
        for path in sorted({p for d in artifact_dirs if d.exists() for p in d.glob("*.safetensors")}):
            try:
                art = load(path)
                t = transports.get(art.transport)
            except (TensorFileError, transports.UnknownTransport) as e:
                skipped.append(f"{path.name}: {e}")
                continue
            s, r = art.sender["weights_hash"], art.receiver["weights_hash"]
            if s not in nodes or r not in nodes:
                skipped.append(f"{path.name}: {_not_in_pool(art, nodes, swapped)}")
                continue
            edge = Edge(
                art.transport,
                art.sender,
                art.receiver,
                path,
                art.quality,
                art.params,
                exact=t.exact,
                artifact_digest=art.digest,
            )
            edges.append(_with_points(edge, t, profile, engine))
        for t in transports.loaded():  # pairs a transport serves without an artifact
            for a in models:
                for b in models:
                    if t.implicit_edge(a.spec, b.spec):
                        edge = Edge(t.name, model_binding(a), model_binding(b), None, {}, {}, exact=t.exact)
                        edges.append(_with_points(edge, t, profile, engine))
        return TransportGraph(nodes, edges, skipped, swapped)

    def edges_between(self, sender_hash: str, receiver_hash: str) -> list[Edge]:
        return [
            e
            for e in self.edges
            if e.sender["weights_hash"] == sender_hash and e.receiver["weights_hash"] == receiver_hash
        ]

    def edges_from(self, sender_hash: str) -> list[Edge]:
        return [e for e in self.edges if e.sender["weights_hash"] == sender_hash]

    @property
    def calibrated(self) -> list[Edge]:
        """Edges that come from an artifact (implicit ones, a model's own K/V, are not listed or drawn)."""
        return [e for e in self.edges if e.artifact_path is not None]

    def rows(self, n_tokens: int = 2048) -> list[dict]:
        out = []
        for e in self.calibrated:
            native = self.nodes[e.receiver["weights_hash"]].native_cost
            relay_s = e.cost.total(n_tokens) if e.cost else None
            native_s = native.total(n_tokens) if native else None
            out.append(
                {
                    "edge": e.label,
                    "method": e.params.get("method", e.params.get("mode", "")),
                    "top1_agreement": e.quality.get("top1_agreement"),
                    "kl": e.quality.get("kl"),
                    f"relay_s@{n_tokens}": relay_s,
                    f"native_s@{n_tokens}": native_s,
                    "speedup": native_s / relay_s if relay_s and native_s else None,
                    "artifact": e.artifact_path.name,
                }
            )
        return out

    def plot(self, path: Path, n_tokens: int = 2048) -> Path:
        """Nodes on a circle, one arrow per edge labelled with quality and predicted speedup."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = {h: n.name for h, n in self.nodes.items()}
        angles = np.linspace(0, 2 * np.pi, len(names), endpoint=False)
        pos = {h: (np.cos(a), np.sin(a)) for h, a in zip(names, angles, strict=True)}
        fig, ax = plt.subplots(figsize=(8, 8))
        for h, (x, y) in pos.items():
            ax.scatter([x], [y], s=2500, color="#dde6f5", zorder=2)
            ax.text(x, y, names[h], ha="center", va="center", fontsize=9, zorder=3)
        for e, row in zip(self.calibrated, self.rows(n_tokens), strict=True):
            (x0, y0), (x1, y1) = pos[e.sender["weights_hash"]], pos[e.receiver["weights_hash"]]
            color = transports.get(e.transport).color
            ax.annotate(
                "", xy=(x1, y1), xytext=(x0, y0),
                arrowprops=dict(arrowstyle="-|>", color=color, lw=1.5, shrinkA=28, shrinkB=28,
                                connectionstyle="arc3,rad=0.15"),
            )  # fmt: skip
            q = row["top1_agreement"]
            sp = row["speedup"]
            label = f"{e.transport}\ntop1 {q:.2f}" if q is not None else e.transport
            if sp:
                label += f", {sp:.1f}x"
            ax.text((x0 + x1) / 2 * 0.8, (y0 + y1) / 2 * 0.8 + 0.05, label, fontsize=7, color=color, ha="center")
        ax.set_title(f"ctxrelay transport graph (speedup predicted at {n_tokens} tokens)")
        ax.set_xlim(-1.5, 1.5)
        ax.set_ylim(-1.5, 1.5)
        ax.axis("off")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        return path
