"""`ctxrelay bench heterofold`: receiver TTFT vs native prefill and quality vs native, per direction,
method and context length, on held-out essays and ShareGPT (calibration data and job: the transport's
calibration/job.py)."""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay.data.datasets import conversation_haystack, essay_haystack
from ctxrelay.data.needle import make_needle_case, score_answer
from ctxrelay.errors import UsageError
from ctxrelay.metrics import compare
from ctxrelay.results import write_results
from ctxrelay.timing import median_time
from ctxrelay.transports.base import TuningKey
from ctxrelay.transports.heterofold.calibration.job import calibrate_job, find_artifact
from ctxrelay_bench.heterofold.report import file_sha, plot, reusable_rows, summarize
from ctxrelay_bench.sender_states import cached_sender_states

DEMO_DIRECTIONS = (("qwen2.5-coder-1.5b", "smollm2-135m"), ("qwen2.5-coder-1.5b", "gemma3-270m"))
FAMILY_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
ALL_DIRECTIONS = tuple((s, r) for s in FAMILY_MODELS for r in FAMILY_MODELS if s != r) + DEMO_DIRECTIONS

# `--set` keys (`ctxrelay bench NAME --keys` prints them): name, default, meaning
TUNING_KEYS = [
    TuningKey("methods", "same-index,ridge+ta,recolor+ta,heterofold", "the calibration methods compared (comma list)"),
    TuningKey("datasets", "essays,sharegpt", "case sources (comma list of essays, sharegpt)"),
    TuningKey("continuation", 513, "teacher-forced continuation tokens (ppl@512 needs 513)"),
    TuningKey("answer_tokens", 16, "greedy needle-answer tokens (answers run to ~8; the first line is scored)"),
    TuningKey("warmup", 1, "untimed relays before the timed ones"),
    TuningKey("ref_tokenizer", "qwen2.5-coder-0.5b", "contexts are cut at its token counts (shared by all pairs)"),
    TuningKey("calibrate_missing", True, "calibrate a direction/method whose artifact is missing"),
    TuningKey("resume", True, "keep the rows of receivers an earlier run finished (same cases, artifacts, machine)"),
    TuningKey("seed", 0, "case seed"),
]
BENCH_DEFAULTS = {k.name: k.default for k in TUNING_KEYS}


@dataclass
class Case:
    dataset: str
    length: int  # nominal context length (tokens of the reference tokenizer)
    context: str  # the shared context, with a needle fact inserted
    continuation: str  # the true text that follows the context (teacher-forced, scored)
    question: str  # needle question suffix
    answer: str


def cut_at_tokens(tokenizer, text: str, n: int) -> tuple[str, str]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) <= n:
        raise UsageError(f"text holds only {len(enc['input_ids'])} tokens; need more than {n}")
    cut = enc["offset_mapping"][n - 1][1]
    return text[:cut], text[cut:]


def bench_cases(tokenizer, lengths, datasets, continuation: int, seed: int) -> list[Case]:
    """One case per (dataset, length): context cut at `length` tokens, needle at a depth that varies."""
    cases = []
    for li, n in enumerate(lengths):
        for di, ds in enumerate(datasets):
            want = n + continuation + 64
            if ds == "essays":
                full = essay_haystack(tokenizer, want, split="heldout", seed=seed + li)
            elif ds == "sharegpt":
                full = conversation_haystack(tokenizer, want, split="heldout", seed=seed + li)
            else:
                raise UsageError(f"unknown bench dataset {ds!r}: use essays and/or sharegpt")
            context, rest = cut_at_tokens(tokenizer, full, n)
            depth = (0.2, 0.5, 0.8)[(li + di) % 3]
            needle = make_needle_case(context, depth, seed=seed + 3 * li + di)
            cases.append(Case(ds, n, needle.context, rest, needle.question, needle.answer))
    return cases


def _directions(sender: str, receiver: str) -> list[tuple[str, str]]:
    if not sender and not receiver:
        return list(ALL_DIRECTIONS)
    ss = [s for s in sender.split(",") if s] or list(FAMILY_MODELS)
    rs = [r for r in receiver.split(",") if r] or list(FAMILY_MODELS)
    dirs = [(s, r) for s in ss for r in rs if s != r]
    if not dirs:
        raise UsageError("no sender -> receiver direction with two different models; check --sender/--receiver")
    return dirs


def _bench_options(options: dict | None) -> dict:
    opts = dict(BENCH_DEFAULTS)
    unknown = sorted(set(options or {}) - set(BENCH_DEFAULTS))
    if unknown:
        raise UsageError(f"unknown heterofold bench option(s) {unknown}; known: {sorted(BENCH_DEFAULTS)}")
    opts.update(options or {})
    bad = [
        m for m in str(opts["methods"]).split(",") if m not in ("same-index", "ridge+ta", "recolor+ta", "heterofold")
    ]
    if bad:
        raise UsageError(f"unknown heterofold method(s) {bad}")
    return opts


