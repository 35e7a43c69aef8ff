"""`ctxrelay bench agents`: a planner -> executor -> checkers workflow over one shared document, every
agent prefilling it natively against agents that relay it from the planner's state.

The workflow (the universal layer's C -> M1 -> M2 -> M3): a held-out essay with a planted fact and a
question about it is the shared context. The planner (qwen2.5-coder-1.5b) writes a plan; the executor
(qwen2.5-coder-0.5b) answers following the plan; each checker (smollm2-135m, gemma3-270m) reads the
plan and the answer and gives the answer it finds supported. Each agent's prompt is the shared
document (in the transcript form every model reads the same, serve/chat.py) followed by its own turn
in its own chat template, which carries the earlier agents' outputs (a few dozen tokens).

  native  every agent prefills document + its turn itself
  relay   the planner prefills the document once, leaving its state (the pool's capture, whatever its
          edges need), and continues from its own K/V; every later agent continues from that state
          through the gate (`pool.continue_from`, at each quality threshold) and prefills only its turn

Latency of a round = the agent's TTFT + its decode; the relay's planner round includes the state
capture. End to end = the sum of the rounds (the agents run one after another). Answers are greedy
and compared with the all-native run of the same case (same text) and with the gold answer. The
planner round is the same computation for every threshold, so it is run once per case and mode.
Timing: warm-up first, torch threads fixed, native and relay interleaved per case (the order
alternates), run under the exclusive timing lock; cases differ in document, fact, depth and wording.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay.data.datasets import essay_haystack
from ctxrelay.data.needle import first_answer_line, make_needle_case, score_answer
from ctxrelay.errors import UsageError
from ctxrelay.paths import repo_root, results_path
from ctxrelay.relay.api import ModelPool, RelayResult
from ctxrelay.results import git_commit, machine_facts, write_results
from ctxrelay.serve.chat import render, transcript
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.plots import plot_path, save_figure
from ctxrelay_bench.runs import bench_options

OPTIONS = {"planner": "qwen2.5-coder-1.5b", "executor": "qwen2.5-coder-0.5b", "checkers": "smollm2-135m,gemma3-270m",
           "plan_tokens": 48, "answer_tokens": 32, "check_tokens": 32, "thresholds": "0.85,0.75",
           "tenant": "agents"}  # fmt: skip
# `ctxrelay bench agents --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "planner": "the model that reads the document first and writes the plan",
        "executor": "the model that answers from the planner's state",
        "checkers": "models that check the answer (comma list)",
        "plan_tokens": "tokens the planner generates",
        "answer_tokens": "tokens the executor generates",
        "check_tokens": "tokens each checker generates",
        "thresholds": "the gate's quality thresholds compared (comma list)",
        "tenant": "the store tenant the agents' states live under",
    },
)
DEPTHS = (0.2, 0.5, 0.8)
PLANNER_TURN = (
    "You are the planner in a team of agents that share the document above. Question: {question}\n"
    "Write a short plan for the executor: where in the document to look and what to extract."
)
EXECUTOR_TURN = (
    "The planner wrote:\n{plan}\n\nYou are the executor. Following the plan, answer the question from the "
    "document in one line.\nQuestion: {question}"
)
CHECKER_TURN = (
    "The planner wrote:\n{plan}\n\nThe executor answered:\n{answer}\n\nYou are the checker. Check the answer "
    "against the document and reply in one line with the answer the document supports.\nQuestion: {question}"
)


@dataclass(frozen=True)
class Task:
    length: int  # planner tokens of the essay
    case: int
    context: str  # the shared document, transcript form
    question: str
    gold: str
    depth: float


def build_task(tokenizer, length: int, case: int) -> Task:
    """Held-out essay of `length` planner tokens, fact `case` at one of three depths, wording varied."""
    haystack = essay_haystack(tokenizer, length, "heldout", seed=case)
    nc = make_needle_case(haystack, DEPTHS[case % len(DEPTHS)], seed=case, paraphrase=bool(case % 2))
    question = nc.needle.paraphrase if case % 2 else nc.needle.question
    return Task(length, case, transcript([{"role": "user", "content": nc.context}]), question, nc.answer, nc.depth)


def turn(pool: ModelPool, model: str, template: str, **fields: str) -> str:
    """The agent's own turn after the shared document, in its chat template."""
    return render(pool.model(model), [{"role": "user", "content": template.format(**fields)}], after_context=True)


