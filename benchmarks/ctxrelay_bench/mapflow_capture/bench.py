"""mapflow capture benchmark: what the sender pays for its maps, what the cheaper pattern costs the
receiver, and how close the guided sparse attention comes to its ideal.

`ctxrelay bench mapflow-capture --lengths 2048,4096` writes benchmarks/results/mapflow-capture.json.
Phases (`--set phases=overhead,quality,operators`):

  overhead   the sender's native prefill vs its prefill with the capture the pool runs for the shipped
             artifact's edge (its default: sampled rows beside fused SDPA), at `overhead_tokens`, same
             process: `warmup` untimed runs of each, then `repeats` interleaved pairs (the order
             alternating), medians and the median per-pair ratio; the exact capture (eager attention)
             is timed `exact_repeats` times beside them for reference
  quality    per length, `contexts` held-out essays with a needle: one sender prefill records the exact
             maps and the sampled maps at every `rows_list` value; the receiver relays through the shipped
             artifact from each: top-1 agreement and KL vs native over the teacher-forced continuation,
             needle answers (the scoring of `bench mapflow`)
  operators  per length, every guided layer of the artifact on the first context's maps, exact and
             sampled: its guided sparse attention vs SDPA at the same kept-block fraction (operators.py)

Phases may run apart (timing needs the machine alone, quality does not): a run replaces the rows
of the same (phase, length, source) in the results file already there and keeps the others;
`phase_commands` lists the commands that produced each phase's rows.
"""

from __future__ import annotations

import gc
import hashlib
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from ctxrelay import paths
from ctxrelay.data.needle import score_answer
from ctxrelay.errors import UsageError
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.results import read_results, write_results
from ctxrelay.transports import mapflow
from ctxrelay.transports.base import TuningKey
from ctxrelay.transports.mapflow.calibration.job import DEFAULT_RECEIVER, DEFAULT_SENDER
from ctxrelay_bench.mapflow.bench import cases_for, load_artifact, native_reference, relay_quality
from ctxrelay_bench.mapflow_capture.operators import guided_operator_times
from ctxrelay_bench.runs import bench_command, bench_options, timed_run

# `--set` keys (`ctxrelay bench NAME --keys` prints them): name, default, meaning
TUNING_KEYS = [
    TuningKey("phases", "overhead,quality,operators", "what to measure (comma list of overhead, quality, operators)"),
    TuningKey("artifact", "", "default: the packaged artifact, else <cache>/artifacts"),
    TuningKey("overhead_tokens", 4096, "context length of the overhead phase"),
    TuningKey("sample_rows", 0, "overhead phase: sampled rows per block of the timed capture (0: the edge's default)"),
    TuningKey("warmup", 1, "untimed prefills of each kind before the timed pairs"),
    TuningKey("exact_repeats", 1, "timed exact-capture prefills (reference: what the capture cost before)"),
    TuningKey("contexts", 3, "needle contexts per length (quality)"),
    TuningKey("continuation", 129, "teacher-forced continuation tokens"),
    TuningKey("answer_tokens", 10, "greedy needle-answer tokens"),
    TuningKey("rows_list", "1,4,16", "sampled rows per query block compared with the exact capture"),
    TuningKey("op_repeats", 3, "timed repeats per operator and layer"),
    TuningKey("seed", 0, "case seed"),
]
DEFAULTS = {k.name: k.default for k in TUNING_KEYS}
NOTES = (
    "overhead: sender prefill (capture_state, kv=False) with the capture the pool runs for the shipped artifact's "
    "edge vs without any capture, same process and threads; capture_overhead = median(capture)/median(native) - 1, "
    "pair_overhead = median of the per-pair ratios - 1; hook_s = time spent inside the capture's hook (its compute; "
    "null for the exact capture, which has none). "
    "quality: relay through the shipped artifact from each pattern source vs the receiver's native prefill. "
    "operators: one layer's attention over the context with random q/k/v at the receiver's shapes; "
    "ideal_ms = density x sdpa_ms (SDPA's time at the kept-block fraction); fraction_of_ideal = ideal_ms / guided_ms."
)


