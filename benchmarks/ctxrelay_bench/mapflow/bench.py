"""mapflow benchmark: receiver TTFT and quality vs native prefill, for mapflow's modes and the baselines.

Per context length: held-out essay contexts, each with a needle fact; the sender (1.5B) prefills each
once with map capture (cached on disk: in a pipeline that prefill happened anyway, so it is not part
of the receiver's TTFT; the capture's extra cost over a plain sender prefill is reported apart).
Every method is an in-memory mapflow artifact variant run through `mapflow.relay_prefill`:

  mapflow   the calibrated artifact (its per-layer modes) at several p and r: the frontier;
            all-guided and all-replace variants of the same calibration (guided-all: a guided
            artifact with its native layers, those past its r, guided too)
  iam       IAM-style reuse: the later 50% of layers replace their attention with the sender's
            (suffix alignment, head h <- the proportionally placed sender head, no learned mixing)
  flexprefill  FlexPrefill-style receiver-side sparse prefill: layers >= r attend only to key
            blocks chosen top-p by the receiver's own last query block (no sender involved)
  native    the receiver's own prefill (reference for every ratio and every quality number)

Quality: the true continuation (teacher-forced) after the context: next-token KL(native || relay),
top-1 agreement, perplexity at H; and needle QA (greedy answer after the question). TTFT: context +
question, first token, on the first context of each length, methods interleaved per repeat.
"""

from __future__ import annotations

import gc
import hashlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths
from ctxrelay.data.datasets import essay_haystack
from ctxrelay.data.needle import make_needle_case, score_answer
from ctxrelay.errors import UsageError
from ctxrelay.metrics import next_token_kl, pooled_perplexity, token_nll, top1_agreement
from ctxrelay.models.tokens import suffix_ids
from ctxrelay.results import write_results
from ctxrelay.transports.base import TuningKey
from ctxrelay.transports.mapflow.calibration.job import DEFAULT_RECEIVER, DEFAULT_SENDER
from ctxrelay_bench.mapflow_capture.operators import operator_times
from ctxrelay_bench.runs import bench_command

# `--set` keys (`ctxrelay bench NAME --keys` prints them): name, default, meaning
TUNING_KEYS = [
    TuningKey("artifact", "", "default: the packaged artifact, else <cache>/artifacts"),
    TuningKey("contexts", 3, "needle contexts per length (quality); TTFT is timed on the first"),
    TuningKey("continuation", 129, "teacher-forced tokens after the context (ppl@128 needs 129)"),
    TuningKey("answer_tokens", 10, "greedy needle-answer tokens"),
    TuningKey("capture_p", 0.95, "sender maps are captured once at this p and re-selected per method"),
    TuningKey("capture", "auto", "exact | sampled | auto (sampled unless a measured variant has replace layers)"),
    TuningKey("p_list", "0.8,0.9,0.95", "sender top-p values of the frontier (comma list)"),
    TuningKey("r_list", "", "extra r for the frontier (default: artifact r + 4 and + 8)"),
    TuningKey("gp_list", "0.8", "extra guided top-p values for the frontier (at the artifact's p)"),
    TuningKey("gs_list", "", "other guided selections (row | global) at the artifact's guided p and each of gp_list"),
    TuningKey("methods", "mapflow,guided,hybrid,replace,iam,flex", "the methods measured (comma list)"),
    TuningKey("flex_p", "0.8,0.9", "FlexPrefill-style baseline's top-p values"),
    TuningKey("sender_pairs", 3, "interleaved native/capture sender prefills on the first context (0: skip)"),
    TuningKey("seed", 0, "case seed"),
]
BENCH_DEFAULTS = {k.name: k.default for k in TUNING_KEYS}
HORIZONS = (1, 16, 32, 128)


def _options(options: dict | None) -> dict:
    unknown = sorted(set(options or {}) - set(BENCH_DEFAULTS))
    if unknown:
        raise UsageError(f"unknown mapflow bench option(s) {unknown}; known: {sorted(BENCH_DEFAULTS)}")
    return {**BENCH_DEFAULTS, **(options or {})}


@dataclass
class Case:
    context: str
    continuation: str
    question: str
    answer: str


