"""``--blocked``: the time a rank's main thread spends blocked in torch.distributed
collectives, per step, by phase (forward, backward, other: the optimizer step and
loss bookkeeping) and by collective.

Blocked time is what the main thread cannot compute during: the whole call of a
synchronous collective, and the ``wait()`` of an asynchronous one (issuing it is
counted too, but returns at once). Communication that runs while the thread computes
-- an overlapped all-reduce before its wait -- costs nothing here, which is the point.

[Note: installed before the systems import]
The functions of ``torch.distributed`` are replaced by timing wrappers before hybrid
or megatron-core is imported, so a module that binds one at import (hybrid's comm
layer binds ``all_gather_into_tensor``) binds the wrapper. The phase: inside a
backward pass ``torch._C._current_graph_task_id()`` is not -1; before it (since
``begin_step()``) is forward -- grad mode cannot tell, autograd Functions run their
forward without it -- and after ``torch.autograd.backward`` has returned, "other".
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from time import perf_counter

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
         "reduce_scatter", "reduce_scatter_tensor", "broadcast", "all_to_all",
         "all_to_all_single", "barrier", "send", "recv", "isend", "irecv",
         "batch_isend_irecv", "_all_gather_base", "_reduce_scatter_base")
_WRAPPERS: weakref.WeakSet = weakref.WeakSet()  # the timing wrappers: never wrapped again


class _TimedWork:
    """An asynchronous collective's handle whose ``wait()`` is timed."""

    def __init__(self, work, clock, key):
        self._work, self._clock, self._key = work, clock, key

    def wait(self, *args, **kwargs):
        t = perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.add(self._key, perf_counter() - t)

    def __getattr__(self, name):
        return getattr(self._work, name)


class BlockedClock:
    """Seconds blocked per (phase, collective) on this thread since the last ``take()``."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._backward_done = False

    def install(self) -> BlockedClock:
        """Wrap every collective of ``torch.distributed`` and ``torch.autograd.backward``
        (before the systems import)."""
        import torch
        import torch.distributed as dist
        for name in NAMES:
            fn = getattr(dist, name, None)
            if fn is not None and fn not in _WRAPPERS:
                setattr(dist, name, self._wrap(name, fn))
        backward = torch.autograd.backward

        def marked(*args, **kwargs):
            out = backward(*args, **kwargs)
            self._backward_done = True
            return out
        torch.autograd.backward = marked  # (Tensor.backward calls it by this name)
        self._graph_task = torch._C._current_graph_task_id
        return self

    def begin_step(self) -> None:
        """A step starts: collectives are forward ones until backward runs."""
        self._backward_done = False

    def phase(self) -> str:
        if self._graph_task() != -1:
            return "backward"
        return "other" if self._backward_done else "forward"

    def add(self, key: str, seconds: float) -> None:
        self.totals[key] += seconds

    def _wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            key = f"{self.phase()}/{name}"
            self.calls[key] += 1
            t = perf_counter()
            out = fn(*args, **kwargs)
            self.add(key, perf_counter() - t)
            if isinstance(out, list):  # batch_isend_irecv: one handle per operation
                return [_TimedWork(w, self, key) for w in out]
            return _TimedWork(out, self, key) if out is not None and hasattr(out, "wait") else out
        _WRAPPERS.add(timed)
        return timed

    def take(self) -> tuple[dict, dict]:
        """(seconds, calls) by "phase/collective" since the last take; both reset."""
        out = dict(self.totals), dict(self.calls)
        self.totals.clear()
        self.calls.clear()
        return out


def per_step(seconds: dict, calls: dict, steps: int) -> dict:
    """Totals over ``steps`` steps as a per-step record: milliseconds blocked by phase
    and in all, and by collective with its calls per step."""
    phases: defaultdict[str, float] = defaultdict(float)
    for key, s in seconds.items():
        phases[key.split("/")[0]] += s
    return {"blocked_ms_per_step": round(1e3 * sum(seconds.values()) / steps, 3),
            "by_phase_ms": {k: round(1e3 * v / steps, 3) for k, v in sorted(phases.items())},
            "by_collective": {k: {"ms": round(1e3 * seconds.get(k, 0.0) / steps, 3),
                                  "calls": round(calls.get(k, 0) / steps, 2)}
                              for k in sorted(set(seconds) | set(calls))}}