def _labels(rows_list: str) -> dict[str, tuple[str, int]]:
    """label -> (capture, sample rows) of every pattern source the quality phase compares."""
    out = {"exact": ("exact", 0)}
    for k in (int(x) for x in str(rows_list).split(",") if x):
        out[f"sampled-{k}"] = ("sampled", k)
    return out


# ---- overhead ---------------------------------------------------------------------------------------


def _timed_hook(plan) -> list[float]:
    """Wrap the plan's q/k hook so the seconds spent inside it are summed (the capture's own compute)."""
    spent = [0.0]
    inner = plan.on_qk
    if inner is None:
        return spent

    def hook(call) -> None:
        t0 = time.perf_counter()
        inner(call)
        spent[0] += time.perf_counter() - t0

    plan.on_qk = hook
    return spent


def overhead(sender, art, text: str, repeats: int, opts: dict, plan_of=None) -> dict:
    """Interleaved pairs of native and default-capture sender prefills of `text` (see module docstring).
    `plan_of(capture)` builds the timed capture plan (default: the one the pool runs for `art`'s edge)."""
    from ctxrelay.models.capture import capture_state

    def edge_plan(capture: str):
        params = dict(art.params, capture="exact") if capture == "exact" else art.params
        return mapflow.transport.capture_plan(sender, [params])

    plan_of = plan_of or edge_plan

    def run(kind: str) -> tuple[float, float, float]:
        plan = None if kind == "native" else plan_of(kind)
        spent = _timed_hook(plan) if plan is not None else [0.0]
        plans = [plan] if plan is not None else []
        states = []
        wall, share = timed_run(lambda: states.append(capture_state(sender, text, "bench", plans, kv=False)))
        if plan is not None and not states[0].has(mapflow.PART):
            raise UsageError("the capture left no maps in the state")  # it must have done its work
        return wall, share, spent[0]

    if int(opts["sample_rows"]):
        art = SimpleNamespace(params=dict(art.params, sample_rows=int(opts["sample_rows"])))
    default_capture = mapflow.edge_capture(art.params)
    for _ in range(int(opts["warmup"])):
        run("native")
        run(default_capture)
    times: dict[str, list[float]] = {"native": [], default_capture: [], "exact": []}
    shares: dict[str, list[float]] = {k: [] for k in times}
    hooks: list[float] = []
    for i in tqdm(range(repeats), desc="native/capture pairs"):
        for kind in ("native", default_capture) if i % 2 == 0 else (default_capture, "native"):
            wall, share, spent = run(kind)
            times[kind].append(wall)
            shares[kind].append(share)
            if kind != "native":
                hooks.append(spent)
    for _ in range(int(opts["exact_repeats"]) if default_capture != "exact" else 0):
        wall, share, _ = run("exact")
        times["exact"].append(wall)
        shares["exact"].append(share)
    native_med = statistics.median(times["native"])
    cap_med = statistics.median(times[default_capture])
    pairs = [c / n for n, c in zip(times["native"], times[default_capture], strict=True)]
    rows = int(art.params.get("sample_rows", mapflow.SAMPLE_ROWS))
    hook_s = statistics.median(hooks) if default_capture == "sampled" else None  # exact: eager attention, no hook
    out = {
        "source": f"sampled-{rows}" if default_capture == "sampled" else "exact",
        "capture": default_capture,
        "sample_rows": rows,
        "native_s": native_med,
        "capture_s": cap_med,
        "capture_overhead": cap_med / native_med - 1,
        "pair_overhead": statistics.median(pairs) - 1,
        "hook_s": hook_s,
        "hook_share": None if hook_s is None else hook_s / native_med,
        "native_times_s": times["native"],
        "capture_times_s": times[default_capture],
        "cpu_share": {k: v for k, v in shares.items() if v},
    }
    if times["exact"]:
        out["exact_times_s"] = times["exact"]
        out["exact_capture_overhead"] = statistics.median(times["exact"]) / native_med - 1
    return out


# ---- quality ----------------------------------------------------------------------------------------


