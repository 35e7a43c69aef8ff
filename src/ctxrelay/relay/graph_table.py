"""The transport graph as tables (`ctxrelay graph`, `ctxrelay calibrate`): model versions, calibrated edges,
their quality and predicted cost, and what was skipped."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_graph(console: Console, pool, tokens: int) -> None:
    g = pool.graph
    nodes = Table(title="nodes (model versions)")
    for col in ("model", "weights", "tokenizer", f"native prefill @ {tokens} (predicted)"):
        nodes.add_column(col)
    for n in g.nodes.values():
        cost = f"{n.native_cost.total(tokens):.2f} s" if n.native_cost else "not profiled"
        nodes.add_row(n.name, n.weights_hash[:12], n.tokenizer_hash[:12], cost)
    console.print(nodes)
    edges = Table(title=f"edges (calibrated transports), costs predicted at {tokens} tokens")
    rows = g.rows(tokens)
    for col in ("edge", "method", "top1", "kl", "relay s", "native s", "speedup", "artifact"):
        edges.add_column(col)
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)
    for r in rows:
        edges.add_row(
            r["edge"], str(r["method"]), fmt(r["top1_agreement"]), fmt(r["kl"], "{:.3f}"),
            fmt(r[f"relay_s@{tokens}"]), fmt(r[f"native_s@{tokens}"]), fmt(r["speedup"], "{:.1f}x"), r["artifact"],
        )  # fmt: skip
    console.print(edges)
    for line in g.skipped:
        console.print(f"[yellow]skipped:[/] {line}")
