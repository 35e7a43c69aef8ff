"""Measure the cost model on this machine: native prefill per model, transport components per edge.

Each point is a median of timed repeats after a warm-up, at the thread count the process runs with.
Sender states for the edges are cached on disk (they cost a sender prefill each), so re-profiling
after a code change is cheap. The result is a `Profile` the gate predicts from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths, transports
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.graph import NATIVE_KEY, CostModel, Profile, measured_with
from ctxrelay.relay.store import DiskStore, StateKey, StoreUnavailable
from ctxrelay.state import ContextState, content_hash
from ctxrelay.timing import median_components

TextFor = Callable[[LoadedModel, int], str]  # (model, n tokens) -> text of about n tokens for it
PROBE_SUFFIX = "\nAnswer:"
# per measured point: warm-up calls until they add up to WARMUP_S (at least one), then timed calls until they
# add up to MEASURE_S (at least `repeats`): fast points get more of both (timing.median_components)
WARMUP_S, MEASURE_S = 1.0, 2.0


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


def profile_pool(
    pool: ModelPool, text_for: TextFor, lengths: list[int], repeats: int = 2, only_missing: bool = False,
    merge: bool = False,
) -> Profile:  # fmt: skip
    """Fill `pool.profile` with native and edge costs at `lengths`; returns it (not saved).

    merge=True keeps each cost model's samples at other lengths and refits over all of them (a
    profile extended to the lengths the pool serves, without measuring the old lengths again).
    only_missing=True measures the models and points the profile holds no cost for, and the points whose
    cost it cannot tie to the installed artifact (measured with another, or before costs recorded which)."""
    prof = pool.profile
    prof.machine = {"torch_threads": torch.get_num_threads()}
    models = [m for m in pool.models.values() if not (only_missing and m.spec.weights_hash in prof.native)]
    # exact edges (a model's own K/V) need no cost model: the gate takes them whenever they apply
    points = [
        (e, p) for e in pool.graph.edges if not e.exact for p in e.points if not (only_missing and _vouched(prof, e, p))
    ]
    work = len(lengths) * (len(models) + len(points))
    bar = tqdm(total=work, desc="profile", unit="pt")
    for m in models:
        samples = []
        for n in lengths:
            bar.set_postfix_str(f"native {m.spec.name} @ {n}")
            samples.append(measure_native(m, text_for(m, n), repeats))
            bar.update()
        old = prof.native.get(m.spec.weights_hash) if merge else None
        prof.native[m.spec.weights_hash] = _merged(old, samples)
    for e, p in points:
        sender, _ = edge_models(pool, e)
        samples = []
        for n in lengths:
            bar.set_postfix_str(f"{e.label} {p.label} @ {n}")
            samples.append(measure_point(pool, e, p, text_for(sender, n), repeats))
            bar.update()
        old = prof.edges.get(e.point_key(p)) if merge else None
        old = old if old is not None and measured_with(old, e) else None  # another artifact's samples go
        prof.edges[e.point_key(p)] = _merged(old, samples, e.artifact_digest)
    bar.close()
    pool.refresh(prof)
    return prof
