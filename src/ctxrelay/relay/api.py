"""The five-line Python API: a pool of models, a store of context states, and a gate between them.

    pool = ModelPool(["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"])
    state = pool.prefill("qwen2.5-coder-1.5b", document, tenant="acme")
    result = pool.continue_from(state, "smollm2-135m", "\\n\\nQuestion: ...\\nAnswer:")
    print(result.transport, result.reason, result.ttft_s, result.text)

`continue_from` never fails because a transport cannot run: missing artifact, mismatched binding,
missing state parts, store outage and transport errors all end in native prefill, with the reason.
Only another tenant's state is refused outright (BindingError), since reading it is the error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctxrelay import paths, transports, zoo
from ctxrelay.artifact import Artifact
from ctxrelay.errors import BindingError, CtxrelayError, UsageError
from ctxrelay.models import runner
from ctxrelay.models.capture import CapturePlan, capture_state, extend_state
from ctxrelay.models.sampling import Sampling, TokenLogprob
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay.gate import DEFAULT_QUALITY, MIN_SPEEDUP, Decision, Fallback, decide, requestable
from ctxrelay.relay.graph import Profile, TransportGraph
from ctxrelay.relay.store import StateKey, StateStore, StoreUnavailable, open_store
from ctxrelay.state import ContextState, content_hash
from ctxrelay.text import checked_text
from ctxrelay.transports import RelayOutput

log = logging.getLogger("ctxrelay.relay")


@dataclass(kw_only=True)
class RelayResult:
    text: str
    tokens: list[int]
    transport: str  # what actually ran: native or the transport's name
    reason: str
    ttft_s: float  # request start -> first token chosen, everything included
    total_s: float
    context_tokens: int  # receiver tokens of the shared context
    timings: dict[str, float] = field(default_factory=dict)  # components of ttft_s
    decision: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    first_logits: torch.Tensor | None = None  # [V], for agreement checks
    finish_reason: str = "length"  # "stop": end-of-text or a stop string (runner.Generation)
    logprobs: list[TokenLogprob] | None = None  # per generated token, where the Sampling asked for them

    @property
    def components_s(self) -> float:
        return sum(self.timings.values())


@dataclass(kw_only=True)
class Prepared:
    """A receiver's prefill of a context and suffix up to its first decode step (`ModelPool.prepare`)."""

    receiver: LoadedModel
    text: str  # the shared context
    suffix: torch.Tensor  # the receiver's ids of what follows it
    t0: float  # request start (perf_counter)
    timings: dict[str, float]  # the components so far
    reason: str  # why it relays, or why native prefill
    decision: Decision | None = None  # None: no state to relay from (native prefill)
    out: RelayOutput | None = None  # the relayed cache and next-token logits; None: native prefill
    context_tokens: int = 0  # receiver tokens of the context in `out`

    @property
    def relayed(self) -> bool:
        return self.out is not None