def round_row(task: Task, mode: str, agent: str, model: str, res: RelayResult, extra_s: float = 0.0) -> dict:
    line = first_answer_line(res.text)
    return {
        "length": task.length, "case": task.case, "mode": mode, "agent": agent, "model": model,
        "transport": res.transport, "reason": res.reason, "context_tokens": res.context_tokens,
        "ttft_s": res.ttft_s + extra_s, "latency_s": res.total_s + extra_s, "capture_s": extra_s,
        "timings": res.timings, "answer": line, "text": res.text, "tokens": res.tokens,
        "correct": score_answer(res.text, task.gold)["exact"],
    }  # fmt: skip


def run_workflow(pool: ModelPool, task: Task, opts: dict, thresholds: list[float], native_first: bool) -> list[dict]:
    """One case: the all-native workflow and the relayed one at each threshold (rows per round)."""
    planner, executor = str(opts["planner"]), str(opts["executor"])
    checkers = [c for c in str(opts["checkers"]).split(",") if c]
    gen = {"plan": int(opts["plan_tokens"]), "answer": int(opts["answer_tokens"]), "check": int(opts["check_tokens"])}
    q = task.question

    def later_rounds(mode: str, plan: str, go) -> list[dict]:
        ex = go(executor, turn(pool, executor, EXECUTOR_TURN, plan=plan, question=q), gen["answer"])
        rows = [round_row(task, mode, "executor", executor, ex)]
        answer = first_answer_line(ex.text)
        for c in checkers:
            res = go(c, turn(pool, c, CHECKER_TURN, plan=plan, answer=answer, question=q), gen["check"])
            rows.append(round_row(task, mode, f"checker:{c}", c, res))
        return rows

    def native() -> list[dict]:
        def go(model: str, suffix: str, n: int) -> RelayResult:
            return pool.native(model, task.context, suffix, max_new_tokens=n)

        res = go(planner, turn(pool, planner, PLANNER_TURN, question=q), gen["plan"])
        return [round_row(task, "native", "planner", planner, res), *later_rounds("native", res.text.strip(), go)]

    def relayed() -> list[dict]:
        state = pool.prefill(planner, task.context, str(opts["tenant"]), store=False)
        res = pool.continue_from(state, planner, turn(pool, planner, PLANNER_TURN, question=q),
                                 max_new_tokens=gen["plan"])  # fmt: skip
        rows = []
        for th in thresholds:
            mode = f"relay@{th:g}"

            def go(model: str, suffix: str, n: int, th=th) -> RelayResult:
                return pool.continue_from(state, model, suffix, max_new_tokens=n, quality_threshold=th)

            rows += [round_row(task, mode, "planner", planner, res, state.meta["prefill_s"]),
                     *later_rounds(mode, res.text.strip(), go)]  # fmt: skip
        return rows

    if native_first:
        nat = native()
        rel = relayed()
    else:
        rel = relayed()
        nat = native()
    rows = nat + rel
    by_agent = {r["agent"]: r for r in rows if r["mode"] == "native"}
    for r in rows:
        ref = by_agent[r["agent"]]
        r["same_as_native"] = r["tokens"] == ref["tokens"]
        r["same_answer_line"] = r["answer"].strip().lower() == ref["answer"].strip().lower()
        r["correct_native"] = ref["correct"]
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per length and mode: median per-round latency over cases, end to end, and answer agreement."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        cases = sorted({r["case"] for r in at})
        e2e = {m: [sum(r["latency_s"] for r in at if r["mode"] == m and r["case"] == c) for c in cases]
               for m in dict.fromkeys(r["mode"] for r in at)}  # fmt: skip
        for mode, totals in e2e.items():
            mine = [r for r in at if r["mode"] == mode]
            agents = list(dict.fromkeys(r["agent"] for r in mine))
            ratios = [n / t for n, t in zip(e2e["native"], totals, strict=True)]
            out.append({
                "length": length, "mode": mode, "transport": "+".join(sorted({r["transport"] for r in mine})),
                "cases": len(cases), "end_to_end_s": statistics.median(totals),
                "speedup_end_to_end": statistics.median(ratios),
                "rounds": {a: {"latency_s": statistics.median(r["latency_s"] for r in mine if r["agent"] == a),
                               "ttft_s": statistics.median(r["ttft_s"] for r in mine if r["agent"] == a),
                               "transports": sorted({r["transport"] for r in mine if r["agent"] == a}),
                               "same_as_native": sum(r["same_as_native"] for r in mine if r["agent"] == a),
                               "same_answer_line": sum(r["same_answer_line"] for r in mine if r["agent"] == a),
                               "correct": sum(r["correct"] for r in mine if r["agent"] == a),
                               "correct_native": sum(r["correct_native"] for r in mine if r["agent"] == a)}
                           for a in agents},
            })  # fmt: skip
    return out


