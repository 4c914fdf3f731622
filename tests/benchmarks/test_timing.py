"""benchmarks/timing.py, what every bench times and summarizes with: the statistics
against ``statistics`` and by hand, the order of interleaved calls, when a stopwatch
calls its barrier. No figure here depends on how fast the machine is."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from benchmarks.timing import (
    Stopwatch,
    abba,
    emit,
    interleaved,
    median,
    pair_record,
    percentile,
    ratio,
    rnd,
)


def test_median_and_percentile_skip_missing_runs():
    xs = [3.0, None, 1.0, 4.0, 2.0]
    assert median(xs) == statistics.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert median([None]) is None and median([]) is None
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5  # the median, interpolated as numpy does
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="outside 0..100"):
        percentile(xs, 101)


def test_ratio_rnd_and_pairs():
    assert ratio(1.0, 4.0) == 0.25 and ratio(1.0, 0) is None and ratio(None, 1.0) is None
    assert rnd(None) is None and rnd(0.123456, 3) == 0.123
    assert [abba(p, "h", "m") for p in range(3)] == [["h", "m"], ["m", "h"], ["h", "m"]]
    rec = pair_record([1.0, 3.0], [2.0, 2.0], "megatron")
    assert rec == {"hybrid_median_s": 2.0, "megatron_median_s": 2.0, "ratio": 1.0,
                   "pair_ratios": [0.5, 1.5]}


def test_interleaved_calls_in_turn_and_times_after_warmup():
    calls = []
    times = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                        steps=3, warmup=2)
    assert calls == ["a", "b"] * 5  # one call of each per round, warm-up rounds included
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_stopwatch_times_its_block_between_barriers():
    barriers = []
    with Stopwatch(barrier=lambda: barriers.append(time.perf_counter())) as sw:
        t_in = time.perf_counter()
        time.sleep(0.01)
    assert sw.seconds >= 0.01 and len(barriers) == 2
    assert barriers[0] <= t_in  # the first barrier before the start
    # a block that raises: no barrier after it
    with pytest.raises(RuntimeError), Stopwatch(barrier=lambda: barriers.append(0.0)):
        raise RuntimeError("a rank failed")
    assert len(barriers) == 3


def test_emit_prints_one_json_line_or_an_indented_object(capsys):
    emit({"median_step_s": 0.5, "ratio": None})
    emit({"a": [1]}, indent=1)
    out = capsys.readouterr().out
    first, rest = out.split("\n", 1)
    assert json.loads(first) == {"median_step_s": 0.5, "ratio": None}
    assert json.loads(rest) == {"a": [1]} and rest.count("\n") > 1