def source_states(sender, text: str, capture_p: float, block: int, layers: list[int], labels: dict, cache: Path):
    """{label: ContextState} of `text`, every pattern source from ONE sender prefill; cached on disk."""
    from ctxrelay.models.capture import run_capture
    from ctxrelay.state import Binding, ContextState

    key = hashlib.sha256(f"{text}|{capture_p}|{block}|{layers}".encode()).hexdigest()[:24]
    files = {label: cache / f"{key}-{label}.safetensors" for label in labels}
    out = {label: ContextState.load(f) for label, f in files.items() if f.exists()}
    missing = {label: how for label, how in labels.items() if label not in out}
    if not missing:
        return out
    m = sender()
    plans = {
        label: mapflow.map_capture_plan(m, capture_p, block, layers=layers, capture=cap, sample_rows=max(1, k))
        for label, (cap, k) in missing.items()
    }
    ids, offsets = tokenize_context(m, text)
    run_capture(m, ids, list(plans.values()))
    for label, plan in plans.items():
        st = ContextState(
            text=text, tokens=ids, offsets=offsets, binding=Binding.of(m, "bench"), meta={"sender": m.spec.name}
        )
        plan.finish(st)
        if label == "exact":  # the artifact's guided layers read only pattern and masses: drop the tiles (GBs)
            drop_tiles(st)
        st.save(files[label])
        out[label] = st
    return {label: out[label] for label in labels}


def drop_tiles(state) -> None:
    """Leave the exact maps' pattern and masses, without their probability tiles (guided layers never read them)."""
    part = state.parts[mapflow.PART]
    for key in [k for k in part if k.endswith(".tiles")]:
        part[key] = part[key][:0]


def quality(r, art, cases, states: list[dict], opts: dict) -> dict[str, dict]:
    """Per pattern source: pooled top-1 / KL over every context's continuation, needle answers, density."""
    acc: dict[str, dict] = {}
    native_exact = []
    for case, by_label in zip(cases, states, strict=True):
        ref = native_reference(r, by_label["exact"], case, opts)
        native_exact.append(score_answer(ref.answer, case.answer)["exact"])
        for label, st in by_label.items():
            q = relay_quality(r, st, art, ref, opts)
            a = acc.setdefault(label, dict(top1=0.0, kl=0.0, n=0, exact=[], density=[]))
            a["top1"] += q["top1"]
            a["kl"] += q["kl"]
            a["n"] += q["n"]
            a["exact"].append(score_answer(q["answer"], case.answer)["exact"])
            a["density"].append(q["info"].get("guided_density", 0.0))
    return {
        label: {
            "top1_agreement": a["top1"] / a["n"],
            "kl": a["kl"] / a["n"],
            "needle_acc": sum(a["exact"]) / len(a["exact"]),
            "native_needle_acc": sum(native_exact) / len(native_exact),
            "guided_density": statistics.mean(a["density"]),
            "contexts": len(a["exact"]),
        }
        for label, a in acc.items()
    }


# ---- the benchmark ----------------------------------------------------------------------------------


def bench(model, sender, receiver, lengths, repeats, out, options, command) -> Path:
    from ctxrelay import zoo

    if model:
        raise UsageError("bench mapflow-capture takes --sender/--receiver (a same-tokenizer pair), not --model")
    opts = bench_options("mapflow-capture", options, DEFAULTS)
    phases = [p for p in str(opts["phases"]).split(",") if p]
    bad = sorted(set(phases) - {"overhead", "quality", "operators"})
    if bad:
        raise UsageError(f"unknown mapflow-capture phase(s) {bad}: use overhead, quality, operators")
    if repeats < 3 and "overhead" in phases:
        raise UsageError("the overhead phase needs >= 3 interleaved pairs (--repeats 3): run-to-run noise is large")
    sender, receiver = sender or DEFAULT_SENDER, receiver or DEFAULT_RECEIVER
    art_path, art = load_artifact(opts, sender, receiver)
    command = command or bench_command("mapflow-capture", sender, receiver, lengths, repeats, options)
    rows: list[dict] = []
    extra = {"artifact": str(art_path), "options": opts, "notes": NOTES}

    def save(complete: bool) -> Path:
        merged, commands = _merged(out, rows, phases, command)
        return write_results(out, merged, command, extra=dict(extra, complete=complete, phase_commands=commands))

    snd: list = []

    def load_sender():
        if not snd:
            snd.append(zoo.load(sender))
        return snd[0]

    path = None
    if "overhead" in phases:
        m = load_sender()
        n = int(opts["overhead_tokens"])
        text = cases_for(m.tokenizer, n, 1, 0, int(opts["seed"]))[0].context
        res = overhead(m, art, text, repeats, opts)
        actual = int(tokenize_context(m, text)[0].numel())
        rows.append(
            {"transport": "mapflow", "phase": "overhead", "sender": sender, "context_tokens": n,
             "context_tokens_actual": actual, **res}
        )  # fmt: skip
        path = save(complete=phases == ["overhead"])
    if "quality" in phases or "operators" in phases:
        path = _per_length(art, sender, receiver, lengths, phases, opts, rows, load_sender, snd, save)
    if path is None:
        raise UsageError("nothing to run: give --set phases=overhead,quality,operators (or some of them)")
    return path


