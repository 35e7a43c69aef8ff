"""`ctxrelay demo`: one sender reads a long context and a question; three receivers answer from its state.

Per receiver the relay picks a transport (or native prefill) through the gate, and the demo runs the
receiver's own native prefill beside it in the same process, so every TTFT, speedup and answer
agreement in the table is measured, not predicted. The context is a held-out essay with a planted
fact (scored against its gold answer), or the user's own document (--context FILE --question TEXT).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ctxrelay.data.datasets import essay_haystack
from ctxrelay.data.needle import QUESTION_FORMAT, first_answer_line, make_needle_case, score_answer
from ctxrelay.errors import UsageError
from ctxrelay.metrics import next_token_kl, rouge_l, token_f1
from ctxrelay.models.tokens import context_ids
from ctxrelay.relay.api import ModelPool, RelayResult
from ctxrelay.relay.gate import DEFAULT_QUALITY
from ctxrelay.relay.profile import profile_pool
from ctxrelay.results import machine_facts, validate_rows

DEFAULT_SENDER = "qwen2.5-coder-1.5b"
DEFAULT_RECEIVERS = ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")
TIMING_COLUMNS = (
    "translate_s", "copy_s", "assemble_s", "select_s", "recompute_s", "rejected_relay_s", "first_token_s",
    "gate_s", "prefill_s",
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
    profile_lengths: tuple[int, ...] = field(default=())  # default: tokens/4, tokens/2, tokens

    def check(self, models: bool = True) -> None:
        """Refuse bad options before any model loads (a UsageError or ZooError names the option)."""
        from ctxrelay import zoo

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
    cfg: DemoConfig, console: Console, json_path: Path | None, command: str, pool: ModelPool | None = None
) -> list[dict]:
    """The demo on the zoo models (or on the models of a given pool: the tests use tiny ones)."""
    cfg.check(models=pool is None)
    console.rule("[bold]ctxrelay demo")
    if pool is None:
        pool = ModelPool(quality_threshold=cfg.quality_threshold)
        for name in (cfg.sender, *cfg.receivers):
            console.print(f"loading {name} ...")
            pool.add(name)
    for line in pool.graph.skipped:
        console.print(f"[yellow]artifact skipped:[/] {line}")
    sender = pool.model(cfg.sender)
    prompt, gold, what = demo_prompt(cfg, sender)
    n_prompt = len(context_ids(sender, prompt))
    lengths = list(cfg.profile_lengths) or sorted({max(64, n_prompt // 4), max(128, n_prompt // 2), n_prompt})
    missing = [m for m in pool.models.values() if m.spec.weights_hash not in pool.profile.native]
    # points with no usable cost: never measured, or measured with an artifact since replaced
    missing_edges = [p for e in pool.graph.edges if not e.exact for p in e.points if p.cost is None]
    if missing or missing_edges:
        console.print(f"measuring the cost model on this machine (once) at {lengths} tokens ...")
        profile_pool(pool, text_for, lengths, repeats=1, only_missing=True)
        pool.profile.save(pool.profile_path)

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
    if json_path is not None:
        validate_rows(rows)
        doc = {"command": command, "machine": machine_facts(), "rows": rows, "sender_prefill_s": sender_prefill_s,
               "sender_answer": first_answer_line(own.text), "gold": gold, "context": what,
               "quality_threshold": cfg.quality_threshold}  # fmt: skip
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"[green]written:[/] {json_path}")
    return rows


def _row(cfg: DemoConfig, state, receiver: str, native: RelayResult, relay: RelayResult, gold: str | None) -> dict:
    relay_line, native_line = first_answer_line(relay.text), first_answer_line(native.text)
    row = {
        "transport": relay.transport,
        "method": relay.info.get("method", relay.info.get("mode", relay.transport)),
        "sender": cfg.sender,
        "receiver": receiver,
        "context_tokens": relay.context_tokens,
        "sender_tokens": state.num_tokens,
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
    table = Table(title=title, show_lines=True, width=TABLE_WIDTH)
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
