"""Probe: every run of each edge point's relay, as `ctxrelay bench cost-model` times them (it reports a
median of 2 after one warm-up), to see how steady a point's time is from one call to the next.

    python scripts/cost_point_runs.py MODEL,MODEL[,...] TOKENS [RUNS]

Prints, per operating point of every non-exact edge among the models, each run's total seconds and its
translate_s. Run it alone (a timing run). Not written to benchmarks/results: it explains a row there.
"""

import sys

import torch

from ctxrelay import transports
from ctxrelay.bench.cost_model import validation_text
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.profile import _suffix, cached_sender_state, edge_models


def main() -> None:
    names, n = sys.argv[1].split(","), int(sys.argv[2])
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    torch.set_num_threads(2)
    pool = ModelPool(names)
    for e in [e for e in pool.graph.edges if not e.exact]:
        sender, receiver = edge_models(pool, e)
        art = pool.artifact(e.artifact_path)
        t = transports.get(e.transport)
        state = cached_sender_state(pool, sender, validation_text(sender, n))
        suffix = _suffix(receiver)
        for p in e.points:
            timings = [t.relay_prefill(receiver, state, art, suffix, **p.options).timings for _ in range(runs)]
            total = [round(sum(x.values()), 3) for x in timings]
            translate = [round(x.get("translate_s", 0.0), 3) for x in timings]
            print(f"{e.label} {p.label or 'plain'} @{n}: total {total} translate_s {translate}", flush=True)


if __name__ == "__main__":
    main()
