"""The transport contract: one base class, one registry (cf. vLLM's KV connector).

A transport turns what a sender left after prefilling a context (a ContextState) into the
receiver's KV cache for that context, then runs the appended tokens (question, new turn) natively.
The relay layer only ever talks to transports through this module:

  t = transports.get(name)
  t.capture_plan(sender, edge_params)    what the sender's prefill must record for t's edges
  t.relay_prefill(receiver, state, artifact, suffix_ids, **options) -> RelayOutput
  t.calibrate(sender, receiver, ...)     fit an artifact (`ctxrelay calibrate --transport NAME`)
  t.tuning_keys()                        the `--set` keys calibrate takes (TuningKey: default, meaning)

Adding a transport = one package under transports/ (a Transport subclass instance named
`transport`) + one line in BUILTIN; a transport from outside the library calls `register(obj)`.
RelayOutput.timings splits the end-to-end time into named components that add up to it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctxrelay.artifact import Artifact
from ctxrelay.errors import BindingError, UsageError
from ctxrelay.models.capture import CapturePlan
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel, ModelSpec
from ctxrelay.state import ContextState

# Components a relayed TTFT is split into (each transport reports the subset it has).
TIMING_KEYS = ("translate_s", "copy_s", "assemble_s", "select_s", "recompute_s", "first_token_s")


@dataclass
class RelayOutput:
    cache: KVCache  # receiver cache over context + suffix, ready for decoding
    logits: torch.Tensor  # [1, V] next-token logits after the suffix (first token = argmax)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per component (TIMING_KEYS)
    info: dict = field(default_factory=dict)  # transport-specific facts (mode, r, kept blocks ...)

    @property
    def components_s(self) -> float:
        return sum(self.timings.values())


@dataclass(frozen=True)
class TuningKey:
    """One `--set key=value` a command takes, declared where it is read: the CLI lists the keys with their
    defaults and meanings (`--keys`) and refuses a mistyped one before any model loads."""

    name: str
    default: object
    help: str = ""  # one line: what the key changes
    choices: tuple[str, ...] = ()  # the values it takes, where they are a closed set


def keys_from(defaults: dict, helps: dict[str, str] | None = None, choices: dict | None = None) -> list[TuningKey]:
    """TuningKeys of a defaults dict (a job's or a benchmark's options) with the meanings `helps` gives."""
    helps, choices = helps or {}, choices or {}
    return [TuningKey(k, v, helps.get(k, ""), tuple(choices.get(k, ()))) for k, v in defaults.items()]


def check_keys(options: dict, keys: Iterable[TuningKey], what: str) -> None:
    """Refuse keys `keys` does not declare, and values outside a key's choices: a UsageError naming the bad
    key(s) and every valid one (a typo would otherwise be ignored, or found after the models load)."""
    known = {k.name: k for k in keys}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise UsageError(f"unknown {what} key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
    for name, value in options.items():
        allowed = known[name].choices
        if allowed and str(value) not in allowed:
            raise UsageError(f"{what} key {name}={value} is not one of {', '.join(allowed)}")


class Transport:
    """Base class of every transport; subclasses set the attributes and implement relay_prefill."""

    name: str = ""
    artifact_version: int = 0  # the artifact format relay_prefill reads (0: it reads none)
    needs: str = "kv"  # the ContextState part relay_prefill reads ("kv" or a part name)
    # exact: reproduces the receiver's native logits to float tolerance and never costs more than
    # its native prefill (it reuses the receiver's own state): the gate asks no quality or cost of it
    exact: bool = False
    color: str = "gray"  # in plots of the transport graph

    def implicit_edge(self, sender: ModelSpec, receiver: ModelSpec) -> bool:
        """True where this transport serves the pair without an artifact (the model's own K/V)."""
        return False

    def operating_points(self, params: dict, quality: dict) -> list[dict]:
        """The ways this transport can serve an edge with these artifact params and quality, cheapest
        first: {"label", "options" (relay_prefill keywords), "quality" (calibrated vs native)}. The
        gate predicts each one's cost from the profile and holds its quality against the threshold;
        relay_prefill may report info["estimate"], a predicted top-1 agreement for THIS request."""
        return [{"label": "", "options": {}, "quality": quality}]

    def engine_servable(self, options: dict) -> bool:
        """Whether a serving engine can serve this operating point through its KV connector: the relay
        leaves a receiver K/V cache and nothing else (no change to the engine's attention)."""
        return True

    def capture_plan(self, sender: LoadedModel, edge_params: Sequence[dict]) -> CapturePlan:
        """What the sender's prefill records for this transport's edges out of it (their params)."""
        return CapturePlan(kv=self.needs == "kv")

    def relay_prefill(
        self, receiver: LoadedModel, state: ContextState, artifact: Artifact | None, suffix_ids: torch.Tensor, **options
    ) -> RelayOutput:
        raise NotImplementedError

    def calibrate(
        self, sender: str, receiver: str, *, out: Path | None, resume: bool, options: dict, command: str
    ) -> Path:
        raise UsageError(f"the {self.name} transport has nothing to calibrate")

    def tuning_keys(self) -> list[TuningKey]:
        """The `--set` keys `calibrate` takes (empty: none declared, and the CLI checks none)."""
        return []


def check_edge(
    name: str,
    version: int,
    receiver: LoadedModel,
    state: ContextState,
    artifact: Artifact,
    *,
    same_tokenizer: bool = False,
) -> None:
    """The one edge binding check: refuse an artifact of another transport or format, a state from
    another sender (weights or tokenizer), an artifact of another receiver; with same_tokenizer, a
    state whose tokenizer is not the receiver's."""
    if artifact.transport != name:
        raise BindingError(f"a {artifact.transport} artifact cannot drive the {name} transport")
    if artifact.version != version:
        raise BindingError(
            f"{name} artifact is format v{artifact.version}; this ctxrelay reads v{version}: "
            f"recalibrate with `ctxrelay calibrate --transport {name}`"
        )
    b, snd = state.binding, artifact.sender
    if b.weights_hash != snd["weights_hash"]:
        raise BindingError(
            f"context state was made by {b.model_name} (weights {b.weights_hash[:12]}) but the {name} "
            f"artifact's sender is {snd['name']} (weights {snd['weights_hash'][:12]})"
        )
    if b.tokenizer_hash != snd["tokenizer_hash"]:
        raise BindingError(f"context state's tokenizer differs from the {name} artifact's sender's")
    artifact.check(None, receiver)
    if same_tokenizer and b.tokenizer_hash != receiver.spec.tokenizer_hash:
        raise BindingError(
            f"context state's tokenizer differs from {receiver.spec.name}'s: the {name} transport only "
            "serves models that share a tokenizer"
        )


# ---- the registry ------------------------------------------------------------------------------

# name -> "module:attribute" of a Transport instance, imported on first use
BUILTIN = {
    "self": "ctxrelay.transports.self_kv:transport",
    "mapflow": "ctxrelay.transports.mapflow:transport",
    "heterofold": "ctxrelay.transports.heterofold:transport",
}
_registered: dict[str, Transport] = {}


class UnknownTransport(UsageError):
    pass


def register(t: Transport, *, replace: bool = False) -> Transport:
    if not isinstance(t, Transport) or not t.name:
        raise UsageError(f"{t!r} is not a named ctxrelay Transport (subclass ctxrelay.transports.Transport)")
    known = _registered.get(t.name)
    if known is not None and known is not t and not replace:
        raise UsageError(f"a transport named {t.name!r} is already registered (pass replace=True to swap it)")
    _registered[t.name] = t
    return t


def unregister(name: str) -> None:
    _registered.pop(name, None)


def get(name: str) -> Transport:
    if name not in _registered:
        if name not in BUILTIN:
            raise UnknownTransport(f"unknown transport {name!r}; known: {', '.join(names())}")
        module, attr = BUILTIN[name].split(":")
        register(getattr(importlib.import_module(module), attr))
    return _registered[name]


def names() -> list[str]:
    return list(dict.fromkeys([*BUILTIN, *_registered]))


def loaded() -> list[Transport]:
    """Every transport (builtin ones imported): what implicit edges and capture plans come from."""
    return [get(n) for n in names()]