def cases_for(tokenizer, n_tokens: int, count: int, cont: int, seed: int) -> list[Case]:
    out = []
    for c in range(count):
        full = essay_haystack(tokenizer, n_tokens + cont + 48, split="heldout", seed=seed + 7 * c + n_tokens)
        enc = tokenizer(full, add_special_tokens=True, return_offsets_mapping=True)
        cut = enc["offset_mapping"][n_tokens - 20][1]  # leave room for the needle's ~20 tokens
        needle = make_needle_case(full[:cut], depth=(0.25, 0.5, 0.75)[c % 3], seed=seed + c + n_tokens)
        out.append(Case(needle.context, full[cut:], needle.question, needle.answer))
    return out


# ---- method variants -------------------------------------------------------------------------------


def variants(art, receiver, opts: dict) -> list[tuple[str, str, object]]:
    """(transport, method label, artifact variant) for every row to measure."""
    from ctxrelay.transports.mapflow.guided import SELECTS
    from ctxrelay.transports.mapflow.mixing import one_hot_w, proportional_heads
    from ctxrelay.transports.mapflow.reuse import ReuseConfig

    base = ReuseConfig.from_params(art.params, art.tensors)
    lr = receiver.spec.num_layers
    r0 = int(art.params.get("reuse_from", base.r))
    mapping = [int(x) for x in art.params.get("diagnosis_mapping", base.mapping)]
    reused = [j for j in range(r0, lr)]
    w_fit = {j: art.tensors[f"w_fit.{j}"] for j in reused}
    w_tr = {j: art.tensors.get(f"w_trained.{j}", w_fit[j]) for j in reused}
    ps = [float(x) for x in str(opts["p_list"]).split(",") if x]
    rs = [int(x) for x in str(opts["r_list"]).split(",") if x] or [r0 + 4, r0 + 8]
    want = set(str(opts["methods"]).split(","))
    out = []
    fps = [float(x) for x in str(opts["flex_p"]).split(",") if x]
    gps = [float(x) for x in str(opts["gp_list"]).split(",") if x]
    mapping_all = mapping

    def cfg(modes, w, p, mapping=None, flex_p=base.flex_p, guided_p=base.guided_p, select=base.guided_select):
        mapping = mapping or [mapping_all[j] if m not in ("native", "flex") else -1 for j, m in enumerate(modes)]
        ww = {j: w[j] for j, m in enumerate(modes) if m in ("replace", "guided", "hybrid")}
        return ReuseConfig(
            modes, mapping, ww, p, guided_p, base.unit, flex_p, base.block, base.local, guided_select=select
        )

    def with_r(modes, r):
        return ["native"] * r + modes[r:]

    art_w = {j: (w_tr[j] if m == "replace" else w_fit[j]) for j, m in enumerate(base.modes) if m != "native"}
    if "mapflow" in want:
        for p in ps:
            out.append(("mapflow", base.method(), cfg(base.modes, art_w, p)))
        for r in rs:
            if r0 < r < lr:
                out.append(("mapflow", base.method(), cfg(with_r(base.modes, r), art_w, base.top_p)))
        for gp in gps:
            if gp != base.guided_p:
                out.append(("mapflow", base.method(), cfg(base.modes, art_w, base.top_p, guided_p=gp)))
        for gs in [x for x in str(opts["gs_list"]).split(",") if x and x != base.guided_select]:
            if gs not in SELECTS:
                raise UsageError(f"gs_list: unknown guided selection {gs!r}; use {', '.join(SELECTS)}")
            for gp in sorted({base.guided_p, *gps}):
                out.append(("mapflow", base.method(), cfg(base.modes, art_w, base.top_p, guided_p=gp, select=gs)))
    every_guided = with_r(["guided"] * lr, r0)
    if "guided" in want and base.method() != "guided":
        for p in ps:
            out.append(("mapflow", "guided", cfg(every_guided, w_fit, p)))
    elif "guided" in want and base.modes != every_guided:  # the artifact's native layers sparse too
        for gp in sorted({base.guided_p, *gps}):
            out.append(("mapflow", "guided-all", cfg(every_guided, w_fit, base.top_p, guided_p=gp)))
    if "hybrid" in want and base.method() != "hybrid":
        out.append(("mapflow", "hybrid", cfg(with_r(["hybrid"] * lr, r0), w_fit, base.top_p)))
    if "replace" in want and base.method() != "replace":
        out.append(("mapflow", "replace", cfg(with_r(["replace"] * lr, r0), w_tr, base.top_p)))
    if "iam" in want:
        half = lr // 2
        hs, hr = art.tensors[f"w_fit.{r0}"].shape
        w_iam = {j: one_hot_w(proportional_heads(hs, hr), hs) for j in range(lr)}
        sfx = [max(0, j + base_sender_layers(art) - lr) for j in range(lr)]
        out.append(("iam", "replace-50%", cfg(with_r(["replace"] * lr, half), w_iam, base.top_p, sfx)))
    if "flex" in want:
        for fp in fps:
            out.append(("flexprefill", "receiver-top-p", cfg(with_r(["flex"] * lr, r0), {}, base.top_p, flex_p=fp)))
    return out