def plot(summ: list[dict], path: Path) -> Path:
    """Stacked per-round latency (median over cases), one bar per mode, grouped by length."""
    import matplotlib.pyplot as plt

    lengths = sorted({s["length"] for s in summ})
    modes = list(dict.fromkeys(s["mode"] for s in summ))
    agents = list(summ[0]["rounds"])
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=120)
    width = 0.8 / len(modes)
    colors = plt.get_cmap("tab10")
    for j, mode in enumerate(modes):
        for i, length in enumerate(lengths):
            s = next(x for x in summ if x["length"] == length and x["mode"] == mode)
            bottom = 0.0
            for k, a in enumerate(agents):
                h = s["rounds"][a]["latency_s"]
                ax.bar(i + j * width, h, width * 0.95, bottom=bottom, color=colors(k), alpha=1.0 - 0.25 * j,
                       label=a if (i, j) == (0, 0) else None)  # fmt: skip
                bottom += h
            ax.text(i + j * width, bottom, f"{mode}\n{s['speedup_end_to_end']:.2f}x", ha="center", va="bottom",
                    fontsize=6)  # fmt: skip
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(lengths))], [f"{n}" for n in lengths])
    ax.set(xlabel="shared document (planner tokens)", ylabel="latency (s), median over cases",
           title="planner -> executor -> checkers: native vs relayed document")  # fmt: skip
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def _resume(out: str, opts: dict) -> list[dict]:
    """Rows of an earlier run with the same options, machine and code (cases are then skipped)."""
    path = results_path(out)
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    root = repo_root()
    same = (doc.get("options") == opts and doc.get("machine", {}).get("cpu_model") == machine_facts()["cpu_model"]
            and doc.get("git_commit") == (git_commit(root) if root else None))  # fmt: skip
    return doc.get("round_rows", []) if same else []


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (1024, 2048, 4096),
    repeats: int = 3,
    out: str = "agents",
    options: dict | None = None,
    command: str = "",
) -> Path:
    """Warm up, then per length `repeats` cases, each the native and the relayed workflow once ->
    OUT.json + OUT.png (resumable: cases an earlier run with the same options wrote are kept)."""
    opts = bench_options("agents", options, OPTIONS)
    if model or sender or receiver:
        raise UsageError("bench agents takes its models as --set planner=... --set executor=... --set checkers=a,b")
    if repeats < 1:
        raise UsageError(f"--repeats is the number of cases per length (each runs both workflows once), not {repeats}")
    thresholds = [float(x) for x in str(opts["thresholds"]).split(",") if x]
    command = command or "ctxrelay bench agents --lengths " + ",".join(map(str, lengths))
    names = [str(opts["planner"]), str(opts["executor"]), *[c for c in str(opts["checkers"]).split(",") if c]]
    pool = ModelPool(names)
    missing = [n for n in names if pool.model(n).spec.weights_hash not in pool.profile.native]
    if missing:
        raise UsageError(f"no cost model for {missing} on this machine: run `ctxrelay profile` (or the demo) first")
    planner_tok = pool.model(names[0]).tokenizer
    warm = build_task(planner_tok, 256, 0)
    for n in names:  # first calls pay one-time allocation costs
        pool.native(n, warm.context, "", max_new_tokens=2)
    rows = _resume(out, opts)
    done = {(r["length"], r["case"]) for r in rows}
    todo = [(n, c) for n in lengths for c in range(repeats) if (n, c) not in done]
    for n, c in tqdm(todo, desc="agents", unit="case"):
        task = build_task(planner_tok, n, c)
        rows += run_workflow(pool, task, opts, thresholds, native_first=c % 2 == 0)
        summ = summary(rows)
        extra = {"options": opts, "threads": torch.get_num_threads(), "round_rows": rows}
        path = write_results(out, summ, command, extra)
    path = results_path(out)
    if not path.exists():
        raise UsageError(f"nothing to run: {out}.json already holds every case; delete it to measure again")
    plot(summary(rows), plot_path(path))
    return path
