"""`ctxrelay bench heterofold-frontier`: heterofold's selective-recompute frontier.

Per direction and context length: needle cases (8 per length by default: every fact once, at depths
0.2 / 0.5 / 0.8, the question as written or paraphrased) in held-out essays, each also scored on its
true continuation (the essay text after the context, teacher-forced); and ShareGPT continuation
cases. Every point (selection rule, recompute fraction f) of the frontier, plus plain heterofold
(f = 0) and a native check (f = 1, first case of each length), runs on the same cases against the
receiver's own native prefill: needle answers (greedy, scored with score_answer), top-1 agreement,
KL and perplexity of the continuation, and the per-request signals the gate's estimate is fitted on.
TTFT (translate + select + recompute + suffix + first token) is timed against native prefill in the
same run on the first needle case of each length (its first case where it has none; native timed before
and after the points). The quality phase may share the machine; the timing phase must not (`--set
phase=timing` under the timing lock). Sender states and native references are cached; rows are written
as they come and a rerun with the same cases resumes (rows are kept by direction, case and point). A
new run warns where other results files measured the same requests in one of its directions.
`--set artifact=PATH` measures a work copy of one direction's artifact (a candidate not yet installed);
the file keeps its path and digest, and its report derives the gate replay with it.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths, tensorfile
from ctxrelay.data.datasets import conversation_haystack, essay_haystack
from ctxrelay.data.needle import make_needle_case, score_answer
from ctxrelay.errors import UsageError
from ctxrelay.metrics import compare
from ctxrelay.models import runner
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay.gate import DEFAULT_QUALITY, MIN_SPEEDUP
from ctxrelay.results import read_results, write_results
from ctxrelay.state import ContextState
from ctxrelay.timing import median_time
from ctxrelay.transports.base import TuningKey
from ctxrelay.transports.heterofold.calibration.text_cache import text_key
from ctxrelay.transports.heterofold.hiding import hide_code
from ctxrelay_bench.heterofold.bench import cut_at_tokens
from ctxrelay_bench.heterofold_frontier.report import (
    calibrated_points,
    estimate_check,
    gate_replay,
    measured_before,
    plot,
    reusable,
    summarize,
    tables,
)
from ctxrelay_bench.native.bench import native_ttft
from ctxrelay_bench.sender_states import cached_sender_states

DIRECTIONS = (
    ("qwen2.5-coder-1.5b", "smollm2-135m"),
    ("gemma3-270m", "smollm2-135m"),
    ("qwen2.5-coder-1.5b", "gemma3-270m"),
    ("smollm2-135m", "gemma3-270m"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    ("gemma3-270m", "qwen2.5-coder-0.5b"),
)
# `--set` keys (`ctxrelay bench NAME --keys` prints them): name, default, meaning
TUNING_KEYS = [
    TuningKey("rules", "deviation,lexical,embedding,recency,mix,adaptive", "selection rules measured (comma list)"),
    TuningKey("fractions", "0.05,0.1,0.2,0.3", "recompute fractions measured (comma list)"),
    TuningKey("exact_check", True, "f = 1 on the first case of each length: must equal native"),
    TuningKey("needles", 8, "needle cases per length"),
    TuningKey("sharegpt", 2, "ShareGPT continuation cases per length"),
    TuningKey("continuation", 129, "teacher-forced continuation tokens (ppl@128 needs 129)"),
    TuningKey("answer_tokens", 24, "greedy needle-answer tokens"),
    TuningKey("attend", "all", "what the recomputed tokens attend to"),
    TuningKey("hide", 0, "hide_translated: the question and answer skip translated entries in the first k layers "
              "(\"global\": the full-attention layers)"),
    TuningKey("warmup", 1, "untimed relays before the timed ones"),
    TuningKey("ref_tokenizer", "qwen2.5-coder-0.5b", "contexts are cut at this tokenizer's counts"),
    TuningKey("seed", 0, "case i draws its essay and fact from seed + i: seeds share cases (report.measured_before)"),
    TuningKey("resume", True, "keep rows an earlier run measured with the same cases"),
    TuningKey("phase", "both", "quality | timing (timing runs must have the machine to themselves) | both | report"),
    TuningKey("redo", "", "comma list of rules whose kept rows of this phase are measured again"),
    TuningKey("redo_datasets", "", "with redo: only rows of these datasets (needle, sharegpt; empty: all)"),
    TuningKey("artifact", "", "a work copy of the one direction's artifact, measured instead of the installed one"),
    TuningKey("dtype", "float32", "the receiver's compute, relay and native reference alike: float32 | bfloat16 "
              "(the relay's precision for a bf16 engine)"),
]
OPTIONS = {k.name: k.default for k in TUNING_KEYS}
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CASE_OPTIONS = ("needles", "sharegpt", "continuation", "answer_tokens", "attend", "hide", "ref_tokenizer", "seed")


@dataclass
class Case:
    kind: str  # "needle" (essay + fact + question, and the essay's continuation) | "sharegpt"
    length: int
    index: int
    context: str
    continuation: str
    question: str = ""
    answer: str = ""
    depth: float | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}-{self.length}-{self.index}"


def build_cases(tokenizer, lengths: Sequence[int], opts: dict) -> list[Case]:
    cases, seed, cont = [], int(opts["seed"]), int(opts["continuation"])
    for n in lengths:
        for i in range(int(opts["needles"])):
            full = essay_haystack(tokenizer, n + cont + 64, split="heldout", seed=seed + i + 3 * n)
            context, rest = cut_at_tokens(tokenizer, full, n - 24)  # room for the fact's ~20 tokens
            nc = make_needle_case(context, (0.2, 0.5, 0.8)[i % 3], seed=seed + i, paraphrase=i % 2 == 1)
            cases.append(Case("needle", n, i, nc.context, rest, nc.question, nc.answer, nc.depth))
        for j in range(int(opts["sharegpt"])):
            full = conversation_haystack(tokenizer, n + cont + 64, "heldout", seed + j + n)
            context, rest = cut_at_tokens(tokenizer, full, n)
            cases.append(Case("sharegpt", n, j, context, rest))
    return cases


def points(opts: dict) -> list[tuple[str, float]]:
    from ctxrelay.transports.heterofold.recompute.rules import RULES

    rules = [r for r in str(opts["rules"]).split(",") if r]
    bad = [r for r in rules if r not in RULES]
    if bad:
        raise UsageError(f"unknown recompute rule(s) {bad}; known: {', '.join(RULES)}")
    fracs = [float(f) for f in str(opts["fractions"]).split(",") if f]
    if any(not 0 < f < 1 for f in fracs):
        raise UsageError(f"fractions must lie in (0, 1), got {fracs}")
    return [("none", 0.0)] + [(r, f) for r in rules for f in fracs]


# ---- native references (cached: a native prefill at 4096 tokens is most of a case's cost) ---------


@dataclass
class NativeRef:
    ctx: torch.Tensor
    cont: torch.Tensor
    q: torch.Tensor
    logprobs: torch.Tensor  # [n-1, V] native log-probs predicting cont[1:]
    answer: str


def native_ref(r, case: Case, opts: dict) -> NativeRef:
    n, a = int(opts["continuation"]), int(opts["answer_tokens"])
    key = text_key(f"{case.context}\x00{case.question}\x00{case.continuation}")
    # a receiver computing in bf16 has references of its own
    precision = "" if r.dtype == torch.float32 else f"-{str(r.dtype).removeprefix('torch.')}"
    name = f"{key}-{n}-{a}-{r.spec.weights_hash[:10]}{precision}.st"
    path = paths.work_dir("heterofold", "frontier-native", r.name) / name
    ctx, cont = context_ids(r, case.context), suffix_ids(r, case.continuation)[:n]
    q = suffix_ids(r, case.question) if case.question else torch.zeros(0, dtype=torch.long)
    if path.exists():
        try:
            t, manifest = tensorfile.read(path)
            return NativeRef(ctx, cont, q, t["logprobs"].float(), manifest["answer"])
        except tensorfile.TensorFileError:
            path.unlink()
    pre = runner.forward(r, ctx, logits="none")
    logits = runner.forward(r, cont, pre.cache.clone(), logits="all").logits[:-1]
    answer = ""
    if q.numel():
        qo = runner.forward(r, q, pre.cache, logits="last")
        answer = runner.decode(r, qo.cache, qo.logits[-1], time.perf_counter(), a).text
    lp = torch.log_softmax(logits.float(), -1)
    tensorfile.write(path, {"logprobs": lp.half()}, {"kind": "frontier_native_ref", "answer": answer})
    return NativeRef(ctx, cont, q, lp.half().float(), answer)


# ---- one relayed point -------------------------------------------------------------------------


def relay_options(rule: str, f: float, opts: dict) -> dict:
    """relay_prefill's options for a point (plain translation, f = 0, hides nothing)."""
    hide = hide_code(opts["hide"]) if f else 0
    return {"recompute": f, "selection": rule if f else "mix", "attend": opts["attend"], "hide_translated": hide}


