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


def test_stopwatch_accumulates_named_components():
    sw = Stopwatch()
    for _ in range(2):
        with sw("x_s"):
            time.sleep(0.01)
    with sw("y_s"):
        pass
    assert set(sw.timings) == {"x_s", "y_s"} and sw.timings["x_s"] >= 0.02 > sw.timings["y_s"]