def base_sender_layers(art) -> int:
    return int(art.tensors["diagnosis.tv"].shape[1])


def as_artifact(art, cfg):
    from ctxrelay.artifact import Artifact

    return Artifact(art.transport, art.version, art.sender, art.receiver, cfg.w_tensors(), cfg.to_params())


# ---- one context ------------------------------------------------------------------------------------


def sender_state(
    case: Case, capture_p: float, block: int, layers: list[int], cache: Path, load, capture: str = "exact"
):
    """The sender's ContextState with maps of `layers` at capture_p, prefilled once and cached on disk
    (untimed: a first prefill after loading runs cold; `sender_timing` times the sender properly)."""
    from ctxrelay.models.capture import capture_state
    from ctxrelay.state import ContextState
    from ctxrelay.transports import mapflow

    how = "" if capture == "exact" else f"|{capture}-{mapflow.SAMPLE_ROWS}"  # exact keeps the older cache keys
    key = hashlib.sha256(f"{case.context}|{capture_p}|{block}|{layers}{how}".encode()).hexdigest()[:24]
    path = cache / f"{key}.safetensors"
    if path.exists():
        return ContextState.load(path)
    m = load()
    plan = mapflow.map_capture_plan(m, capture_p, block, layers=layers, capture=capture)
    state = capture_state(m, case.context, "bench", [plan], kv=False)
    state.save(path)
    return state


def sender_timing(load, art, case: Case, plan_args: tuple, pairs: int) -> dict | None:
    """The sender's native prefill vs its prefill with the bench's capture (`sender_state`'s plan:
    capture_p, block, layers, capture) on one context: a warm-up of each, then `pairs` interleaved pairs
    (bench mapflow-capture's overhead phase), medians, and the time inside the capture's hook (None: exact, no hook)."""
    from types import SimpleNamespace

    from ctxrelay.transports import mapflow
    from ctxrelay_bench.mapflow_capture.bench import overhead  # that module builds on this one

    if pairs <= 0:
        return None
    if pairs < 3:
        raise UsageError("sender_pairs needs >= 3 interleaved pairs (run-to-run noise is large), or 0 to skip")
    m, (capture_p, block, layers, capture) = load(), plan_args
    params = SimpleNamespace(params=dict(art.params, capture=capture))
    res = overhead(
        m, params, case.context, pairs, {"warmup": 1, "sample_rows": 0, "exact_repeats": 0},
        plan_of=lambda cap: mapflow.map_capture_plan(m, capture_p, block, layers=layers, capture=cap),
    )  # fmt: skip
    keep = ("capture", "native_s", "capture_s", "capture_overhead", "pair_overhead")
    return {k: res[k] for k in (*keep, "native_times_s", "capture_times_s", "hook_s", "hook_share")}


@dataclass
class Reference:
    cont: torch.Tensor
    question: torch.Tensor
    logits: torch.Tensor  # [n-1, V] native logits over the continuation (predicting cont[1:])
    first: torch.Tensor  # [V] native logits predicting cont[0]
    answer: str


