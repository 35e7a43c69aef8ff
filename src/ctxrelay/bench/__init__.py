"""Benchmarks, the demo and their plots: floor 5, on top of the relay layer and the transports.

Each benchmark is a module with `bench(model, sender, receiver, lengths, repeats, out, options,
command) -> Path` that writes benchmarks/results/OUT.json (+ a plot); `ctxrelay bench NAME` runs it.
"""

from __future__ import annotations

import importlib

from ctxrelay.errors import UsageError

BENCHES = {
    "native": "ctxrelay.bench.native",
    "mapflow": "ctxrelay.bench.mapflow",
    "mapflow-capture": "ctxrelay.bench.mapflow_capture",
    "mapflow-gpu": "ctxrelay.bench.mapflow_gpu",
    "heterofold": "ctxrelay.bench.heterofold",
    "heterofold-limits": "ctxrelay.bench.heterofold_limits",
    "decode": "ctxrelay.bench.decode",
    "heterofold-frontier": "ctxrelay.bench.heterofold_frontier",
    "load": "ctxrelay.bench.load",
    "router": "ctxrelay.bench.router",
    "reliability": "ctxrelay.bench.reliability",
    "agents": "ctxrelay.bench.agents",
    "cost-model": "ctxrelay.bench.cost_model",
}


def bench_module(name: str):
    if name not in BENCHES:
        raise UsageError(f"unknown benchmark {name!r}: use one of {', '.join(BENCHES)}")
    return importlib.import_module(BENCHES[name])
