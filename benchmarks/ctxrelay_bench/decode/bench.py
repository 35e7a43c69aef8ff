"""`ctxrelay bench decode`: greedy decoding speed after a long context, the preallocated KV cache
against the concatenating cache it replaced (kept here only, as the baseline).

Per model and context length: one native prefill of a held-out essay, then `new_tokens` greedy
tokens decoded from a copy of that cache with each cache kind, interleaved per repeat (after a
warm-up of each), median tokens/s. Both kinds must decode the same tokens.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel
from ctxrelay.results import write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.native.bench import essay_ids, model_names
from ctxrelay_bench.plots import line_plot, plot_path
from ctxrelay_bench.runs import bench_options, timed_run

OPTIONS = {"new_tokens": 128, "warmup": 1, "seed": 0}
# `ctxrelay bench decode --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "new_tokens": "tokens decoded per timed run",
        "warmup": "untimed decodes of each cache kind first",
        "seed": "which held-out essay the context is cut from",
    },
)


class ConcatCache(KVCache):
    """The cache before preallocation: every appended token concatenates a new copy of each layer."""

    def reserve(self, n: int) -> None:
        pass

    def write(self, layer, where, k, v) -> None:
        if not isinstance(where, slice) or where.start != self._k[layer].shape[2]:
            raise UsageError("the concatenating cache only appends")
        self._k[layer] = torch.cat([self._k[layer], k], dim=2)
        self._v[layer] = torch.cat([self._v[layer], v], dim=2)


def _decode(m: LoadedModel, cache: KVCache, logits: torch.Tensor, n: int) -> list[int]:
    return runner.decode(m, cache, logits, time.perf_counter(), n, stop_at_eos=False).tokens


def measure(m: LoadedModel, n_ctx: int, repeats: int, opts: dict) -> list[dict]:
    ids = essay_ids(m, n_ctx, "heldout", int(opts["seed"]))
    pre = runner.forward(m, ids)
    first, n = pre.logits[-1], int(opts["new_tokens"])
    kinds = {
        "concat": lambda: ConcatCache([k.clone() for k in pre.cache.keys], [v.clone() for v in pre.cache.values]),
        "preallocated": lambda: pre.cache.clone(),
    }
    outputs: dict[str, list[int]] = {}
    for kind, make in kinds.items():  # warm-up, and the tokens each kind decodes
        for _ in range(int(opts["warmup"])):
            outputs[kind] = _decode(m, make(), first, n)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    shares: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for kind, make in kinds.items():
            cache = make()
            wall, share = timed_run(lambda cache=cache: _decode(m, cache, first, n))
            times[kind].append(wall)
            shares[kind].append(share)
    same = outputs["concat"] == outputs["preallocated"]
    rows = []
    for kind in kinds:
        med = statistics.median(times[kind])
        rows.append(
            {
                "transport": "native",
                "method": f"decode-{kind}",
                "receiver": m.name,
                "context_tokens": int(ids.shape[0]),
                "new_tokens": n,
                "decode_s": med,
                "tokens_per_s": n / med,
                "times_s": times[kind],
                "cpu_share": shares[kind],
                "same_tokens": same,
            }
        )
    rows[1]["speedup"] = rows[0]["decode_s"] / rows[1]["decode_s"]
    return rows


def bench(
    model: str = "qwen2.5-coder-0.5b",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (4096,),
    repeats: int = 3,
    out: str = "decode",
    options: dict | None = None,
    command: str = "",
    models: Sequence[LoadedModel] | None = None,
) -> Path:
    """tokens/s of both caches per model and length -> benchmarks/results/OUT.json + OUT.png."""
    from ctxrelay import zoo

    if sender or receiver:
        raise UsageError("bench decode times one model's own decoding: use --model, not --sender/--receiver")
    if not lengths or any(n < 1 for n in lengths) or repeats < 1:
        raise UsageError(f"lengths must be positive token counts and repeats >= 1 (got {list(lengths)}, {repeats})")
    opts = bench_options("decode", options, OPTIONS)
    sources: list = list(models) if models is not None else model_names(model or "qwen2.5-coder-0.5b")
    command = command or f"ctxrelay bench decode --model {model} --lengths {','.join(map(str, lengths))}"
    extra = {"options": opts, "lengths": sorted(lengths), "repeats": repeats}
    rows: list[dict] = []
    path = None
    with tqdm(total=len(sources) * len(lengths), desc="decode", unit="point") as bar:
        for src in sources:
            m = src if isinstance(src, LoadedModel) else zoo.load(src)
            for n in sorted(lengths):
                bar.set_postfix_str(f"{m.name} @ {n}")
                rows.extend(measure(m, n, repeats, opts))
                path = write_results(out, rows, command, extra)
                bar.update(1)
            del m
            gc.collect()
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        xs, ys = series.setdefault(f"{r['receiver']} {r['method']}", ([], []))
        xs.append(r["context_tokens"])
        ys.append(r["tokens_per_s"])
    line_plot(plot_path(path), series, xlabel="context tokens", ylabel=f"decode tokens/s ({opts['new_tokens']} new)",
              title="Greedy decode speed: preallocated vs concatenating KV cache", logx=True)  # fmt: skip
    return path