def _row_key(row: dict) -> tuple:
    source = row.get("source")
    if source is None and row.get("capture") == "sampled":  # overhead rows written before they named it
        source = f"sampled-{row.get('sample_rows')}"
    return row.get("phase"), row.get("context_tokens"), source


def _merged(out: str, rows: list[dict], phases: list[str], command: str) -> tuple[list[dict], dict]:
    """The results file's rows with this run's replacing those of the same (phase, length, source), and
    the command of each phase: the phases need different machine locks (timing alone, quality beside
    other work) and a source can be added later, so runs add to one file."""
    path = paths.results_path(out)
    doc = read_results(path) if path.exists() else {"rows": []}
    new = {_row_key(r) for r in rows}
    kept = [r for r in doc["rows"] if _row_key(r) not in new]
    commands = dict(doc.get("phase_commands", {}))
    for p in phases:
        seen = commands.get(p, [])
        seen = [seen] if isinstance(seen, str) else list(seen)
        commands[p] = seen if command in seen else [*seen, command]
    return kept + rows, commands


def _per_length(art, sender, receiver, lengths, phases, opts, rows, load_sender, snd, save) -> Path:
    from ctxrelay import zoo
    from ctxrelay.transports.mapflow.reuse import ReuseConfig

    if not lengths:
        raise UsageError("give the context lengths of the quality and operator phases (--lengths 2048,4096)")
    r = zoo.load(receiver)
    art.check(None, r)
    cfg = ReuseConfig.from_params(art.params, art.tensors)
    block, capture_p = cfg.block, float(art.params.get("capture_p", cfg.top_p))
    labels = _labels(opts["rows_list"]) if "quality" in phases else _labels(str(mapflow.SAMPLE_ROWS))
    cache = paths.work_dir("mapflow", "capture-states", Path(sender).name)
    path = None
    for n in lengths:
        cases = cases_for(r.tokenizer, n, int(opts["contexts"]), int(opts["continuation"]), int(opts["seed"]))
        if "quality" not in phases:
            cases = cases[:1]
        states = [
            source_states(load_sender, c.context, capture_p, block, cfg.sender_layers(), labels, cache)
            for c in tqdm(cases, desc=f"sender states @{n}")
        ]
        if snd:  # free the sender before the receiver runs
            snd.clear()
            gc.collect()
        if "quality" in phases:
            for label, q in quality(r, art, cases, states, opts).items():
                cap, k = labels[label]
                rows.append(
                    {"transport": "mapflow", "phase": "quality", "receiver": receiver, "context_tokens": n,
                     "source": label, "capture": cap, "sample_rows": k, **q}
                )  # fmt: skip
        if "operators" in phases:
            default = f"sampled-{mapflow.SAMPLE_ROWS}"
            for label in ("exact", default) if default in states[0] else ("exact",):
                res = guided_operator_times(states[0][label], cfg, r, int(opts["op_repeats"]))
                rows.append(
                    {"transport": "mapflow", "phase": "operators", "receiver": receiver, "context_tokens": n,
                     "source": label, **res}
                )  # fmt: skip
        path = save(complete=n == lengths[-1])
    return path
