"""`ctxrelay serve --engine vllm`: the same turns as engine.py, decoded by one vLLM engine per served model.

The router keeps what is ctxrelay's: chat templates, conversations, the gate and the relay's own compute
(translation and selective recompute on ctxrelay's runner, under the compute lock), and the state each
turn leaves for the next. The engine does what engines do: prefill, continuous batching across requests,
decode, and exact prefix reuse within its model (prefix caching on). A relayed turn hands the engine the
receiver cache the relay built (engines/kv_payload.py, a sealed file bound to weights, tenant and the
prompt's tokens); the engine's KV connector writes it into the paged cache and the engine prefills only
the new turn. Every request carries a prefix-cache salt: per tenant, and per relay where the K/V is
approximate, so a relayed cache never answers another request's lookup. A load the connector refuses is
recomputed by the engine (never a wrong answer).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import httpx
import torch

from ctxrelay.engines.kv_capture import CapturedKV, wait_for_file
from ctxrelay.engines.kv_payload import KVPayload, handoff_dir
from ctxrelay.engines.vllm_params import cache_salt, capture_params, kv_params
from ctxrelay.engines.vllm_server import DTYPES, EngineConfig, VllmServer
from ctxrelay.errors import BindingError
from ctxrelay.models import runner
from ctxrelay.models.capture import state_of_kv, unrope_keys
from ctxrelay.models.sampling import Sampling, TokenLogprob
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids, suffix_ids, tokenize_context
from ctxrelay.relay.api import ModelPool, Prepared, RelayResult, check_window
from ctxrelay.relay.graph import Profile
from ctxrelay.serve.compute import Cancel
from ctxrelay.serve.engine import Engine, OnToken, Prompt, Served, cancellable
from ctxrelay.serve.errors import ApiError
from ctxrelay.serve.metrics import Metrics
from ctxrelay.serve.sessions import Conversations, Session
from ctxrelay.state import ContextState
from ctxrelay.text import checked_text

log = logging.getLogger("ctxrelay.serve")
CAPTURE_WRITE_S = 60.0  # the engine's writer thread renames the capture into place after the answer


class VllmEngine(Engine):
    """Turns decoded by vLLM engines (one per model, started here and stopped by `close`)."""

    def __init__(
        self, pool: ModelPool, metrics: Metrics, servers: dict[str, VllmServer], *, max_queue: int = 32,
        request_timeout_s: float = 300.0, sessions: Conversations | None = None,
    ):  # fmt: skip
        super().__init__(pool, metrics, max_queue=max_queue, request_timeout_s=request_timeout_s, sessions=sessions)
        self.kind = "vllm"
        self.servers = servers
        self._http = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=10.0))
        self.payload_dir = handoff_dir()
        self.runner_profile: Profile | None = None  # set by engine_profile.prepare_gate

    @staticmethod
    def start(
        pool: ModelPool, metrics: Metrics, config: EngineConfig, isa: str, cache_dir: Path,
        served: list[str] | None = None, **kw,
    ) -> VllmEngine:  # fmt: skip
        """Start one engine per served model (all the pool's by default; in turn: two engines starting at once
        on 2 cores only both run slower), then give the gate the engine's costs (measured once per machine and
        engine setup)."""
        from ctxrelay import zoo
        from ctxrelay.demo import text_for
        from ctxrelay.serve.engine_profile import prepare_gate, profile_path, relay_dtype, relay_profile_path

        log_dir = cache_dir / "logs"

        servers: dict[str, VllmServer] = {}
        try:
            for name in served or list(pool.models):
                m = pool.models[name]
                s = VllmServer(name, zoo.pull(name), m.spec.weights_hash, config, isa, log_dir, m.spec.context_window)
                log.info("starting vLLM (%s, %s) for %s on %s", config.mode, s.dtype, name, s.url)
                s.start()
                servers[name] = s
            engine = VllmEngine(pool, metrics, servers, **kw)
            dtype = next(iter(servers.values())).dtype if servers else config.dtype
            compute = relay_dtype(dtype, isa)
            if compute != torch.float32:
                pool.use_compute_dtype(compute, relay_profile_path(cache_dir, isa, dtype))
            where = profile_path(cache_dir, isa, config.mode, dtype)
            prepare_gate(engine, text_for, list(config.profile_lengths), where)
        except BaseException:
            for s in servers.values():
                s.stop()
            raise
        return engine

    def close(self) -> None:
        super().close()  # the state builds first: they may hold the compute lock
        for s in self.servers.values():
            s.stop()
        self._http.close()
        shutil.rmtree(self.payload_dir, ignore_errors=True)

    # ---- turns --------------------------------------------------------------------------------

    def chat(
        self, tenant: str, p: Prompt, session: Session | None, *, max_tokens: int, temperature: float,
        transport: str = "auto", on_token: OnToken = None, cancel: Cancel | None = None,
        sampling: Sampling | None = None, store: bool = True, state_gives_way: bool = False,
        reply_sent: threading.Event | None = None,
    ) -> Served:  # fmt: skip
        """One chat turn, planned by plan_chat (the window checked there): relayed through the connector
        where the gate says so, the engine prefilling the rest and decoding; the state it leaves is built
        on ctxrelay's runner after the reply (Engine.leave)."""
        model, m = p.model, self.pool.models[p.model]
        self.states.give_way(session)  # a state built only because the server was idle never delays a request
        settled = self.states.settle(session, cancel) if session else {}
        t0 = time.perf_counter()
        waited, kv, prep = 0.0, None, None
        if session is not None and session.state is not None:
            with self.computing(cancel) as waited:
                prep = self.pool.prepare(
                    session.state, model, p.suffix, tenant=tenant, transport=transport, max_new_tokens=max_tokens,
                    temperature=temperature,
                )  # fmt: skip
                if prep.relayed:
                    kv = self.payload(prep, tenant)
            reason = prep.reason
        elif p.history:  # a conversation whose state was dropped or cannot be read
            reason = f"{session.no_state}: native prefill of the transcript"
        else:
            reason = "first turn of the conversation: nothing to relay" if session else "no conversation: stateless"
        ctx = context_ids(m, p.text).tolist()
        ids = [*ctx, *suffix_ids(m, p.suffix).tolist()] if p.suffix else ctx
        res = self.generate(
            model, ids, tenant, t0, max_tokens, temperature, cancellable(on_token, cancel), kv, prep, reason,
            len(ctx), sampling=sampling,
        )  # fmt: skip
        report = self._report(res, model, waited)
        report["prefilled_tokens"] = len(ids) - (kv[1] if kv is not None else 0)  # the engine's own prefill
        report["engine"] = self.engine_facts(model)
        report["engine_cached_tokens"] = res.info["engine_cached_tokens"]  # served by its prefix cache
        self.leave(session, p, tenant, res.text, store, settled, report, state_gives_way, reply_sent)
        return Served(res, report, self.prompt_tokens(p))

    def complete(
        self, p: Prompt, *, max_tokens: int, temperature: float, on_token: OnToken = None, cancel: Cancel | None = None,
        sampling: Sampling | None = None,
    ) -> Served:  # fmt: skip
        ids = context_ids(self.pool.models[p.model], p.text).tolist()
        self.states.give_way(None)
        res = self.generate(
            p.model, ids, "", time.perf_counter(), max_tokens, temperature, cancellable(on_token, cancel), None,
            None, "completion: stateless prompt", len(ids), sampling=sampling,
        )  # fmt: skip
        report = self._report(res, p.model, 0.0)
        report["engine"] = self.engine_facts(p.model)
        report["engine_cached_tokens"] = res.info["engine_cached_tokens"]
        return Served(res, report, len(ids))

    # ---- the state a turn leaves --------------------------------------------------------------

    def state_prefill(
        self, model: str, text: str, tenant: str, own: ContextState | None, cancel: Cancel
    ) -> ContextState:
        """The transcript read by the model's engine, which leaves its K/V (engines/kv_capture.py); the
        router turns it into the state under the compute lock. ctxrelay's runner reads it instead where the
        engine cannot give what the state needs (a family with k-norm: its cached keys lost the pre-norm
        scale the translators read; an edge that needs more than K/V), or where the engine's capture failed."""
        m = self.pool.models[model]
        if not self.engine_reads_state(m, text):
            return super().state_prefill(model, text, tenant, own, cancel)
        try:
            return self.captured_state(m, text, tenant, own, cancel)
        except (ApiError, BindingError, TimeoutError) as e:
            log.warning("%s: the engine's capture failed (%s); the runner reads the transcript", model, e)
            return super().state_prefill(model, text, tenant, own, cancel)

    def engine_reads_state(self, m: LoadedModel, text: str) -> bool:
        """Whether the engine reads the state (else the runner): it can give it (no k-norm, K/V enough), and
        --engine-state says so, or, "auto", its measured native prefill is no slower than the runner's."""
        name = m.spec.name
        if name not in self.servers or m.spec.family.qk_norm or not self.pool.kv_is_enough(name):
            return False
        reader = self.servers[name].config.state_reader
        if reader != "auto":
            return reader == "engine"
        engine_cost = self.pool.profile.native.get(m.spec.weights_hash)
        runner_cost = self.runner_profile.native.get(m.spec.weights_hash) if self.runner_profile else None
        if engine_cost is None or runner_cost is None:
            return True
        n = len(context_ids(m, text))
        return engine_cost.total(n) <= runner_cost.total(n)

    def captured_state(
        self, m: LoadedModel, text: str, tenant: str, own: ContextState | None, cancel: Cancel
    ) -> ContextState:
        model = m.spec.name
        checked_text(text)
        ids = tokenize_context(m, text)[0].tolist()
        check_window(m, len(ids))
        t0 = time.perf_counter()
        # a conversation's reads share a prefix-cache salt of their own: the engine serves the transcript's
        # start from the last read, whose K/V the conversation's own state holds (another conversation's blocks
        # of the same text would leave a start no state of this one covers)
        salt = (own.meta.get("engine_salt") if own is not None else None) or cache_salt(tenant, uuid.uuid4().hex)
        cap = self.capture(model, ids, tenant, salt)
        base = own if own is not None and own.num_tokens >= cap.start else None
        if cap.start and (base is None or base.tokens[: cap.start].tolist() != ids[: cap.start]):
            salt = cache_salt(tenant, uuid.uuid4().hex)  # not the tokens the state holds: read them all, cold
            cap = self.capture(model, ids, tenant, salt)
        read_s = time.perf_counter() - t0
        with self.computing(cancel):
            keys = unrope_keys(m, torch.stack(cap.keys), cap.start)
            state = state_of_kv(m, text, tenant, keys, torch.stack(cap.values), cap.start, base,
                                meta={"captured_by": "vllm", "engine_read_s": read_s, "engine_salt": salt})  # fmt: skip
        state.meta["prefill_s"] = time.perf_counter() - t0
        return state

    def capture(self, model: str, ids: list[int], tenant: str, salt: str) -> CapturedKV:
        """The engine prefills `ids` (one token decoded) and leaves their K/V; read here and removed."""
        path = self.payload_dir / f"capture-{uuid.uuid4().hex}.safetensors"
        try:
            self.read_once(model, ids, salt, capture_params(path, tenant))
            wait_for_file(path, CAPTURE_WRITE_S)
            return CapturedKV.load(path, ids, self.pool.models[model].spec.weights_hash, tenant)
        finally:
            path.unlink(missing_ok=True)

    def read_once(self, model: str, ids: list[int], salt: str, kv_transfer_params: dict | None = None) -> float:
        """One request that only reads `ids` (one token decoded, not streamed): seconds sent -> answered."""
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "cache_salt": salt}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        t = time.perf_counter()
        try:
            r = self._http.post(self.servers[model].url + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise ApiError(502, f"the vLLM engine of {model} failed: {e}") from e
        if r.status_code != 200:
            raise ApiError(502, f"the vLLM engine of {model} answered {r.status_code}: {r.text[:300]!r}")
        return time.perf_counter() - t

    def engine_facts(self, model: str) -> dict:
        s = self.servers[model]
        return {"name": "vllm", "mode": s.config.mode, "dtype": s.dtype}

    # ---- the engine call ----------------------------------------------------------------------

    def payload(self, prep: Prepared, tenant: str) -> tuple[Path, int]:
        """The relayed receiver cache of the context, as the engine's connector loads it (engine dtype)."""
        t = time.perf_counter()
        r = prep.receiver
        n = prep.context_tokens
        ids = context_ids(r, prep.text).tolist()[:n]
        server = self.servers[r.spec.name]
        exact = bool(prep.decision and prep.decision.edge and prep.decision.edge.exact)
        payload = KVPayload.from_cache(prep.out.cache, ids, r.spec.weights_hash, tenant, exact, DTYPES[server.dtype])
        path = payload.save(self.payload_dir / f"{uuid.uuid4().hex}.safetensors")
        prep.timings["payload_s"] = time.perf_counter() - t
        return path, n

    def generate(
        self, model: str, ids: list[int], tenant: str, t0: float, max_tokens: int, temperature: float,
        on_token: OnToken, kv: tuple[Path, int] | None, prep: Prepared | None, reason: str, context_tokens: int = 0,
        salt: str | None = None, sampling: Sampling | None = None,
    ) -> RelayResult:  # fmt: skip
        """Stream the engine's completion of `ids`, handing each token to `on_token`; TTFT from `t0`. The
        prefix-cache salt is the tenant's, or one of its own for a relayed (approximate) cache."""
        server = self.servers[model]
        eos = runner.eos_ids(self.pool.models[model])  # the engine returns the token it stopped at
        body = {
            **_sampling_fields(sampling or Sampling(temperature=temperature)),
            "model": model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "return_token_ids": True, "skip_special_tokens": True, "return_tokens_as_token_ids": True,
            "stream_options": {"include_usage": True},
            # approximate K/V gets a salt of its own: its blocks never answer a later lookup
            "cache_salt": salt or cache_salt(tenant, uuid.uuid4().hex if kv else ""),
        }  # fmt: skip
        if kv is not None:
            body["kv_transfer_params"] = kv_params(kv[0], kv[1], tenant)
        timings = dict(prep.timings) if prep is not None else {}
        te = time.perf_counter()
        tokens: list[int] = []
        text, ttft, usage, finish, logprobs = [], None, {}, "length", []
        try:
            with self._http.stream("POST", server.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise ApiError(502, f"the vLLM engine of {model} answered {r.status_code}: {r.read()[:300]!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices", []):
                        new = c.get("token_ids") or []
                        if new and ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(c.get("text") or "")
                        finish = c.get("finish_reason") or finish
                        logprobs += _token_logprobs(c.get("logprobs"), eos)
                        for tok in new:
                            if tok in eos:
                                continue
                            tokens.append(tok)
                            if on_token is not None:
                                on_token(tok)
        except httpx.HTTPError as e:
            raise ApiError(502, f"the vLLM engine of {model} failed: {e}") from e
        finally:
            if kv is not None:
                kv[0].unlink(missing_ok=True)
        total = time.perf_counter() - t0
        ttft = total if ttft is None else ttft
        timings["engine_ttft_s"] = ttft - (te - t0)
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        relayed = prep is not None and prep.relayed
        decision = prep.decision.as_dict() if prep is not None and prep.decision else {"transport": "native"}
        decision["reason"] = reason
        # a K/V load with no relay behind it is a model's own exact K/V (the engine profile's load timing)
        transport = prep.decision.transport if relayed else "self" if kv is not None else "native"
        return RelayResult(
            text="".join(text), tokens=tokens, transport=transport, reason=reason, ttft_s=ttft, total_s=total,
            context_tokens=context_tokens, timings=timings, decision=decision,
            info={**(prep.out.info if relayed else {}), "engine_cached_tokens": cached}, finish_reason=finish,
            logprobs=logprobs if sampling is not None and sampling.logprobs is not None else None,
        )  # fmt: skip


def _sampling_fields(s: Sampling) -> dict:
    """The engine's request fields of a Sampling (vLLM reads the same OpenAI fields and its own extras)."""
    out = {
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1, "seed": s.seed,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty, "min_tokens": s.min_tokens,
    }  # fmt: skip
    if s.stop:
        out["stop"] = list(s.stop)
    if s.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    if s.logprobs is not None:
        out["logprobs"] = s.logprobs
    return out


def _token_logprobs(lp: dict | None, eos: set[int]) -> list[TokenLogprob]:
    """The engine's legacy-completions logprobs of one chunk (tokens as "token_id:N") as TokenLogprobs."""
    if not lp:
        return []
    out = []
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or [])
    for tok, val, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], tops, strict=False):
        t = int(str(tok).rsplit(":", 1)[-1])
        if t in eos:
            continue
        best = sorted(((int(k.rsplit(":", 1)[-1]), v) for k, v in (top or {}).items()), key=lambda x: -x[1])
        out.append(TokenLogprob(t, float(val), tuple(best)))
    return out
