"""Measure the cost model on this machine: native prefill per model, transport components per edge.

Each point is a median of timed repeats after a warm-up, at the thread count the process runs with.
Sender states for the edges are cached on disk (they cost a sender prefill each), so re-profiling
after a code change is cheap. The result is a `Profile` the gate predicts from.

A request needs only some of the pool's points (`request_needs`): its receivers' native prefill and the
points of its sender -> receiver edges that the gate would judge on cost at its length. The demo measures
those that the profile cannot answer for (`unmeasured`) and leaves the rest to `ctxrelay profile
--only-missing`: the gate answers natively where a point has no cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths, transports
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.gate import quality_at, quality_refusal
from ctxrelay.relay.graph import NATIVE_KEY, CostModel, Edge, OperatingPoint, Profile, measured_with
from ctxrelay.relay.store import DiskStore, StateKey, StoreUnavailable
from ctxrelay.state import ContextState, content_hash
from ctxrelay.timing import median_components

TextFor = Callable[[LoadedModel, int], str]  # (model, n tokens) -> text of about n tokens for it
PROBE_SUFFIX = "\nAnswer:"
# per measured point: warm-up calls until they add up to WARMUP_S (at least one), then timed calls until they
# add up to MEASURE_S (at least `repeats`): fast points get more of both (timing.median_components)
WARMUP_S, MEASURE_S = 1.0, 2.0
# a cost model answers for a request whose length lies within its samples' lengths, or this factor outside
# them: the same text length is a few % more or fewer tokens for another text or tokenizer
REACH = 1.1
PROGRESS = "{desc}: {percentage:3.0f}%|{bar:24}| {elapsed} spent, about {remaining} left{postfix}"


def measure_native(m: LoadedModel, text: str, repeats: int) -> tuple[int, dict[str, float]]:
    ids = torch.cat([context_ids(m, text), _suffix(m)])

    def once() -> dict[str, float]:
        t = time.perf_counter()
        out = runner.forward(m, ids)
        int(out.logits[-1].argmax())
        return {NATIVE_KEY: time.perf_counter() - t}

    return len(ids), median_components(once, repeats, warmup_s=WARMUP_S, measure_s=MEASURE_S)


def _suffix(m: LoadedModel) -> torch.Tensor:
    return suffix_ids(m, PROBE_SUFFIX)


def cached_sender_state(pool: ModelPool, sender: LoadedModel, text: str) -> ContextState:
    """A sender state for `text`, from the profile cache or a fresh (expensive) sender prefill."""
    disk = DiskStore(paths.work_dir("profile_states"))
    key = StateKey("profile", content_hash(text), sender.spec.weights_hash)
    try:
        state = disk.get(key, "profile")
    except StoreUnavailable:
        state = None
    needs = {transports.get(e.transport).needs for e in pool.graph.edges_from(sender.spec.weights_hash)}
    if state is None or not all(state.has(n) for n in needs):
        state = pool.prefill(sender.spec.name, text, tenant="profile", store=False)
        disk.put(state)
    return state


def edge_models(pool: ModelPool, e) -> tuple[LoadedModel, LoadedModel]:
    """The pool's loaded sender and receiver of edge `e` (matched by weights hash, not name)."""
    by_hash = {m.spec.weights_hash: m for m in pool.models.values()}
    return by_hash[e.sender["weights_hash"]], by_hash[e.receiver["weights_hash"]]


def measure_point(pool: ModelPool, e, p, text: str, repeats: int) -> tuple[int, dict[str, float]]:
    """(receiver tokens, median components) of relaying `text` (the sender's) over edge `e` at point `p`."""
    sender, receiver = edge_models(pool, e)
    receiver = pool.relay_model(receiver)  # in the precision the pool relays in
    art = pool.artifact(e.artifact_path) if e.artifact_path is not None else None
    t = transports.get(e.transport)
    state = cached_sender_state(pool, sender, text)
    suffix = _suffix(receiver)
    n_recv = len(context_ids(receiver, state.text)) + len(suffix)

    def once() -> dict[str, float]:
        out = t.relay_prefill(receiver, state, art, suffix, **p.options)
        t0 = time.perf_counter()
        int(out.logits[-1].argmax())
        timings = dict(out.timings)
        timings["first_token_s"] = timings.get("first_token_s", 0.0) + time.perf_counter() - t0
        return timings

    return n_recv, median_components(once, repeats, warmup_s=WARMUP_S, measure_s=MEASURE_S)


