"""What every bench shares: wall seconds of a span (between device syncs, and between
barriers when ranks time it together), the steps of several systems interleaved,
medians and percentiles over runs that may be missing, ABBA order and a hybrid /
peer record, peak RSS, and printing a JSON record.

    with Stopwatch(device=ps.device, barrier=world_barrier(ps)) as sw:
        load_checkpoint(...)
    times = interleaved({"fp32": step_fp32, "bf16": step_bf16}, steps=8, warmup=2)
    emit({"median_step_s": round(median_of(times["bf16"]), 4)})

A bench prints what it measured and asserts nothing about time: timings on a
shared machine drift by tens of percent, and docs/measurements.md keeps the
figures with their machine and date.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable


def sync(device=None) -> None:
    """Wait until ``device`` (a ``torch.device`` or None) has run what was queued on it:
    a GPU runs behind the host, a CPU never does."""
    kind = None if device is None else getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch
        torch.cuda.synchronize(device)


def now(device=None) -> float:
    """``time.perf_counter()`` once ``device`` has run what was queued on it."""
    sync(device)
    return time.perf_counter()


def world_barrier(ps) -> Callable[[], None]:
    """A barrier over every rank of ``ps`` (a ``ParallelState``): an all-reduce of one
    element, through the comm door as any collective of the bench."""
    import torch

    def barrier():
        ps.world_group.all_reduce(torch.zeros(1, device=ps.device))
    return barrier


class Stopwatch:
    """Wall seconds of a ``with`` block, in ``.seconds`` after it.

    ``device``: synced at the start and the end, so the span holds the device's work,
    not only its queueing. ``barrier`` (a callable, as :func:`world_barrier`'s): called
    before the start, so every rank starts together, and after the end is read, so
    the next span starts together too; each rank's ``seconds`` is its own time from
    the common start. A block that raises skips the last barrier (the other ranks
    may never reach it)."""

    def __init__(self, device=None, barrier: Callable[[], object] | None = None):
        self.device, self.barrier = device, barrier
        self.seconds = 0.0  # (set when the block ends)
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:
        if self.barrier is not None:
            self.barrier()
        self._t0 = now(self.device)
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.seconds = now(self.device) - self._t0
        if kind is None and self.barrier is not None:
            self.barrier()


def interleaved(fns: dict[str, Callable[[], object]], steps: int, warmup: int = 0,
                device=None) -> dict[str, list[float]]:
    """Seconds of each call of each of ``fns``, called in turn, one call of each per
    round, so the machine's drift hits all alike: ``warmup`` rounds untimed, then
    ``steps`` timed (``device`` synced around each call)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            t0 = now(device)
            fn()
            t = now(device) - t0
            if i >= warmup:
                times[name].append(t)
    return times


def median(xs: Iterable[float | None]) -> float | None:
    """The median of the values of ``xs`` that are there (None: a run that did not
    measure); None when none are."""
    kept = [x for x in xs if x is not None]
    return statistics.median(kept) if kept else None


def median_of(xs: Iterable[float]) -> float:
    """The median of ``xs``, every value measured (StatisticsError when there is none):
    what a bench's own timings take, where :func:`median` serves runs that may be
    missing."""
    return statistics.median(xs)


def percentile(xs: Iterable[float | None], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) of the values of ``xs`` that are there,
    interpolated linearly between the two nearest (numpy's default; ``q=50`` is the
    median); None when none are."""
    kept = sorted(x for x in xs if x is not None)
    if not kept:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    pos = (len(kept) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return kept[lo] + (kept[hi] - kept[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None where either is missing or ``b`` is 0."""
    return None if a is None or b is None or b == 0 else a / b


def rnd(x: float | None, nd: int = 5) -> float | None:
    """``round(x, nd)``, None for None."""
    return None if x is None else round(x, nd)


def abba(p: int, first: str, second: str) -> list[str]:
    """The order of pair ``p``: (first, second) for even ``p``, (second, first) for odd."""
    return [first, second] if p % 2 == 0 else [second, first]


def pair_record(h: list, peer: list, peer_name: str, nd: int = 5) -> dict:
    """One measure of hybrid (``h``) and a peer, run by run: both medians and the
    median of the per-pair ratios hybrid / peer, with those ratios."""
    pair = [ratio(x, y) for x, y in zip(h, peer)]
    return {"hybrid_median_s": rnd(median(h), nd), f"{peer_name}_median_s": rnd(median(peer), nd),
            "ratio": rnd(median(pair), 4), "pair_ratios": [rnd(x, 4) for x in pair]}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def emit(record, indent: int | None = None, file=None) -> None:
    """Print ``record`` as JSON (one line unless ``indent``) to stdout, or ``file``,
    flushed at once: a reader of a long bench sees each record as it is taken."""
    print(json.dumps(record, indent=indent), file=file or sys.stdout, flush=True)