class ModelPool:
    def __init__(
        self,
        models: list[str | LoadedModel] = (),
        *,
        store: str | StateStore = "memory",
        artifact_dirs: list[Path] | None = None,
        profile: Profile | Path | None = None,
        quality_threshold: float = DEFAULT_QUALITY,
        overhead_s: float = 0.0,
        min_speedup: float = MIN_SPEEDUP,
        engine: bool = False,
    ):
        """`engine`: the receivers decode in a serving engine (engines/), which loads a relayed K/V cache and
        nothing more: the gate offers only the points such an engine can serve (Transport.engine_servable),
        and `profile` should hold that engine's costs."""
        self.engine = engine
        self.models: dict[str, LoadedModel] = {}
        self.store = open_store(store) if isinstance(store, str) else store
        self.artifact_dirs = artifact_dirs if artifact_dirs is not None else paths.artifact_dirs()
        if profile is None or isinstance(profile, Path):
            self.profile_path = profile or paths.profile_path()
            self.profile = Profile.load(self.profile_path)
        else:
            self.profile_path, self.profile = None, profile
        self.quality_threshold, self.overhead_s, self.min_speedup = quality_threshold, overhead_s, min_speedup
        # the precision of the relay's own compute (translation, assembly, recompute) on the receivers: fp32,
        # or bf16 where the receivers decode in a bf16 engine (use_compute_dtype)
        self.compute_dtype = torch.float32
        self._compute: dict[str, LoadedModel] = {}
        self._graph: TransportGraph | None = None
        self._artifacts: dict[Path, Artifact] = {}
        for m in models:
            self.add(m)

    # ---- models and graph -------------------------------------------------------------------

    def add(self, m: str | LoadedModel) -> LoadedModel:
        model = zoo.load(m) if isinstance(m, str | Path) else m
        self.models[model.spec.name] = model
        self._graph = None
        return model

    def use_compute_dtype(self, dtype: torch.dtype, profile_path: Path | None = None) -> None:
        """Relay into the receivers in `dtype` (bf16 where they decode in a bf16 engine: the cache they load is
        bf16 anyway, and bf16 matmuls run on the CPU's bf16 units); its costs are other than fp32's, so the
        profile is read from (and kept in) `profile_path`."""
        self.compute_dtype = dtype
        self._compute.clear()
        if profile_path is not None:
            self.profile_path, self.profile = profile_path, Profile.load(profile_path)
            self.refresh()
        # the copies of the models edges lead into, made now: made on a first relay, gemma3's took 1.5 s of its TTFT
        receivers = {e.receiver["weights_hash"] for e in self.graph.edges}
        for m in self.models.values():
            if m.spec.weights_hash in receivers:
                self.relay_model(m)

    def relay_model(self, m: LoadedModel) -> LoadedModel:
        """Receiver `m` as the relay computes with it: in the pool's compute dtype (one copy, kept)."""
        if self.compute_dtype == m.dtype:
            return m
        if m.spec.name not in self._compute:
            self._compute[m.spec.name] = m.in_dtype(self.compute_dtype)
        return self._compute[m.spec.name]

    def model(self, name: str) -> LoadedModel:
        if name not in self.models:
            self.add(name)
        return self.models[name]

    @property
    def graph(self) -> TransportGraph:
        if self._graph is None:
            models = list(self.models.values())
            self._graph = TransportGraph.build(models, self.artifact_dirs, self.profile, self.artifact, self.engine)
        return self._graph

    def refresh(self, profile: Profile | None = None) -> None:
        """Build the graph again from the artifact folders as they are now (files read again) and `profile`."""
        if profile is not None:
            self.profile = profile
        self._graph = None
        self._artifacts.clear()

    def artifact(self, path: Path) -> Artifact:
        if path not in self._artifacts:
            self._artifacts[path] = Artifact.load(path)
        return self._artifacts[path]

    # ---- sender side --------------------------------------------------------------------------

    def prefill(
        self, sender: str, text: str, tenant: str, *, store: bool = True, extend: ContextState | None = None,
        check: Callable[[], None] | None = None,
    ) -> ContextState:  # fmt: skip
        """The sender reads `text` natively and leaves a ContextState with what its edges need.

        `extend`: a state of this sender whose text `text` continues; only the added tokens are read
        where that gives the same state (capture.extend_state), else the whole text. `check` runs before
        each layer and may raise to stop the read (a state build giving way to a request)."""
        checked_text(text)
        m = self.model(sender)
        check_window(m, len(context_ids(m, text)))
        plans = self.capture_plans(m)
        state = None
        if extend is not None:
            extend.check(tenant=tenant)
            state = extend_state(m, extend, text, plans, check)
        if state is None:
            # K/V always: the sender itself continues from them
            state = capture_state(m, text, tenant, plans, check=check)
        if store:
            try:
                self.store.put(state)
            except StoreUnavailable as e:
                log.warning("state not stored (%s); it is still usable in this process", e)
        return state

    def capture_plans(self, m: LoadedModel) -> list[CapturePlan]:
        """What the sender's prefill records for the edges out of it (one plan per transport); with an engine,
        for the edges it can serve (an edge left with no engine-servable point records nothing)."""
        by_transport: dict[str, list[dict]] = {}
        for e in self.graph.edges_from(m.spec.weights_hash):
            if self.engine and not e.points:
                continue
            by_transport.setdefault(e.transport, []).append(e.params)
        return [transports.get(t).capture_plan(m, params) for t, params in by_transport.items()]

    def kv_is_enough(self, sender: str) -> bool:
        """Whether K/V alone makes the sender's state (an engine's prefill can give it): no edge out of it
        needs attention maps, queries or a part written after the prefill."""
        plans = self.capture_plans(self.model(sender))
        return all(p.on_probs is None and p.on_qk is None and p.finish is None for p in plans)

    # ---- receiver side ------------------------------------------------------------------------

    def continue_from(
        self,
        context: ContextState | str,
        receiver: str,
        suffix: str = "",
        *,
        tenant: str | None = None,
        sender: str | None = None,
        transport: str = "auto",
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        quality_threshold: float | None = None,
        on_token: Callable[[int], None] | None = None,
        sampling: Sampling | None = None,
    ) -> RelayResult:
        """Continue `context` (a state, or the text whose state a sender left in the store) on `receiver`.

        `on_token` sees each generated token as soon as it is chosen (for streaming). `sampling`, when
        given, is how decode chooses tokens (its temperature, not `temperature`, applies)."""
        gen_kw = dict(on_token=on_token, sampling=sampling)
        p = self.prepare(
            context, receiver, suffix, tenant=tenant, sender=sender, transport=transport,
            max_new_tokens=max_new_tokens, temperature=temperature, quality_threshold=quality_threshold,
        )  # fmt: skip
        if p.out is None:
            return self._native(
                p.receiver, p.text, p.suffix, p.t0, p.timings, p.reason, max_new_tokens, temperature, p.decision,
                **gen_kw,
            )  # fmt: skip
        d, out, timings = p.decision, p.out, p.timings
        tf = time.perf_counter()
        # decoded by the model that built the cache (its dtype)
        r = self.relay_model(p.receiver)
        gen = runner.decode(r, out.cache, out.logits[-1], p.t0, max_new_tokens, temperature, **gen_kw)
        timings["first_token_s"] = timings.get("first_token_s", 0.0) + (gen.ttft_s - (tf - p.t0))
        return RelayResult(
            text=gen.text,
            tokens=gen.tokens,
            transport=d.transport,
            reason=d.reason,
            ttft_s=gen.ttft_s,
            total_s=gen.total_s,
            context_tokens=p.context_tokens,
            timings=timings,
            decision=d.as_dict(),
            info=out.info,
            first_logits=out.logits[-1],
            finish_reason=gen.finish_reason,
            logprobs=gen.logprobs,
        )

    def prepare(
        self,
        context: ContextState | str,
        receiver: str,
        suffix: str = "",
        *,
        tenant: str | None = None,
        sender: str | None = None,
        transport: str = "auto",
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        quality_threshold: float | None = None,
    ) -> Prepared:
        """The receiver's prefill of `context` + `suffix`, up to the first decode step: the relayed cache the
        gate chose (and the checks let serve), or the reason for native prefill. `continue_from` decodes it
        on ctxrelay's runner; a serving engine (engines/) loads the relayed cache and decodes itself."""
        check_request(context if isinstance(context, str) else context.text, suffix, max_new_tokens, temperature)
        if transport not in requestable():
            raise UsageError(f"transport must be one of {', '.join(requestable())}, not {transport!r}")
        r = self.model(receiver)
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        state, text, why_not = self._resolve(context, tenant, sender, timings)
        tg = time.perf_counter()
        ids = suffix_ids(r, suffix)
        p = Prepared(receiver=r, text=text, suffix=ids, t0=t0, timings=timings, reason=why_not)
        if state is None:
            timings["gate_s"] = time.perf_counter() - tg
            return p
        n_ctx = len(context_ids(r, text))
        check_window(r, n_ctx + len(ids), max_new_tokens)
        threshold = self.quality_threshold if quality_threshold is None else quality_threshold
        p.decision = d = decide(
            self.graph,
            state,
            r.spec.weights_hash,
            n_ctx + len(ids),
            requested=transport,
            quality_threshold=threshold,
            overhead_s=self.overhead_s,
            min_speedup=self.min_speedup,
        )
        timings["gate_s"] = time.perf_counter() - tg
        p.reason = d.reason
        if d.transport == "native":
            return p
        out, why_not = self._relay_checked(d, state, r, ids, timings, threshold, transport == "auto")
        if out is None:
            p.reason = why_not
            return p
        timings.update(out.timings)
        p.out, p.reason, p.context_tokens = out, d.reason, out.cache.length - len(ids)
        return p

    def _relay_checked(self, d: Decision, state, r, suffix, timings, threshold, check) -> tuple:
        """Relay through the gate's candidates in its fallback order (gate.Fallback) until one serves:
        a relay that would answer nothing, or that the transport estimates below the threshold for THIS
        request, is refused. Returns (RelayOutput, "") or (None, why native)."""
        walk = Fallback(d, threshold)
        for c in walk.candidates():
            ta = time.perf_counter()
            try:
                out = self._relay(d, state, r, suffix)
            except (CtxrelayError, ValueError, RuntimeError) as e:  # never a wrong answer: fall back
                log.warning("%s failed (%s); native prefill instead", c.label, e)
                return None, f"{c.label} failed ({e}); native prefill instead"
            refused = _refusal(out, r, threshold) if check else ""
            if refused:
                walk.refused(c, refused, out.info.get("estimate"))
                timings["rejected_relay_s"] = timings.get("rejected_relay_s", 0.0) + time.perf_counter() - ta
                continue
            walk.served(out.info.get("estimate"))
            return out, ""
        return None, walk.exhausted()

    def native(self, receiver: str, text: str, suffix: str = "", **kw) -> RelayResult:
        """The reference: the receiver prefills context + suffix itself (keywords: max_new_tokens,
        temperature, on_token, sampling)."""
        check_request(text, suffix, kw.get("max_new_tokens", 32), kw.get("temperature", 0.0))
        r = self.model(receiver)
        ids = suffix_ids(r, suffix)
        return self._native(r, text, ids, time.perf_counter(), {}, "native prefill requested", **kw)

    # ---- internals ----------------------------------------------------------------------------

    def _resolve(self, context, tenant, sender, timings) -> tuple[ContextState | None, str, str]:
        """Find the state: given directly, or looked up in the store by (tenant, text, sender)."""
        if isinstance(context, ContextState):
            if tenant is not None and tenant != context.binding.tenant:
                raise BindingError(f"tenant {tenant!r} may not use a state owned by {context.binding.tenant!r}")
            return context, context.text, ""
        text = context
        if tenant is None or sender is None:
            return None, text, "no state given (pass a ContextState, or tenant= and sender= to look one up)"
        key = StateKey(tenant, content_hash(text), self.model(sender).spec.weights_hash)
        ts = time.perf_counter()
        try:
            state = self.store.get(key, tenant)
        except StoreUnavailable as e:
            timings["store_read_s"] = time.perf_counter() - ts
            return None, text, f"state store unavailable ({e}); native prefill"
        timings["store_read_s"] = time.perf_counter() - ts
        if state is None:
            return None, text, f"no stored state of this context from {sender} for tenant {tenant!r}"
        return state, text, ""

    def _relay(self, d: Decision, state: ContextState, r: LoadedModel, suffix: torch.Tensor) -> RelayOutput:
        path = d.edge.artifact_path
        art = self.artifact(path) if path is not None else None  # read once, when the graph was built
        return transports.get(d.transport).relay_prefill(self.relay_model(r), state, art, suffix, **d.options)

    def _native(
        self,
        r,
        text,
        suffix,
        t0,
        timings,
        reason,
        max_new_tokens=32,
        temperature=0.0,
        d: Decision | None = None,
        on_token: Callable[[int], None] | None = None,
        sampling: Sampling | None = None,
    ) -> RelayResult:
        tp = time.perf_counter()
        ids = context_ids(r, text)
        check_window(r, len(ids) + len(suffix), max_new_tokens)
        out = runner.forward(r, torch.cat([ids, suffix]))
        timings["prefill_s"] = time.perf_counter() - tp
        tf = time.perf_counter()
        gen = runner.decode(r, out.cache, out.logits[-1], t0, max_new_tokens, temperature, on_token=on_token,
                            sampling=sampling)  # fmt: skip
        timings["first_token_s"] = gen.ttft_s - (tf - t0)
        decision = d.as_dict() if d else {"transport": "native", "reason": reason}
        decision["reason"] = reason
        return RelayResult(
            text=gen.text,
            tokens=gen.tokens,
            transport="native",
            reason=reason,
            ttft_s=gen.ttft_s,
            total_s=gen.total_s,
            context_tokens=len(ids),
            timings=timings,
            decision=decision,
            first_logits=out.logits[-1],
            finish_reason=gen.finish_reason,
            logprobs=gen.logprobs,
        )


