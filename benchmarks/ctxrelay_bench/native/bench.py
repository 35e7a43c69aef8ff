"""Native baseline: time to first token of each model's own prefill, per context length.

`ctxrelay bench native --model all --lengths 512,1024,2048,4096` lands here (cli.py calls
`bench`). TTFT = one prefill of the pre-tokenised context through runner.forward with last-token
logits, plus the argmax that picks the first token. Contexts are held-out essays cut to exactly
the requested token count of each model's own tokenizer.
"""

from __future__ import annotations

import gc
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay.data.datasets import essay_haystack
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids
from ctxrelay.results import write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.plots import grouped, line_plot, plot_path
from ctxrelay_bench.runs import timed_run, wait_until_quiet

ZOO_ORDER = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")

# Options (`--set key=value`):
#   warmup=1        untimed prefills before the timed ones, per (model, length)
#   slow_s=0        if > 0: a point whose warm-up prefill took longer than slow_s seconds is timed
#                   only slow_repeats times (the row records the repeats actually run)
#   slow_repeats=1
#   split=heldout   essay split the contexts come from
#   seed=0          essay order rotation
#   quiet_wait_s=0  if > 0: before each point wait up to this long for other work to leave the
#                   cores idle (busy share <= quiet_busy); the row records the busy share seen
#   quiet_busy=0.25
#   retry_share=0   if > 0: re-measure a point (up to `retries` times) when a timed prefill got
#   retries=2       less than this share of its CPU threads (another job took the cores)
DEFAULTS = {
    "retry_share": 0.0,
    "retries": 2,
    "warmup": 1,
    "slow_s": 0.0,
    "slow_repeats": 1,
    "split": "heldout",
    "seed": 0,
    "quiet_wait_s": 0.0,
    "quiet_busy": 0.25,
}
# `ctxrelay bench native --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    DEFAULTS,
    {
        "retry_share": "> 0: measure a point again when a timed prefill got less than this share of its cores",
        "retries": "most re-measurements of a point",
        "warmup": "untimed prefills first",
        "slow_s": "> 0: a point whose warm-up took longer gets only slow_repeats timed prefills",
        "slow_repeats": "timed prefills of a slow point",
        "split": "essay split the contexts come from",
        "seed": "which essay the context is cut from",
        "quiet_wait_s": "> 0: wait up to this long for the machine to go quiet before each point",
        "quiet_busy": "the busy share counted as quiet",
    },
)


def model_names(model: str) -> list[str]:
    """'all' -> the four zoo models; else a comma-separated list of zoo names or model paths."""
    names = [m.strip() for m in model.split(",") if m.strip()]
    if not names:
        raise UsageError("bench native needs --model: a zoo name, a comma-separated list, or 'all'")
    return list(ZOO_ORDER) if names == ["all"] else names


