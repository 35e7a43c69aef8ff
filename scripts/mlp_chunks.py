"""Native prefill with the MLP over chunks of rows (runner.mlp) against the whole prefill at once.

    python scripts/mlp_chunks.py TOKENS PAIRS MODEL [MODEL ...]

Random ids, 2 torch threads, one warm-up, then PAIRS interleaved pairs (order alternating); prints the
times, the medians' ratio and the largest logit difference. Run it alone (flock the timing lock).
"""

import gc
import statistics
import sys
import time

import torch

from ctxrelay import zoo
from ctxrelay.models import runner

WHOLE = 1 << 40  # MLP_CHUNK_ELEMS so large that no prefill is chunked


def main(tokens: int, pairs: int, models: list[str]) -> None:
    torch.set_num_threads(2)
    default = runner.MLP_CHUNK_ELEMS
    for name in models:
        m = zoo.load(name)
        ids = torch.randint(100, 20000, (tokens,), generator=torch.Generator().manual_seed(0))
        runner.forward(m, ids, logits="last")  # warm-up
        times: dict[str, list[float]] = {"whole": [], "chunked": []}
        logits = {}
        for k in range(pairs):
            for mode in ("whole", "chunked") if k % 2 == 0 else ("chunked", "whole"):
                runner.MLP_CHUNK_ELEMS = WHOLE if mode == "whole" else default
                t0 = time.perf_counter()
                logits[mode] = runner.forward(m, ids, logits="last").logits
                times[mode].append(round(time.perf_counter() - t0, 2))
        runner.MLP_CHUNK_ELEMS = default
        ratio = statistics.median(times["whole"]) / statistics.median(times["chunked"])
        diff = float((logits["whole"] - logits["chunked"]).abs().max())
        print(f"{name} {tokens} tokens: {times} speedup {ratio:.3f} max logit diff {diff:.2g}", flush=True)
        del m
        gc.collect()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