def check_request(text: str, suffix: str, max_new_tokens: int, temperature: float) -> None:
    """The request's own fields, before any model runs (a UsageError says which is wrong)."""
    checked_text(text, "context")
    checked_text(suffix, "suffix", allow_empty=True)
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be a positive integer, not {max_new_tokens!r}")
    if not isinstance(temperature, int | float) or not 0.0 <= temperature < float("inf"):
        raise UsageError(f"temperature must be a finite number >= 0, not {temperature!r}")


def check_window(m: LoadedModel, n_tokens: int, max_new_tokens: int = 0) -> None:
    """Refuse a prompt (plus the tokens to generate) longer than the model's context window."""
    window = m.spec.context_window
    if window is not None and n_tokens + max_new_tokens > window:
        raise UsageError(
            f"{m.spec.name} reads at most {window} tokens; this request needs {n_tokens} "
            f"+ {max_new_tokens} to generate: shorten the text or ask for fewer tokens"
        )


def _refusal(out: RelayOutput, r: LoadedModel, threshold: float) -> str:
    """Why a relayed prefill must not be served to this request ("" when it may)."""
    if int(out.logits[-1].argmax()) in runner.eos_ids(r):
        # an approximate cache can inflate end-of-text (the demo: smollm2's EOS 0.23 relayed vs 0.04
        # native): a relay that would answer nothing is never served
        return "the relayed first token ends the text (an empty answer)"
    est = out.info.get("estimate")
    if est is not None and est < threshold:
        return f"estimated top-1 {est:.2f} < {threshold:.2f}"
    return ""