def _options(options: dict | None) -> dict:
    opts = dict(DEFAULTS)
    unknown = set(options or {}) - set(DEFAULTS)
    if unknown:
        raise UsageError(f"unknown native bench option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    opts.update(options or {})
    return opts


def essay_ids(m: LoadedModel, n_tokens: int, split: str = "heldout", seed: int = 0) -> torch.Tensor:
    """Token ids (special tokens included) of an essay context of exactly n_tokens for this model."""
    return context_ids(m, essay_haystack(m.tokenizer, n_tokens, split=split, seed=seed))


def native_ttft(m: LoadedModel, ids: torch.Tensor) -> int:
    """One native prefill with last-token logits and the greedy first token (what TTFT times)."""
    out = runner.forward(m, ids, logits="last")
    return int(out.logits[-1].argmax())


def _attempt(run, repeats: int, opts: dict) -> dict:
    """Warm-up, then `repeats` timed prefills, each with the CPU share it got."""
    busy = None
    if opts["quiet_wait_s"]:
        busy = wait_until_quiet(float(opts["quiet_busy"]), float(opts["quiet_wait_s"]))
    warm = [timed_run(run)[0] for _ in range(int(opts["warmup"]))]
    n = repeats
    if opts["slow_s"] and warm and warm[-1] > float(opts["slow_s"]):
        n = min(repeats, int(opts["slow_repeats"]))
    runs = [timed_run(run) for _ in range(n)]
    return {"warm": warm, "times": [w for w, _ in runs], "shares": [c for _, c in runs], "busy": busy}


def measure_point(m: LoadedModel, n_tokens: int, repeats: int, opts: dict) -> dict:
    """Median native TTFT at one length. With retry_share > 0, a point where any timed prefill got
    less than that share of its cores (another job ran) is measured again, up to `retries` times;
    the attempt with the best worst-share is kept and the others are recorded as discarded."""
    ids = essay_ids(m, n_tokens, opts["split"], int(opts["seed"]))
    run = lambda: native_ttft(m, ids)
    attempts = [_attempt(run, repeats, opts)]
    while (
        float(opts["retry_share"]) > 0
        and min(attempts[-1]["shares"]) < float(opts["retry_share"])
        and len(attempts) <= int(opts["retries"])
    ):
        attempts.append(_attempt(run, repeats, opts))
    best = max(attempts, key=lambda a: min(a["shares"]))
    median = statistics.median(best["times"])
    row = {
        "transport": "native",
        "method": "prefill",
        "receiver": m.name,
        "context_tokens": int(ids.shape[0]),
        "native_ttft_s": median,
        "tokens_per_s": ids.shape[0] / median,
        "repeats": len(best["times"]),
        "times_s": best["times"],
        "warmup_s": best["warm"],
        # Other work on the shared machine perturbs timings: record how much CPU each timed
        # prefill actually got (~1 when it had its cores to itself).
        "cpu_share": best["shares"],
        "loadavg_1m": os.getloadavg()[0],
        "attempts": len(attempts),
    }
    if best["busy"] is not None:
        row["busy_before"] = best["busy"]
    discarded = [a["times"] for a in attempts if a is not best]
    if discarded:
        row["discarded_times_s"] = discarded
    return row


def plot(rows: list[dict], path: Path) -> Path:
    by_length = sorted(rows, key=lambda r: r["context_tokens"])
    return line_plot(
        path,
        grouped(by_length, lambda r: r["receiver"], "context_tokens", "native_ttft_s"),
        xlabel="context tokens",
        ylabel="native TTFT (s, median)",
        title=f"Native prefill TTFT ({torch.get_num_threads()} torch threads, CPU)",
        logx=True,
        logy=True,
    )


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (512, 1024, 2048, 4096),
    repeats: int = 3,
    out: str = "native",
    options: dict | None = None,
    command: str = "",
    models: Sequence[LoadedModel] | None = None,
) -> Path:
    """Median native TTFT per model and length -> benchmarks/results/OUT.json + OUT.png.

    `models` (already loaded, e.g. tiny test models) replaces loading by name. The results file is
    rewritten after every point, so an interrupted run keeps what it measured ("complete": false).
    """
    from ctxrelay import zoo

    opts = _options(options)
    if sender or receiver:
        raise UsageError("bench native times each model's own prefill: use --model, not --sender/--receiver")
    if not lengths or any(n < 1 for n in lengths):
        raise UsageError(f"lengths must be positive token counts, got {list(lengths)}")
    if repeats < 1:
        raise UsageError(f"repeats must be >= 1, got {repeats}")
    sources: list = list(models) if models is not None else model_names(model)
    command = command or f"ctxrelay bench native --model {model} --lengths {','.join(map(str, lengths))}"
    extra = {
        "options": opts,
        "lengths": list(lengths),
        "repeats_requested": repeats,
        "timing": "runner.forward(logits='last') + argmax on pre-tokenised held-out essay ids; median of repeats",
    }
    rows: list[dict] = []
    path = None
    points = len(sources) * len(lengths)
    with tqdm(total=points, desc="native TTFT", unit="point") as bar:
        for src in sources:
            m = src if isinstance(src, LoadedModel) else zoo.load(src)
            for n in sorted(lengths):
                bar.set_postfix_str(f"{m.name} @ {n}")
                rows.append(measure_point(m, n, repeats, opts))
                bar.update(1)
                path = write_results(out, rows, command, {**extra, "complete": len(rows) == points})
            del m
            gc.collect()  # free one model's weights before the next loads (the 1.5B is ~7 GB)
    plot(rows, plot_path(path))
    return path