def native_reference(r, state, case: Case, opts: dict) -> Reference:
    from ctxrelay.models import runner

    cont = suffix_ids(r, case.continuation)[: int(opts["continuation"])]
    q = suffix_ids(r, case.question)
    pre = runner.forward(r, state.tokens, logits="last")
    logits = runner.forward(r, cont[:-1], pre.cache.clone(), logits="all").logits
    qo = runner.forward(r, q, pre.cache, logits="last")
    gen = runner.decode(r, qo.cache, qo.logits[-1], time.perf_counter(), int(opts["answer_tokens"]))
    return Reference(cont, q, logits.float(), pre.logits[-1].float(), gen.text)


def relay_quality(r, state, art_v, ref: Reference, opts: dict) -> dict:
    from ctxrelay.models import runner
    from ctxrelay.transports import mapflow

    out = mapflow.relay_prefill(r, state, art_v, torch.zeros(0, dtype=torch.long))
    cache_q = out.cache.clone()
    logits = runner.forward(r, ref.cont[:-1], out.cache, logits="all").logits.float()
    relay = torch.cat([out.logits.float(), logits])
    native = torch.cat([ref.first[None], ref.logits])
    qo = runner.forward(r, ref.question, cache_q, logits="last")
    gen = runner.decode(r, qo.cache, qo.logits[-1], time.perf_counter(), int(opts["answer_tokens"]))
    return {
        "top1": top1_agreement(native, relay) * native.shape[0],
        "kl": next_token_kl(native, relay) * native.shape[0],
        "n": native.shape[0],
        "nll": token_nll(relay, ref.cont),
        "native_nll": token_nll(native, ref.cont),
        "answer": gen.text,
        "info": out.info,
    }


def time_ttft(r, state, ref: Reference, arts: list, repeats: int) -> tuple[list[float], list[list[float]], list]:
    """Median TTFT of native (index 0 in the result) and each artifact variant, interleaved per repeat."""
    from ctxrelay.models import runner
    from ctxrelay.transports import mapflow

    ids = torch.cat([state.tokens, ref.question])
    times: list[list[float]] = [[] for _ in range(len(arts) + 1)]
    comps: list[list[dict]] = [[] for _ in arts]
    for _ in range(repeats):
        t0 = time.perf_counter()
        int(runner.forward(r, ids, logits="last").logits[-1].argmax())
        times[0].append(time.perf_counter() - t0)
        for k, a in enumerate(arts):
            t0 = time.perf_counter()
            o = mapflow.relay_prefill(r, state, a, ref.question)
            int(o.logits[-1].argmax())
            times[k + 1].append(time.perf_counter() - t0)
            comps[k].append(dict(o.timings, wall_s=times[k + 1][-1]))
    return [statistics.median(t) for t in times], times, comps


# ---- the benchmark ---------------------------------------------------------------------------------


def load_artifact(opts: dict, sender: str, receiver: str):
    from ctxrelay.artifact import Artifact
    from ctxrelay.transports import mapflow

    name = paths.artifact_name("mapflow", sender, receiver)
    default = [paths.PACKAGED_ARTIFACTS / name, paths.user_artifacts() / name]
    candidates = [Path(opts["artifact"])] if opts["artifact"] else default
    for p in candidates:
        if p.exists():
            return p, Artifact.load(p, transport=mapflow.TRANSPORT, version=mapflow.ARTIFACT_VERSION)
    raise UsageError(
        f"no mapflow artifact for {sender} -> {receiver} (looked at {', '.join(map(str, candidates))}); "
        f"run `ctxrelay calibrate --transport mapflow --sender {sender} --receiver {receiver}` first"
    )