def _merged(old: CostModel | None, new: list[tuple[int, dict[str, float]]], artifact: str = "") -> CostModel:
    """A cost model fit to the new samples and the old ones at lengths not measured again (measured with
    `artifact`, the digest of the artifact relayed with; "" for native prefill)."""
    lengths = {n for n, _ in new}
    # the same text length gives token counts a few apart across tokenizers: 5% counts as the same length
    kept = [s for s in (old.samples if old else []) if all(abs(s[0] - n) > 0.05 * n for n in lengths)]
    return CostModel.fit(sorted(kept + new, key=lambda s: s[0]), artifact)


def _vouched(prof: Profile, e, p) -> bool:
    """Whether the profile holds a cost for point `p` of edge `e` measured with the installed artifact."""
    cost = prof.edges.get(e.point_key(p))
    return cost is not None and cost.artifact == e.artifact_digest


def refit_profile(path: Path) -> Path:
    """The profile at `path` with every cost model fitted again to its own samples (after a change of
    CostModel.fit; nothing is measured), written back in place."""
    if not path.exists():
        raise UsageError(f"no profile at {path}: run `ctxrelay profile` first")
    prof = Profile.load(path)
    for models in (prof.native, prof.edges):
        for key, cm in models.items():
            if cm.samples:
                models[key] = CostModel.fit(cm.samples, cm.artifact)
    prof.save(path)
    return path


def request_needs(pool: ModelPool, sender: str, receivers: dict[str, int], quality_threshold: float) -> dict[str, int]:
    """What the gate reads from the profile to serve `sender`'s state to each receiver (name -> the request's
    receiver tokens): profile key -> that length. For each operating point of the sender -> receiver edges
    whose calibrated quality passes `quality_threshold` at that length, its cost (key `edge.point_key`),
    and, where any point passes, the receiver's native prefill (key: its weights hash). The gate refuses
    the other points on quality before it reads a cost, an exact edge (a model's own K/V) needs none, and
    the sender's own native cost is never read."""
    s = pool.model(sender).spec.weights_hash
    out: dict[str, int] = {}
    for name, n in receivers.items():
        r = pool.model(name).spec.weights_hash
        for e in pool.graph.edges_between(s, r):
            for p in e.points if not e.exact else ():
                if quality_refusal(quality_at(p.quality, n), quality_threshold) is None:
                    out[e.point_key(p)] = max(n, out.get(e.point_key(p), 0))
                    out[r] = max(n, out.get(r, 0))
    return out


def _reaches(cost: CostModel | None, n: int) -> bool:
    """Whether `cost` was sampled around `n` tokens (REACH), so that predicting there interpolates."""
    lengths = [s[0] for s in cost.samples] if cost is not None else []
    return bool(lengths) and min(lengths) <= n * REACH and max(lengths) * REACH >= n


def profiled_points(pool: ModelPool) -> dict[str, tuple[Edge, OperatingPoint]]:
    """Profile key -> (edge, point) of every operating point that takes a cost model (not exact edges)."""
    return {e.point_key(p): (e, p) for e in pool.graph.edges if not e.exact for p in e.points}


def unmeasured(pool: ModelPool, needs: dict[str, int]) -> set[str]:
    """The keys of `needs` (request_needs) the profile cannot answer for: no cost, a cost measured with
    another artifact than the installed one, or samples that do not reach the request's length."""
    prof, points = pool.profile, profiled_points(pool)
    out = set()
    for key, n in needs.items():
        if key in points:
            e, p = points[key]
            ok = _vouched(prof, e, p) and _reaches(prof.edges.get(key), n)
        else:
            ok = _reaches(prof.native.get(key), n)
        if not ok:
            out.add(key)
    return out


