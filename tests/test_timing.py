"""The one median timer and the component stopwatch."""

import time

import pytest

from ctxrelay.errors import UsageError
from ctxrelay.timing import Stopwatch, median_components, median_time


def test_median_time_counts_calls():
    calls = []
    med, times = median_time(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and len(times) == 5 and min(times) <= med <= max(times)
    with pytest.raises(UsageError):
        median_time(lambda: None, repeats=0)


def test_median_components_takes_the_median_of_each_component():
    runs = iter([{"a": 100.0, "b": 0.0}, {"a": 1.0, "b": 3.0}, {"a": 2.0, "b": 1.0}, {"a": 3.0, "b": 2.0}])
    got = median_components(lambda: next(runs), repeats=3, warmup=1)  # the first run is the warm-up
    assert got == {"a": 2.0, "b": 2.0}


def test_median_components_warms_up_until_the_warm_up_calls_add_up_to_warmup_s():
    """A fast call that runs slow its first few times (a newly used edge) is timed once it is steady."""
    runs = iter([{"a": 0.3}, {"a": 0.3}, {"a": 0.3}, {"a": 0.3}, {"a": 0.1}, {"a": 0.2}, {"a": 0.1}])
    got = median_components(lambda: next(runs), repeats=3, warmup=1, warmup_s=1.0)  # 4 calls reach 1.2 s
    assert got == {"a": 0.1}
    assert next(runs, None) is None  # nothing left: 4 warm-ups and 3 timed calls
    slow = iter([{"a": 5.0}, {"a": 1.0}])
    assert median_components(lambda: next(slow), repeats=1, warmup=1, warmup_s=1.0) == {"a": 1.0}  # one is enough


def test_median_components_times_fast_calls_until_they_add_up_to_measure_s():
    """A median of two is the mean of two: one spike moves it. Fast calls get more timed runs."""
    runs = iter([{"a": 9.0}, {"a": 0.4}, {"a": 0.6}, {"a": 0.4}, {"a": 0.4}, {"a": 0.5}, {"a": 7.0}])
    got = median_components(lambda: next(runs), repeats=2, warmup=1, measure_s=2.0)  # 0.4 .. 0.5: 2.3 s
    assert got == {"a": 0.4}
    assert next(runs) == {"a": 7.0}  # stopped once the timed calls reached 2 s
    calls = []
    fast = median_components(lambda: calls.append(1) or {"a": 0.001}, 2, warmup_s=1.0, measure_s=2.0, max_calls=4)
    assert fast == {"a": 0.001} and len(calls) == 4 + 4  # 4 per phase, not 1000 + 2000 calls


def test_stopwatch_accumulates_named_components():
    sw = Stopwatch()
    for _ in range(2):
        with sw("x_s"):
            time.sleep(0.01)
    with sw("y_s"):
        pass
    assert set(sw.timings) == {"x_s", "y_s"} and sw.timings["x_s"] >= 0.02 > sw.timings["y_s"]