def _artifact(sender: str, receiver: str, method: str, opts: dict):
    from ctxrelay.artifact import Artifact
    from ctxrelay.transports import heterofold

    path = find_artifact(sender, receiver, method)
    if not path.exists():
        if not opts["calibrate_missing"]:
            raise UsageError(f"no {method} artifact at {path}; run ctxrelay calibrate --transport heterofold first")
        calibrate_job(sender, receiver, options={"method": method})
    return path, Artifact.load(path, transport=heterofold.TRANSPORT, version=heterofold.ARTIFACT_VERSION)


@dataclass
class NativeRef:
    ctx_ids: torch.Tensor
    cont_ids: torch.Tensor
    q_ids: torch.Tensor
    logprobs: torch.Tensor  # [n-1, V] native log-probs over the continuation
    answer: str
    ttft_s: float | None = None
    times_s: list | None = None


def _native_ref(r, case: Case, opts: dict) -> NativeRef:
    from ctxrelay.models import runner
    from ctxrelay.models.tokens import context_ids, suffix_ids

    ctx = context_ids(r, case.context)
    cont = suffix_ids(r, case.continuation)[: int(opts["continuation"])]
    q = suffix_ids(r, case.question)
    pre = runner.forward(r, ctx, logits="none")
    logits = runner.forward(r, cont, pre.cache.clone(), logits="all").logits[:-1]
    qo = runner.forward(r, q, pre.cache, logits="last")
    gen = runner.decode(r, qo.cache, qo.logits[-1], time.perf_counter(), int(opts["answer_tokens"]))
    return NativeRef(ctx, cont, q, torch.log_softmax(logits.float(), -1), gen.text)


def _relay_quality(r, state, art, ref: NativeRef, opts: dict) -> dict:
    from ctxrelay.models import runner
    from ctxrelay.transports.heterofold import relay_prefill
    from ctxrelay.transports.heterofold.calibration.heldout import HORIZONS

    out = relay_prefill(r, state, art, ref.cont_ids, logits="all")
    q = compare(ref.logprobs, out.logits[:-1], ref.cont_ids[1:], (*HORIZONS, 512))
    qo = relay_prefill(r, state, art, ref.q_ids)
    gen = runner.decode(r, qo.cache, qo.logits[-1], time.perf_counter(), int(opts["answer_tokens"]))
    q["answer"] = gen.text
    q["info"] = {k: v for k, v in out.info.items() if k != "first_token"}
    return q


