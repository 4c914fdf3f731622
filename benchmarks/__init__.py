"""The benchmarks: one module per measurement, run from the checkout's root as
``python -m benchmarks.bench_<name>`` (``bench_checkpoint``, ``bench_zero``, ...), and
``timing``, what they share: a stopwatch between device syncs or barriers, interleaved
steps, medians and percentiles, printing JSON. A bench that is more than one file
keeps its pieces in a package here (``peers``: for ``bench_peers``). Each prints JSON
and asserts no timing; docs/measurements.md cites their commands. Not installed with
``hybrid``, and nothing in ``hybrid`` imports them; the user tools are in ``scripts/``."""
