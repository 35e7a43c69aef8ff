"""Timing helpers every measurement uses: a component stopwatch and one median timer.

Speed is measured in benchmarks (and the cost profile), never in timed unit tests: warm-up first,
then the median of repeats, in the same process as the reference it is compared with.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

from ctxrelay.errors import UsageError


class Stopwatch:
    """Accumulates wall time into named components: `with sw("translate_s"): ...`."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0


def median_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Run `fn` `warmup` times untimed, then `repeats` times timed; (median seconds, all times)."""
    if repeats < 1:
        raise UsageError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def median_ms(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """median_time of `fn` in milliseconds (operator and layer timings)."""
    return 1000 * median_time(fn, repeats, warmup)[0]


def median_components(
    fn: Callable[[], dict[str, float]],
    repeats: int = 3,
    warmup: int = 1,
    warmup_s: float = 0.0,
    measure_s: float = 0.0,
    max_calls: int = 16,
) -> dict[str, float]:
    """`fn` returns named component times. After `warmup` calls, and more until the warm-up calls' own
    reported times add up to `warmup_s`, the per-component median of at least `repeats` timed calls, and
    of more until they add up to `measure_s`. Both matter for calls of a fraction of a second: measured
    (`scripts/cost_point_runs.py`) the first three relays over a newly used edge ran 0.26-0.31 s, the
    later ones 0.16-0.20 s, and one call in six or so spikes by ~0.2 s; one warm-up and a median of two
    timed the tail or a spike. Neither phase makes more than `max_calls` calls for the seconds (a call
    of a few ms, a tiny test model's, would otherwise run hundreds of times)."""
    if repeats < 1:
        raise UsageError(f"repeats must be >= 1, got {repeats}")
    _calls_until(fn, warmup, warmup_s, max_calls)
    runs = _calls_until(fn, repeats, measure_s, max_calls)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}


def _calls_until(fn: Callable[[], dict[str, float]], calls: int, seconds: float, max_calls: int) -> list[dict]:
    """At least `calls` results of `fn`, and more, up to `max_calls`, until their reported times add up to `seconds`."""
    out: list[dict[str, float]] = []
    spent = 0.0
    while len(out) < calls or (spent < seconds and len(out) < max_calls):
        out.append(fn())
        spent += sum(out[-1].values())
    return out
