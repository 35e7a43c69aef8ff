"""`ctxrelay demo`: one sender reads a long essay and a question; three receivers answer from its state.

Per receiver the relay picks a transport (or native prefill) through the gate, and the demo runs the
receiver's own native prefill beside it in the same process, so every TTFT, speedup and answer
agreement in the table is measured, not predicted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ctxrelay.bench.results import machine_facts, validate_rows
from ctxrelay.data.datasets import essay_haystack
from ctxrelay.data.needle import first_answer_line, make_needle_case, score_answer
from ctxrelay.metrics import next_token_kl, rouge_l, token_f1
from ctxrelay.relay.api import ModelPool, RelayResult
from ctxrelay.relay.profile import profile_pool

DEFAULT_SENDER = "qwen2.5-coder-1.5b"
DEFAULT_RECEIVERS = ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")
TIMING_COLUMNS = ("translate_s", "copy_s", "assemble_s", "first_token_s", "gate_s", "prefill_s")


@dataclass
class DemoConfig:
    sender: str = DEFAULT_SENDER
    receivers: tuple[str, ...] = DEFAULT_RECEIVERS
    tokens: int = 1024  # sender tokens of essay context
    depth: float = 0.5
    seed: int = 0
    max_new_tokens: int = 16
    tenant: str = "demo"
    quality_threshold: float = 0.0
    profile_lengths: tuple[int, ...] = field(default=())  # default: tokens/4, tokens/2, tokens


def text_for(model, n: int) -> str:
    """Profile texts: training-split essays (never the demo's held-out haystack)."""
    return essay_haystack(model.tokenizer, n, split="train", seed=1)


def run_demo(cfg: DemoConfig, console: Console, json_path: Path | None, command: str) -> list[dict]:
    console.rule("[bold]ctxrelay demo")
    pool = ModelPool(quality_threshold=cfg.quality_threshold)
    for name in (cfg.sender, *cfg.receivers):
        console.print(f"loading {name} ...")
        pool.add(name)
    for line in pool.graph.skipped:
        console.print(f"[yellow]artifact skipped:[/] {line}")

    lengths = list(cfg.profile_lengths) or [max(64, cfg.tokens // 4), max(128, cfg.tokens // 2), cfg.tokens]
    missing = [m for m in pool.models.values() if m.spec.weights_hash not in pool.profile.native]
    missing_edges = [e for e in pool.graph.edges if not e.exact and e.key not in pool.profile.edges]
    if missing or missing_edges:
        console.print(f"measuring the cost model on this machine (once) at {lengths} tokens ...")
        profile_pool(pool, text_for, lengths, repeats=1, only_missing=True)
        pool.profile.save(pool.profile_path)

    sender = pool.model(cfg.sender)
    case = make_needle_case(essay_haystack(sender.tokenizer, cfg.tokens, "heldout", cfg.seed), cfg.depth, cfg.seed)
    prompt = case.prompt
    console.print(f"context: {cfg.tokens}-token held-out essay excerpt, fact at depth {case.depth:.2f}")
    console.print(f"question: {case.needle.question}   (gold: {case.answer})")

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
        rows.append(_row(cfg, state, name, native, relay, case))

    _print_table(console, rows, own, case.answer)
    if json_path is not None:
        validate_rows(rows)
        doc = {"command": command, "machine": machine_facts(), "rows": rows, "sender_prefill_s": sender_prefill_s,
               "sender_answer": first_answer_line(own.text), "gold": case.answer}  # fmt: skip
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"[green]written:[/] {json_path}")
    return rows


def _row(cfg: DemoConfig, state, receiver: str, native: RelayResult, relay: RelayResult, case) -> dict:
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
        "needle_acc": score_answer(relay.text, case.answer)["exact"],
        "native_needle_acc": score_answer(native.text, case.answer)["exact"],
        "components_s": relay.components_s,
    }
    for k in TIMING_COLUMNS:
        if k in relay.timings:
            row[k] = relay.timings[k]
    if relay.first_logits is not None and native.first_logits is not None:
        row["first_token_kl"] = next_token_kl(native.first_logits, relay.first_logits)
    return row


def _print_table(console: Console, rows: list[dict], own: RelayResult, gold: str) -> None:
    table = Table(title=f"receivers answering from the sender's state (gold answer: {gold})", show_lines=True)
    for col in ("receiver", "transport", "TTFT", "native TTFT", "speedup", "answer (relay)", "answer (native)",
                "agrees", "why"):  # fmt: skip
        table.add_column(col, overflow="fold")
    for r in rows:
        agree = "yes" if r["answer"] == r["native_answer"] else f"F1 {r['answer_token_f1']:.2f}"
        parts = ", ".join(f"{k[:-2]} {r[k]:.2f}" for k in TIMING_COLUMNS if k in r)
        table.add_row(
            r["receiver"],
            r["transport"],
            f"{r['relay_ttft_s']:.2f} s\n({parts})",
            f"{r['native_ttft_s']:.2f} s",
            f"{r['speedup']:.1f}x",
            r["answer"],
            r["native_answer"],
            agree,
            r["reason"],
        )
    console.print(table)