def bench(model, sender, receiver, lengths, repeats, out, options, command) -> Path:
    from ctxrelay import zoo
    from ctxrelay_bench.plots import plot_path

    if model:
        raise UsageError("bench mapflow takes --sender/--receiver (a same-tokenizer pair), not --model")
    opts = _options(options)
    if not lengths:
        raise UsageError("give at least one context length (--lengths 1024,2048,4096)")
    sender, receiver = sender or DEFAULT_SENDER, receiver or DEFAULT_RECEIVER
    if "," in sender or "," in receiver:
        raise UsageError("bench mapflow measures one pair at a time: give one --sender and one --receiver")
    art_path, art = load_artifact(opts, sender, receiver)
    r = zoo.load(receiver)
    art.check(None, r)
    block = int(art.params.get("block", 64))
    cache = paths.work_dir("mapflow", "bench-states", Path(sender).name)
    snd: list = []

    def load_sender():
        if not snd:
            snd.append(zoo.load(sender))
        return snd[0]

    def free_sender():  # the 7 GB sender leaves before the receiver runs
        if snd:
            snd.clear()
            gc.collect()

    vs = variants(art, r, opts)
    layers = sorted({sl for _, _, cfg in vs for sl in cfg.sender_layers()})  # capture only what is read
    capture = bench_capture(str(opts["capture"]), [cfg for _, _, cfg in vs])
    rows, extra_lengths = [], {}
    for n in lengths:
        cases = cases_for(r.tokenizer, n, int(opts["contexts"]), int(opts["continuation"]), int(opts["seed"]))
        states = [
            sender_state(c, float(opts["capture_p"]), block, layers, cache, load_sender, capture)
            for c in tqdm(cases, desc=f"sender states @{n}")
        ]
        free_sender()
        arts = [as_artifact(art, cfg) for _, _, cfg in vs]
        acc = [dict(top1=0.0, kl=0.0, n=0, nll=[], native_nll=[], exact=[], info=[]) for _ in vs]
        native_exact, refs = [], []
        for ci, (case, st) in enumerate(zip(cases, states, strict=True)):
            ref = native_reference(r, st, case, opts)
            refs.append(ref)
            native_exact.append(score_answer(ref.answer, case.answer)["exact"])
            for k, a in enumerate(tqdm(arts, desc=f"quality @{n} ctx {ci}", leave=False)):
                q = relay_quality(r, st, a, ref, opts)
                for key in ("top1", "kl", "n"):
                    acc[k][key] += q[key]
                acc[k]["nll"].append(q["nll"])
                acc[k]["native_nll"].append(q["native_nll"])
                acc[k]["exact"].append(score_answer(q["answer"], case.answer)["exact"])
                acc[k]["info"].append(q["info"])
        medians, times, comps = time_ttft(r, states[0], refs[0], arts, repeats)
        ops = operator_times(states[0], art, r, [float(x) for x in str(opts["p_list"]).split(",") if x])
        pair = None
        if any(t == "mapflow" for t, _, _ in vs):
            plan_args = (float(opts["capture_p"]), block, layers, capture)
            pair = sender_timing(load_sender, art, cases[0], plan_args, int(opts["sender_pairs"]))
            free_sender()
        extra_lengths[str(n)] = {
            "operators_ms": ops,
            "context_tokens_actual": [s.num_tokens for s in states],
            "sender_capture": capture,
            "sender_timing": pair,
            "native_times_s": times[0],
            "native_needle_answers": native_exact,
        }
        rows.append(
            {
                "transport": "native",
                "method": "prefill",
                "receiver": receiver,
                "context_tokens": n,
                "native_ttft_s": medians[0],
                "relay_ttft_s": medians[0],
                "speedup": 1.0,
                "needle_acc": sum(native_exact) / len(native_exact),
            }
        )
        for k, (transport, method, cfg) in enumerate(vs):
            rows.append(
                _row(transport, method, cfg, sender, receiver, n, medians, times, comps, k, acc[k], native_exact, pair)
            )
        path = write_results(  # after every length: a long run that stops keeps what it measured
            out,
            rows,
            command or bench_command("mapflow", sender, receiver, lengths, repeats, options),
            extra={
                "artifact": str(art_path),
                "artifact_quality": _brief_quality(art.quality),
                "options": opts,
                "lengths": extra_lengths,
                "notes": NOTES,
                "complete": n == lengths[-1],
            },
        )
        plot(rows, plot_path(path), sender, receiver)
    return path


NOTES = (
    "relay_ttft_s: receiver TTFT (context through the reuse path + question natively + first token); the sender's "
    "prefill is excluded (it happened anyway), its extra cost for map capture is in lengths.*.sender_timing (medians "
    "of interleaved native/capture pairs after a warm-up, first context; hook_s: the capture's own compute, timed "
    "inside its hook); end_to_end_speedup = (sender native + receiver native) / (sender with capture + receiver "
    "relayed). Quality over the teacher-forced continuation vs the receiver's native prefill; needle_acc over the "
    "contexts of that length. All computation fp32 on CPU, same process and threads as native."
)