def unprofiled(pool: ModelPool) -> set[str]:
    """The pool's profile keys with no usable cost: what `ctxrelay profile --only-missing` measures."""
    prof = pool.profile
    natives = {m.spec.weights_hash for m in pool.models.values()} - set(prof.native)
    return natives | {key for key, (e, p) in profiled_points(pool).items() if not _vouched(prof, e, p)}


def point_label(pool: ModelPool, key: str) -> str:
    """A profile key as a reader names it: "native <model>" or "<transport>: <sender> -> <receiver> <point>"."""
    points = profiled_points(pool)
    if key in points:
        e, p = points[key]
        return f"{e.label} {p.label}".strip()
    return "native " + next((m.spec.name for m in pool.models.values() if m.spec.weights_hash == key), key)


def profile_pool(
    pool: ModelPool, text_for: TextFor, lengths: list[int], repeats: int = 2, only_missing: bool = False,
    merge: bool = False, only: Collection[str] | None = None,
) -> Profile:  # fmt: skip
    """Fill `pool.profile` with native and edge costs at `lengths`; returns it (not saved).

    merge=True keeps each cost model's samples at other lengths and refits over all of them (a
    profile extended to the lengths the pool serves, without measuring the old lengths again).
    only_missing=True measures the models and points the profile holds no cost for, and the points whose
    cost it cannot tie to the installed artifact (measured with another, or before costs recorded which).
    only: measure just these profile keys (a model's weights hash for its native prefill, `edge.point_key`
    for an operating point; the demo passes what its request needs).

    The progress bar names each step and estimates the time left, counting a step as 1 + its length over the
    longest (every measurement takes a few seconds of warm-up and timing, longer ones more)."""
    prof = pool.profile
    prof.machine = {"torch_threads": torch.get_num_threads()}
    chosen = (lambda key: key in only) if only is not None else (lambda key: True)
    models = [
        m for m in pool.models.values()
        if chosen(m.spec.weights_hash) and not (only_missing and m.spec.weights_hash in prof.native)
    ]  # fmt: skip
    # exact edges (a model's own K/V) need no cost model: the gate takes them whenever they apply
    points = [
        (e, p) for key, (e, p) in profiled_points(pool).items()
        if chosen(key) and not (only_missing and _vouched(prof, e, p))
    ]  # fmt: skip
    senders = list({id(s): s for s in (edge_models(pool, e)[0] for e, _ in points)}.values())
    steps = len(lengths) * (len(models) + len(senders) + len(points))
    weight = {n: 1.0 + n / max(lengths) for n in lengths}
    bar = tqdm(total=sum(weight.values()) * (len(models) + len(senders) + len(points)), desc="cost model",
               bar_format=PROGRESS)  # fmt: skip
    done = 0

    def step(what: str, n: int) -> None:
        nonlocal done
        done += 1
        bar.set_postfix_str(f"{done}/{steps} {what} @ {n} tokens")

    for m in models:
        samples = []
        for n in lengths:
            step(f"native {m.spec.name}", n)
            samples.append(measure_native(m, text_for(m, n), repeats))
            bar.update(weight[n])
        old = prof.native.get(m.spec.weights_hash) if merge else None
        prof.native[m.spec.weights_hash] = _merged(old, samples)
    for sender in senders:  # the sender states the points relay (cached on disk; a sender prefill each where not)
        for n in lengths:
            step(f"sender state {sender.spec.name}", n)
            cached_sender_state(pool, sender, text_for(sender, n))
            bar.update(weight[n])
    for e, p in points:
        sender, _ = edge_models(pool, e)
        samples = []
        for n in lengths:
            step(f"{e.label} {p.label}".strip(), n)
            samples.append(measure_point(pool, e, p, text_for(sender, n), repeats))
            bar.update(weight[n])
        old = prof.edges.get(e.point_key(p)) if merge else None
        old = old if old is not None and measured_with(old, e) else None  # another artifact's samples go
        prof.edges[e.point_key(p)] = _merged(old, samples, e.artifact_digest)
    bar.close()
    pool.refresh(prof)
    return prof