def hide_field(f: float, opts: dict) -> dict:
    """A row's hide_translated, where its point hid anything (the gate replay matches it to the point's)."""
    hide = relay_options("mix", f, opts)["hide_translated"]
    return {"hide_translated": hide} if hide else {}


def relay_point(r, state, art, ref: NativeRef, case: Case, rule: str, f: float, opts: dict) -> dict:
    from ctxrelay.transports.heterofold import relay_prefill

    kw = relay_options(rule, f, opts)
    t0 = time.perf_counter()
    # a continuation: no query; every signal, for the estimate check (time_point times what serving runs)
    out = relay_prefill(r, state, art, ref.cont, logits="all", query="", signals="all", **kw)
    row = compare(ref.logprobs, out.logits[:-1], ref.cont[1:], (1, 16, 32, 128))
    row["continuation_info"] = _signals(out.info)
    if case.question:
        qo = relay_prefill(r, state, art, ref.q, signals="all", **kw)
        gen = runner.decode(r, qo.cache, qo.logits[-1], time.perf_counter(), int(opts["answer_tokens"]))
        row.update(answer=gen.text, needle_acc=score_answer(gen.text, case.answer)["exact"])
        row["question_info"] = _signals(qo.info)
        row["recompute_fraction"] = qo.info.get("recompute_fraction", 0.0)
    else:
        row["recompute_fraction"] = out.info.get("recompute_fraction", 0.0)
    row["wall_s"] = time.perf_counter() - t0
    return row


