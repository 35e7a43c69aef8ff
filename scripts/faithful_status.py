"""The faithful relay's targets per direction and length, from the gate replays of the frontier runs named.

    python scripts/faithful_status.py [--all] heterofold-frontier heterofold-frontier-s2g3-seed500 ...

Prints one markdown table: the gate replay per direction and length (as `ctxrelay bench
heterofold-frontier --set phase=report` wrote it, with the artifacts installed then), what the targets
say of it (`ctxrelay_bench.heterofold_frontier.targets`), and the run it comes from. Where several runs cover one
direction and length, the one written last speaks for it (`--all`: every run). No model runs.
"""

import sys

from ctxrelay.results import read_results, results_file
from ctxrelay_bench.heterofold_frontier.report import GATE_HEADS, gate_row
from ctxrelay_bench.heterofold_frontier.targets import newest
from ctxrelay_bench.runs import markdown_table


def main(args: list[str]) -> None:
    runs = [(name, read_results(results_file(name))) for name in args if name != "--all"]
    for name, doc in runs:
        if not doc.get("gate"):
            sys.exit(f"{name} has no gate replay: run `ctxrelay bench heterofold-frontier ... --set phase=report`")
    written = {name: doc["written"][:10] for name, doc in runs}
    rows = [[*gate_row(x), f"{name} ({written[name]})"] for x, name in newest(runs, every="--all" in args)]
    print("\n".join(markdown_table([*GATE_HEADS, "run"], rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