def _relay_timing(r, state, art, ref: NativeRef, repeats: int, warmup: int) -> dict:
    from ctxrelay.transports.heterofold import relay_prefill

    outs = []

    def run():
        t0 = time.perf_counter()
        o = relay_prefill(r, state, art, ref.q_ids)
        outs.append((time.perf_counter() - t0, o.timings))

    median, times = median_time(run, repeats=repeats, warmup=warmup)
    timed = outs[warmup:]
    comp = {k: statistics.median(t[k] for _, t in timed) for k in timed[0][1]}
    gaps = [abs(wall - sum(t.values())) / wall for wall, t in timed]
    return {"relay_ttft_s": median, "relay_times_s": times, "timings": comp, "timing_gap_max": max(gaps)}


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (512, 1024, 2048, 4096),
    repeats: int = 3,
    out: str = "heterofold",
    options: dict | None = None,
    command: str = "",
) -> Path:
    """Every direction x method x length: receiver TTFT vs native prefill (same run), KL / top-1 vs
    native, perplexity at H, needle-QA, on held-out essays and ShareGPT -> benchmarks/results/OUT.json."""
    from ctxrelay import zoo
    from ctxrelay.state import ContextState
    from ctxrelay.transports.heterofold.calibration.text_cache import text_key
    from ctxrelay_bench.native.bench import native_ttft

    if model:
        raise UsageError("bench heterofold takes --sender/--receiver (comma lists; empty = all eight directions)")
    if not lengths or any(n < 16 for n in lengths) or repeats < 1:
        raise UsageError(f"lengths must be token counts >= 16 and repeats >= 1 (got {list(lengths)}, {repeats})")
    opts = _bench_options(options)
    resume = bool(opts.pop("resume"))  # how to run, not what is measured: not part of the options compared
    dirs = _directions(sender, receiver)
    methods = str(opts["methods"]).split(",")
    datasets = str(opts["datasets"]).split(",")
    command = command or f"ctxrelay bench heterofold --lengths {','.join(map(str, lengths))} --repeats {repeats}"
    ref_tok = zoo.tokenizer(opts["ref_tokenizer"])
    cases = bench_cases(ref_tok, sorted(lengths), datasets, int(opts["continuation"]), int(opts["seed"]))
    states = {s: cached_sender_states(s, [c.context for c in cases]) for s in dict.fromkeys(s for s, _ in dirs)}
    arts = {(s, r, m): _artifact(s, r, m, opts) for s, r in dirs for m in methods}
    art_sha = {key: file_sha(p) for key, (p, _) in arts.items()}
    extra = {"options": opts, "lengths": sorted(lengths), "repeats": repeats, "directions": [list(d) for d in dirs]}
    extra["cases"] = [{"dataset": c.dataset, "length": c.length, "context_sha": text_key(c.context)} for c in cases]
    rows: list[dict] = []
    path = None
    receivers = list(dict.fromkeys(r for _, r in dirs))
    reused = reusable_rows(out, extra, dirs, methods, art_sha) if resume else {}
    extra["reused"] = {r: info for r, (_, info) in reused.items()}
    total = len(cases) * sum(1 + len(methods) * sum(1 for _, r2 in dirs if r2 == r) for r in receivers)
    bar = tqdm(total=total, desc="heterofold bench", unit="run")
    for rname in receivers:
        if rname in reused:  # measured by an earlier run of this same bench (same cases, artifacts, machine)
            rows.extend(reused[rname][0])
            bar.update(len(reused[rname][0]))
            continue
        r = zoo.load(rname)
        senders = [s for s, r2 in dirs if r2 == rname]
        for ci, case in enumerate(cases):
            bar.set_postfix_str(f"native {rname} @ {case.length} {case.dataset}")
            ref = _native_ref(r, case, opts)
            timed = case.dataset == datasets[0]  # TTFT is content-independent: time on the first dataset
            if timed:
                ids = torch.cat([ref.ctx_ids, ref.q_ids])
                ref.ttft_s, ref.times_s = median_time(
                    functools.partial(native_ttft, r, ids), repeats, int(opts["warmup"])
                )
            nat_q = compare(ref.logprobs, ref.logprobs, ref.cont_ids[1:], (1, 16, 32, 128, 512))
            base = {"receiver": rname, "context_tokens": int(ref.ctx_ids.shape[0]), "length": case.length}
            base["dataset"] = case.dataset
            native_row = {"transport": "native", "method": "text-relay", **base, "native_ppl": nat_q["native_ppl"]}
            native_row["ppl"] = nat_q["native_ppl"]
            native_row["needle_acc"] = score_answer(ref.answer, case.answer)["exact"]
            native_row["answer"] = ref.answer
            if timed:
                native_row.update(native_ttft_s=ref.ttft_s, native_times_s=ref.times_s)
            rows.append(native_row)
            bar.update(1)
            for sname in senders:
                state = ContextState.load(states[sname][ci])
                for method in methods:
                    bar.set_postfix_str(f"{sname}->{rname} {method} @ {case.length} {case.dataset}")
                    apath, art = arts[(sname, rname, method)]
                    q = _relay_quality(r, state, art, ref, opts)
                    row = {"transport": "heterofold", "method": method, "sender": sname, **base}
                    row.update(
                        top1_agreement=q["top1_agreement"],
                        kl=q["kl"],
                        ppl=q["ppl"],
                        native_ppl=q["native_ppl"],
                        needle_acc=score_answer(q["answer"], case.answer)["exact"],
                        native_needle_acc=native_row["needle_acc"],
                        answer=q["answer"],
                        native_answer=ref.answer,
                        sender_tokens=state.num_tokens,
                        artifact=apath.name,
                        artifact_sha=art_sha[(sname, rname, method)],
                        calibrated_quality={
                            k: art.quality.get(k) for k in ("top1_agreement", "kl") if k in art.quality
                        },
                        **{
                            k: q["info"][k]
                            for k in ("pairing", "native_positions", "exact_boundaries", "char_mismatch")
                        },
                    )
                    if timed:
                        t = _relay_timing(r, state, art, ref, repeats, int(opts["warmup"]))
                        row.update(native_ttft_s=ref.ttft_s, **t, speedup=ref.ttft_s / t["relay_ttft_s"])
                    rows.append(row)
                    bar.update(1)
                del state
            path = write_results(out, rows, command, {**extra, "complete": False})
        del r
        gc.collect()
    bar.close()
    path = write_results(out, rows, command, {**extra, "complete": True, "summary": summarize(rows)})
    plot(rows, path)
    return path
