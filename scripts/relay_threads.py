"""Does the thread a relay runs on change its speed? The bf16 relay smollm2-135m -> gemma3-270m at ~4096 tokens
(f = 0.2, mix), in this process's main thread, then each in a fresh thread (as `ctxrelay serve` runs a turn: a
thread per request), then in the main thread again; seconds per relay (translate, recompute).

    flock ~/.cache/ctxrelay/timing.lock python scripts/relay_threads.py [--one-arena]

--one-arena: serve/compute.one_malloc_arena() first, as `ctxrelay serve` does.
"""

import sys
import threading
import time

import torch

from ctxrelay import transports
from ctxrelay.artifact import Artifact
from ctxrelay.data.datasets import essay_haystack
from ctxrelay.models.tokens import suffix_ids
from ctxrelay.relay.api import ModelPool


def main() -> None:
    if "--one-arena" in sys.argv:
        from ctxrelay.serve.compute import one_malloc_arena

        print("one malloc arena:", one_malloc_arena())
    torch.set_num_threads(2)
    pool = ModelPool(["smollm2-135m", "gemma3-270m"])
    s, r = pool.models["smollm2-135m"], pool.models["gemma3-270m"]
    rb = r.in_dtype(torch.bfloat16)
    art = Artifact.load(pool.graph.edges_between(s.spec.weights_hash, r.spec.weights_hash)[0].artifact_path)
    hf = transports.get("heterofold")
    states = [
        pool.prefill(s.name, essay_haystack(s.tokenizer, 4096 - 7 * i, split="heldout", seed=20 + i), "t", store=False)
        for i in range(4)
    ]
    suffix = suffix_ids(r, "\nQuestion: what is the capital?\nAnswer:")

    def run(state) -> tuple[float, float, float]:
        t = time.perf_counter()
        out = hf.relay_prefill(rb, state, art, suffix, recompute=0.2, selection="mix")
        took = time.perf_counter() - t
        return round(took, 3), round(out.timings["translate_s"], 3), round(out.timings["recompute_s"], 3)

    def fresh(state):
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("r", run(state)))
        th.start()
        th.join()
        return box["r"]

    run(states[0])  # warm-up
    print("main thread      ", [run(x) for x in states], flush=True)
    print("a fresh thread each", [fresh(x) for x in states], flush=True)
    print("main thread again", [run(x) for x in states], flush=True)


if __name__ == "__main__":
    main()
