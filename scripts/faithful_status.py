"""Issue 11's bar per direction and length, from the gate replays of the frontier runs named.

    python scripts/faithful_status.py [--all] heterofold-frontier heterofold-frontier-s2g3-seed500 ...

Prints one markdown table: the gate replay per direction and length (as `ctxrelay bench
heterofold-frontier --set phase=report` wrote it, with the artifacts installed then), what issue 11's bar
says of it (`ctxrelay.bench.faithful_bar`), and the run it comes from. Where several runs cover one
direction and length, the one written last speaks for it (`--all`: every run). No model runs.
"""

import sys

from ctxrelay.bench.frontier_report import GATE_HEADS, gate_row
from ctxrelay.bench.results import markdown_table, read_results, results_file


def main(args: list[str]) -> None:
    every = "--all" in args
    found = {}
    for name in [a for a in args if a != "--all"]:
        doc = read_results(results_file(name))
        if not doc.get("gate"):
            sys.exit(f"{name} has no gate replay: run `ctxrelay bench heterofold-frontier ... --set phase=report`")
        for x in doc["gate"]:
            key = (x["sender"], x["receiver"], x["length"]) + ((name,) if every else ())
            if key not in found or doc["written"] >= found[key][1]:
                found[key] = (x, doc["written"], name)
    rows = [[*gate_row(x), f"{name} ({written[:10]})"] for _, (x, written, name) in sorted(found.items())]
    print("\n".join(markdown_table([*GATE_HEADS, "run"], rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
