"""Collectives that return before they complete: the hang watch for NCCL.

[Note: why the heartbeat watches collectives on NCCL]
On gloo a collective that never completes raises, after the group's timeout,
in the thread that waits for it, and :mod:`hybrid.parallel.comm` turns the error into
the job's report. NCCL never gets that far: a collective returns as soon as
it is queued on a stream, the host runs ahead to its next sync (a loss read,
an optimizer step) and blocks there, and at the timeout NCCL's own watchdog
thread tears the process down before any Python code sees an error. So on a
backend whose collectives complete asynchronously the flight recorder keeps
each collective's work handle until it completes, and its heartbeat thread
looks at the oldest one still running. Past the timeout it runs the same
report protocol as a failed collective and hands the error to ``on_hang``
(by default: print it and end the process). The process groups themselves
get a longer timeout (``FlightRecorder.backstop``), long enough for the ranks to agree
on the report first, so the backend's watchdog stays only a backstop for a
process whose Python threads cannot run at all.

[Note: what it costs]
Handles are kept per group, in issue order: a communicator completes its
collectives in that order, so only a group's oldest handle needs asking.
The collective path asks it (one non-blocking ``is_completed``, a CUDA event
query on NCCL) and drops the finished ones before adding its own, so a
group holds only the collectives in flight: references the backend holds
anyway until they complete. The heartbeat asks the oldest of each group
(three), once per alarm poll (at most a second).
"""

from __future__ import annotations

import collections
import threading
import time


class PendingWatch:
    """Collectives issued and not yet complete, per group, oldest first.

    Used from two threads (the training thread adds, the heartbeat asks), under
    one uncontended lock.
    """

    def __init__(self) -> None:
        self._groups: dict = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def add(self, entry, work) -> None:
        """Watch ``work``, the backend's handle of collective ``entry``."""
        with self._lock:
            q = self._groups[entry.group.name]
            _drop_done(q)
            q.append((entry, work, time.time()))

    def oldest(self):
        """``(entry, issued_at)`` of the oldest collective still running, or None."""
        with self._lock:
            heads = []
            for q in self._groups.values():
                _drop_done(q)
                if q:
                    heads.append(q[0])
        if not heads:
            return None
        entry, _, since = min(heads, key=lambda h: h[2])
        return entry, since

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._groups.values())


def _drop_done(q: collections.deque) -> None:
    while q and _completed(q[0][1]):
        entry = q.popleft()[0]
        if entry.state == "issued":
            entry.state = "done"


def _completed(work) -> bool:
    try:
        return work.is_completed()
    except Exception:  # noqa: BLE001 - it failed: whoever waits on it reports that
        return True