def _signals(info: dict) -> dict:
    from ctxrelay.transports.heterofold.recompute.recompute_pass import SIGNALS

    keep = ("recompute_fraction", "requested_fraction", "recomputed", "sentences", "estimate", *SIGNALS)
    return {k: info[k] for k in (*keep, "first_token_p", "native_positions", "own_layers") if k in info}


def time_point(r, state, art, ref: NativeRef, rule: str, f: float, opts: dict, repeats: int) -> dict:
    from ctxrelay.transports.heterofold import relay_prefill

    kw = relay_options(rule, f, opts)
    outs = []

    def run():
        t0 = time.perf_counter()
        o = relay_prefill(r, state, art, ref.q, **kw)
        int(o.logits[-1].argmax())
        outs.append((time.perf_counter() - t0, o.timings))

    med, times = median_time(run, repeats, int(opts["warmup"]))
    timed = outs[int(opts["warmup"]) :]
    comps = {k: sorted(t[k] for _, t in timed)[len(timed) // 2] for k in timed[0][1]}
    gap = max(abs(w - sum(t.values())) / w for w, t in timed)
    return {"relay_ttft_s": med, "relay_times_s": times, "timings": comps, "timing_gap_max": gap}


# ---- the benchmark ----------------------------------------------------------------------------------


def ref_tokenizer(name: str):
    """The tokenizer whose counts cut every context (one set of texts shared by all directions)."""
    from ctxrelay import zoo

    return zoo.tokenizer(name)


def _directions(sender: str, receiver: str) -> list[tuple[str, str]]:
    if not sender and not receiver:
        return list(DIRECTIONS)
    ss = [s for s in sender.split(",") if s]
    rs = [r for r in receiver.split(",") if r]
    dirs = [(s, r) for s in ss or {d[0] for d in DIRECTIONS} for r in rs or {d[1] for d in DIRECTIONS} if s != r]
    if not dirs:
        raise UsageError("no sender -> receiver direction with two different models; check --sender/--receiver")
    return sorted(dirs)


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (2048, 4096),
    repeats: int = 3,
    out: str = "heterofold-frontier",
    options: dict | None = None,
    command: str = "",
) -> Path:
    from ctxrelay import zoo

    if model:
        raise UsageError("bench heterofold-frontier takes --sender/--receiver (comma lists; empty = the six)")
    unknown = sorted(set(options or {}) - set(OPTIONS))
    if unknown:
        raise UsageError(f"unknown heterofold-frontier option(s) {unknown}; known: {sorted(OPTIONS)}")
    if not lengths or any(n < 64 for n in lengths) or repeats < 1:
        raise UsageError(f"lengths must be token counts >= 64 and repeats >= 1 (got {list(lengths)}, {repeats})")
    opts = {**OPTIONS, **(options or {})}
    resume, phase = bool(opts.pop("resume")), str(opts.pop("phase"))
    redo = {r for r in str(opts.pop("redo")).split(",") if r}
    redo_sets = {d for d in str(opts.pop("redo_datasets")).split(",") if d}
    if redo_sets - {"needle", "sharegpt"}:
        raise UsageError(f"redo_datasets takes needle and/or sharegpt, not {sorted(redo_sets)}")
    if phase not in ("quality", "timing", "both", "report"):
        raise UsageError(f"phase must be quality, timing, both or report, not {phase!r}")
    if phase == "report":  # nothing measured: the rows already there, their tables (again) and plot
        return report(out)
    pts, dirs = points(opts), _directions(sender, receiver)
    work_path = str(opts.pop("artifact"))
    command = command or f"ctxrelay bench heterofold-frontier --lengths {','.join(map(str, lengths))}"
    cases = build_cases(ref_tokenizer(opts["ref_tokenizer"]), sorted(lengths), opts)
    work = work_artifact(work_path, dirs) if work_path else None
    arts = {tuple(dirs[0]): work} if work else {d: _artifact(*d) for d in dirs}
    case_opts = {k: opts[k] for k in CASE_OPTIONS if k != "hide" or hide_code(opts[k])}  # runs before hide: the same
    if opts["dtype"] not in COMPUTE_DTYPES:
        raise UsageError(f"dtype is one of {', '.join(COMPUTE_DTYPES)}, not {opts['dtype']!r}")
    if opts["dtype"] != "float32":  # fp32 runs before the key: the same
        case_opts["dtype"] = opts["dtype"]
    extra = {"options": case_opts, "lengths": sorted(lengths), "repeats": repeats}
    if work:  # rows of another artifact are not resumed into this file (reusable compares the options)
        case_opts["artifact"] = work.digest
        extra["artifact"] = str(Path(work_path).expanduser().resolve())
    extra["cases"] = [{"key": c.key, "context_sha": text_key(c.context), "depth": c.depth} for c in cases]

    def stale(x: dict) -> bool:  # a row of a rule to measure again: this run's phase, directions, datasets
        timing = x.get("kind") == "timing"
        if x["selection"] not in redo or (x["sender"], x["receiver"]) not in dirs:
            return False
        if redo_sets and (timing or x.get("dataset") not in redo_sets):
            return False
        return phase == "both" or timing == (phase == "timing")

    earlier = (reusable(out, extra) if resume else None) or {}
    if not earlier and phase != "timing":
        for line in measured_before(out, extra["cases"], dirs):
            tqdm.write(f"warning: {line}")
    rows = [x for x in earlier.get("rows", []) if not stale(x)]
    # one file gathers the runs of several directions and phases: every command that wrote rows in it
    commands = list(dict.fromkeys([*earlier.get("commands", []), command]))
    done = {_row_key(x) for x in rows}
    # each length's first needle case (its first case where it has none: a ShareGPT-only run is timed too)
    firsts = {c.length: c for c in reversed(cases)}
    firsts.update({c.length: c for c in reversed(cases) if c.kind == "needle"})
    # the timing phase reads only those cases: prefill only their states
    needed = cases if phase != "timing" else [c for c in cases if c in firsts.values()]
    paths_of = {s: cached_sender_states(s, [c.context for c in needed]) for s in dict.fromkeys(s for s, _ in dirs)}
    states = {s: {c.key: p for c, p in zip(needed, ps, strict=True)} for s, ps in paths_of.items()}
    exact = [("recency", 1.0)] if opts["exact_check"] else []
    quality_work = (phase != "timing") * (len(cases) * len(pts) + len(firsts) * len(exact))
    work = len(dirs) * (quality_work + (phase != "quality") * len(firsts) * len(pts))
    bar = tqdm(total=work, desc="heterofold frontier", unit="pt")
    path = None

    def save(complete: bool = False) -> Path:
        meta = {**extra, "points": [list(p) for p in pts + exact], "complete": complete, "commands": commands}
        return write_results(out, rows, command, {**meta, **derived(rows, arts, earlier)})

    for rname in dict.fromkeys(r for _, r in dirs):
        r = zoo.load(rname).in_dtype(COMPUTE_DTYPES[opts["dtype"]])
        senders = [s for s, r2 in dirs if r2 == rname]
        for case in cases if phase != "timing" else []:
            ref = native_ref(r, case, opts)
            base = {"receiver": rname, "dataset": case.kind, "length": case.length, "case": case.index,
                    "context_tokens": int(ref.ctx.numel())}  # fmt: skip
            for sname in senders:
                state = ContextState.load(states[sname][case.key])
                for rule, f in pts + (exact if case is firsts.get(case.length) else []):
                    bar.update(1)
                    if (sname, rname, case.key, rule, f) in done:
                        continue
                    bar.set_postfix_str(f"{sname}->{rname} {case.key} {rule}@{f}")
                    q = relay_point(r, state, arts[(sname, rname)], ref, case, rule, f, opts)
                    row = {"transport": "heterofold", "method": "heterofold", "sender": sname, **base,
                           "selection": rule, "f": f, **hide_field(f, opts), "case_key": case.key, **q,
                           "native_answer": ref.answer}  # fmt: skip
                    if case.question:
                        row["native_needle_acc"] = score_answer(ref.answer, case.answer)["exact"]
                    rows.append(row)
                    done.add(_row_key(row))
                path = save()
                del state
        for case in firsts.values() if phase != "quality" else []:
            ref = native_ref(r, case, opts)
            ids = torch.cat([ref.ctx, ref.q])
            for sname in senders:
                todo = [(rule, f) for rule, f in pts if ("timing", sname, rname, case.length, rule, f) not in done]
                if not todo:
                    bar.update(len(pts))
                    continue
                state = ContextState.load(states[sname][case.key])
                native_times = median_time(lambda ids=ids, m=r: native_ttft(m, ids), repeats, 1)[1]
                timed = []
                for rule, f in todo:
                    bar.set_postfix_str(f"timing {sname}->{rname} @ {case.length} {rule}@{f}")
                    timed.append((rule, f, time_point(r, state, arts[(sname, rname)], ref, rule, f, opts, repeats)))
                    bar.update(1)
                native_times += median_time(lambda ids=ids, m=r: native_ttft(m, ids), repeats, 1)[1]
                native_s = statistics.median(native_times)
                for rule, f, t in timed:
                    row = {"transport": "heterofold", "method": "heterofold", "kind": "timing", "sender": sname,
                           "receiver": rname, "length": case.length, "case_key": case.key, "selection": rule,
                           "f": f, **hide_field(f, opts), "context_tokens": int(ref.ctx.numel()),
                           "native_ttft_s": native_s, "native_times_s": native_times, **t,
                           "speedup": native_s / t["relay_ttft_s"]}  # fmt: skip
                    rows.append(row)
                    done.add(_row_key(row))
                path = save()
                del state
        del r
        gc.collect()
    bar.close()
    path = save(complete=True)
    plot(rows, path)
    print(tables(read_results(path)))
    return path


def derived(rows: list[dict], arts: dict, earlier: dict | None = None) -> dict:
    """What a results file says beside its rows: per-point summary, estimate check, gate replay.

    The estimate check, gate replay and calibrated points need each direction's artifact; a direction
    with rows but no artifact loaded here (a run of other directions, or an artifact not installed on
    this machine) keeps those entries from `earlier`, the file being rewritten, since its rows are
    unchanged. The pooled estimate rows cover the directions loaded here and say how many."""
    dirs = sorted({(x["sender"], x["receiver"]) for x in rows})
    views = {d: (a.params, a.quality) for d, a in arts.items()}  # what the gate reads of each artifact
    fresh = {
        "estimate_check": estimate_check(rows, {d: a.quality.get("estimate") for d, a in arts.items()}),
        "gate": gate_replay(rows, views, DEFAULT_QUALITY, MIN_SPEEDUP),
        "calibrated": calibrated_points(views, DEFAULT_QUALITY),
    }
    for x in fresh["estimate_check"]:
        if x["sender"] == "all":
            x["directions"] = sum(1 for a in arts.values() if a.quality.get("estimate"))
    carried = set(dirs) - set(arts)
    for key, items in fresh.items():
        kept = [x for x in (earlier or {}).get(key, []) if (x["sender"], x["receiver"]) in carried]
        items[:0] = kept
        items.sort(key=lambda x: (x["sender"] == "all", x["sender"], x["receiver"]))  # stable: keeps each order
    return {"directions": [list(d) for d in dirs], **fresh, "summary": summarize(rows)}


def report(out: str) -> Path:
    """Recompute the derived tables of a results file with this code and the installed artifacts
    (the rows stay as measured), print them and redraw the plot."""
    doc = read_results(out)
    dirs = sorted({(x["sender"], x["receiver"]) for x in doc["rows"]})
    if doc.get("artifact"):  # measured with a work artifact: derived with it, or kept as written
        arts = _measured_with(doc, dirs)
    else:
        arts = {d: _artifact(*d) for d in dirs if _artifact_path(*d).exists()}
    for d in dirs:
        if d not in arts:
            print(f"no artifact for {d[0]} -> {d[1]} here: its gate replay and estimate check stay as written")
    keep = {k: v for k, v in doc.items() if k not in ("rows", "command", "machine", "git_commit", "written")}
    # the rows' machine stays theirs: a later run resumes from them only on the same machine facts
    meta = {**keep, **derived(doc["rows"], arts, doc)}
    path = write_results(out, doc["rows"], doc["command"], meta, doc["machine"])
    print(tables(read_results(path)))
    return plot(doc["rows"], path)


def _artifact_path(sender: str, receiver: str) -> Path:
    from ctxrelay.transports.heterofold.calibration.job import find_artifact

    return find_artifact(sender, receiver)


def _artifact(sender: str, receiver: str):
    from ctxrelay.artifact import Artifact
    from ctxrelay.transports.heterofold import ARTIFACT_VERSION, TRANSPORT

    p = _artifact_path(sender, receiver)
    if not p.exists():
        raise UsageError(f"no heterofold artifact for {sender} -> {receiver} at {p}: run `ctxrelay calibrate` first")
    return Artifact.load(p, transport=TRANSPORT, version=ARTIFACT_VERSION)


def work_artifact(path: str, dirs: list[tuple[str, str]]):
    """`--set artifact=PATH`: a work copy of one direction's artifact (not installed; a candidate to ship),
    measured in that direction's place. The file keeps its path and payload digest."""
    from ctxrelay.artifact import Artifact
    from ctxrelay.transports.heterofold import ARTIFACT_VERSION, TRANSPORT

    if len(dirs) != 1:
        raise UsageError("--set artifact=PATH measures one direction: give one --sender and one --receiver")
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"no artifact file at {p} (--set artifact=PATH)")
    art = Artifact.load(p, transport=TRANSPORT, version=ARTIFACT_VERSION)
    pair = (art.sender.get("name"), art.receiver.get("name"))
    if pair != tuple(dirs[0]):
        raise UsageError(f"{p} is the artifact of {pair[0]} -> {pair[1]}, not of {dirs[0][0]} -> {dirs[0][1]}")
    return art


def _measured_with(doc: dict, dirs: list[tuple[str, str]]) -> dict:
    """The work artifact a results file was measured with, while it is there unchanged; else none."""
    if not Path(doc["artifact"]).exists():
        return {}
    art = work_artifact(doc["artifact"], dirs)
    if art.digest != doc["options"].get("artifact"):
        print(f"{doc['artifact']} changed since these rows were measured")
        return {}
    return {tuple(dirs[0]): art}


def _row_key(row: dict) -> tuple:
    if row.get("kind") == "timing":
        return "timing", row["sender"], row["receiver"], row["length"], row["selection"], row["f"]
    return row["sender"], row["receiver"], row["case_key"], row["selection"], row["f"]
