"""GPU check of mapflow's Triton mix-and-apply kernel (transports/mapflow/triton_apply.py) on CUDA.

`scripts/gpu_check.sh` runs the kernel's tests, then this module (`python -m
ctxrelay_bench.mapflow_gpu.bench`, or `ctxrelay bench mapflow-gpu`), which writes mapflow-gpu.json to
$CTXRELAY_RESULTS_DIR (the script points it at $OUT): per context length, on sender-like random
maps at the qwen2.5-coder 1.5b -> 0.5b shapes (12 sender heads, 14 receiver heads, 2 kv heads,
head dim 64, blocks of 64), the kernel's largest difference from the torch operator
(apply.replace_attention on CPU in fp32: the reference) and the median times of the kernel, of the
torch operator on CUDA (torch's BSR product) and on CPU, and of dense causal SDPA on CUDA for scale.
Without CUDA or triton it writes one row saying so and returns: nothing fails on a CPU machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ctxrelay.results import write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.runs import bench_options

DEFAULTS = {"hs": 12, "hr": 14, "hkv": 2, "d": 64, "block": 64, "extra": 8, "seed": 0}
# `ctxrelay bench mapflow-gpu --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    DEFAULTS,
    {
        "hs": "sender heads",
        "hr": "receiver heads",
        "hkv": "receiver kv heads",
        "d": "head dim",
        "block": "map block size",
        "extra": "extra random blocks per row of the sender-like maps",
        "seed": "random seed of the maps",
    },
)
LENGTHS = (2048, 4096, 8192)
TOLERANCE = 2e-3  # the kernel's tl.dot may run in tf32 (the tests use the same bound)


def _cuda_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of `fn` on the GPU (synchronised around each call); warm-up compiles the kernel."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times), 3)


def _cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    from ctxrelay.timing import median_ms

    return round(median_ms(fn, repeats), 3)


def _torch_cuda_plan(plan):
    """The torch operator's plan on CUDA (torch's BSR @ dense on the GPU)."""
    from ctxrelay.transports.mapflow.apply import ReplacePlan

    return ReplacePlan(plan.bsr.to("cuda"), plan.inv_row_mass.to("cuda"), plan.heads, plan.block, plan.tokens)


def one_length(tokens: int, repeats: int, o: dict) -> dict:
    """Exactness and timings at one context length (see the module docstring)."""
    import torch.nn.functional as F

    from ctxrelay.transports.mapflow import apply, triton_apply
    from ctxrelay.transports.mapflow.synthetic import random_maps, simplex_w

    hs, hr, hkv, d, b = (int(o[k]) for k in ("hs", "hr", "hkv", "d", "block"))
    bm = random_maps(tokens, hs, b, int(o["extra"]), seed=int(o["seed"]))
    w = simplex_w(hs, hr, seed=int(o["seed"]))
    v = torch.randn(1, hkv, tokens, d, generator=torch.Generator().manual_seed(int(o["seed"])))
    plan = apply.prepare_replace(bm)
    ref = apply.replace_attention(plan, w, v)
    v_gpu = v.cuda()
    out = triton_apply.replace_attention_triton(bm, w, v_gpu).cpu()
    row = {
        "transport": "mapflow",
        "context_tokens": tokens,
        "sender_density": round(bm.density(), 4),
        "max_abs_diff": float((out - ref).abs().max()),
        "tolerance": TOLERANCE,
        "triton_ms": _cuda_ms(lambda: triton_apply.replace_attention_triton(bm, w, v_gpu), repeats),
        "torch_cpu_ms": _cpu_ms(lambda: apply.replace_attention(plan, w, v), repeats),
    }
    row["exact"] = row["max_abs_diff"] < TOLERANCE
    try:  # torch's BSR product on CUDA: a baseline, not required to exist in every build
        gplan, w_gpu = _torch_cuda_plan(plan), w.cuda()
        row["torch_cuda_ms"] = _cuda_ms(lambda: apply.replace_attention(gplan, w_gpu, v_gpu), repeats)
        row["torch_cuda_max_abs_diff"] = float((apply.replace_attention(gplan, w_gpu, v_gpu).cpu() - ref).abs().max())
    except (RuntimeError, NotImplementedError) as e:
        row["torch_cuda_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    q = torch.randn(1, hr, tokens, d, device="cuda")
    kk, vv = torch.randn(1, hkv, tokens, d, device="cuda"), torch.randn(1, hkv, tokens, d, device="cuda")
    row["sdpa_dense_ms"] = _cuda_ms(
        lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True), repeats
    )
    return row


def bench(model, sender, receiver, lengths, repeats, out, options, command) -> Path:
    from ctxrelay.transports.mapflow import triton_apply

    o = bench_options("mapflow-gpu", options, DEFAULTS)
    command = command or "python -m ctxrelay_bench.mapflow_gpu.bench"
    if not triton_apply.available():
        why = "no CUDA device" if not torch.cuda.is_available() else "triton is not installed"
        return write_results(out, [{"transport": "mapflow", "skipped": why}], command, extra={"options": o})
    rows = [one_length(n, max(1, repeats), o) for n in (lengths or LENGTHS)]
    return write_results(out, rows, command, extra={"options": o, "all_exact": all(r["exact"] for r in rows)})


def main(argv: list[str]) -> int:
    """`python -m ctxrelay_bench.mapflow_gpu.bench [LENGTHS] [REPEATS]`: exit 1 where the kernel is not exact."""
    import json

    lengths = [int(x) for x in argv[0].split(",")] if argv else list(LENGTHS)
    repeats = int(argv[1]) if len(argv) > 1 else 10
    command = "python -m ctxrelay_bench.mapflow_gpu.bench " + " ".join(argv)
    path = bench("", "", "", lengths, repeats, "mapflow-gpu", {}, command.strip())
    doc = json.loads(path.read_text())
    print(json.dumps(doc["rows"], indent=1))
    print(f"written: {path}")
    return 0 if doc.get("all_exact", True) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