def bench_capture(option: str, cfgs: list) -> str:
    """The one sender capture every variant can read, chosen per variant as an edge's is
    (`mapflow.edge_capture`; `auto` = the edge default) and exact if any variant needs it."""
    from ctxrelay.transports import mapflow

    asked = {} if option == "auto" else {"capture": option}
    modes = [cfg.modes for cfg in cfgs] or [[]]
    captures = {mapflow.edge_capture({"modes": m, **asked}) for m in modes}
    return "exact" if "exact" in captures else captures.pop()


def _brief_quality(q: dict) -> dict:
    return {k: q[k] for k in ("top1_agreement", "kl", "method", "heldout_contexts", "context_tokens") if k in q}


def _row(transport, method, cfg, sender, receiver, n, medians, times, comps, k, a, native_exact, pair) -> dict:
    n_min = min(x.shape[0] for x in a["nll"])  # horizons longer than every continuation are left out
    hs = [h for h in HORIZONS if h <= n_min]
    ppl, nppl = pooled_perplexity(a["nll"], hs), pooled_perplexity(a["native_nll"], hs)
    comp = {key: statistics.median(c[key] for c in comps[k]) for key in comps[k][0]}
    gap = max(abs(c["wall_s"] - sum(v for kk, v in c.items() if kk != "wall_s")) / c["wall_s"] for c in comps[k])
    dens = sorted({key for i in a["info"] for key in i if key.endswith("_density")})  # mean over the contexts
    return {
        "transport": transport,
        "method": method,
        "sender": sender,
        "receiver": receiver,
        "context_tokens": n,
        "r": cfg.r,
        "top_p": cfg.top_p,
        "guided_p": cfg.guided_p,
        "guided_select": cfg.guided_select,
        "flex_p": cfg.flex_p,
        "modes": cfg.counts(),
        "native_ttft_s": medians[0],
        "relay_ttft_s": medians[k + 1],
        "speedup": medians[0] / medians[k + 1],
        "relay_times_s": times[k + 1],
        "timings": {kk: v for kk, v in comp.items() if kk != "wall_s"},
        "timing_gap_max": gap,
        "top1_agreement": a["top1"] / a["n"],
        "kl": a["kl"] / a["n"],
        "ppl": ppl,
        "native_ppl": nppl,
        "needle_acc": sum(a["exact"]) / len(a["exact"]),
        "native_needle_acc": sum(native_exact) / len(native_exact),
        "contexts": len(a["exact"]),
        **_end_to_end(transport, pair, medians[0], medians[k + 1]),
        **{key: statistics.mean(i[key] for i in a["info"] if key in i) for key in dens},
    }


def _end_to_end(transport: str, pair: dict | None, native_s: float, relay_s: float) -> dict:
    """Sender with capture + receiver relayed vs sender native + receiver native, from the medians of the
    sender's interleaved pairs (`sender_timing`) and the receiver's timed repeats, all on the first context."""
    if transport != "mapflow" or pair is None:  # flex has no sender part: its receiver time is all
        return {}
    return {"end_to_end_speedup": (pair["native_s"] + native_s) / (pair["capture_s"] + relay_s)}


def plot(rows: list[dict], path: Path, sender: str, receiver: str) -> Path:
    """Quality (top-1 agreement) vs TTFT speedup, one colour per method and length; dashed lines at
    native speed and at top-1 0.9."""
    from ctxrelay_bench.plots import grouped, scatter_plot

    def label(row: dict) -> str | None:
        if row["transport"] == "native":
            return None
        select = row.get("guided_select", "row")
        how = f" ({select} top-p)" if select != "row" and row["transport"] == "mapflow" else ""
        return f"{row['transport']}/{row['method']}{how} @{row['context_tokens']}"

    return scatter_plot(
        path,
        grouped(rows, label, "speedup", "top1_agreement"),
        xlabel="TTFT speedup vs native receiver prefill (x)",
        ylabel="top-1 next-token agreement with native",
        title=f"mapflow {sender} -> {receiver}",  # dashed: native speed, the target top-1 0.9
        hline=0.9,
        vline=1.0,
    )
