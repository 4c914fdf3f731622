"""The collective flight recorder: what each rank last did, and one report when a collective fails.

Every :class:`hybrid.parallel.comm.CommGroup` collective is numbered per group (``#k``
of the tp, dp or world group) and recorded here before it runs: op, group,
shape, dtype, the Python caller (file:line, a few frames) and the wall time,
in a ring of the last :data:`RING` entries. When a collective fails or times
out, the ranks compare notes through the rendezvous store and one of them
writes one report naming the ranks that never reached collective #k and where
each of them was last (:mod:`hybrid.diagnostics.report`).

[Note: what is published, when, and what it costs]
A rank's *record* is O(1): per group (three of them) its last sequence number,
its last two entries, whether and where it is blocked, where its main thread is
now, its host, and a timestamp. It is written under the rank's own key ``hb/<rank>``:

* by a heartbeat thread every ``heartbeat_s`` = timeout / 8 (clamped to
  [0.25 s, 30 s]): at 1,000 ranks and the default 10-minute timeout that is
  33 small writes per second on the store, whatever the step time. A rank
  frozen by SIGSTOP or dead stops publishing; its last record and its age are
  what the report can say about it.
* by the same thread at once when it sees the alarm (below);
* by a rank itself the moment one of its collectives fails.

At start a rank also appends its number to its host's key ``host/<hostname>``,
so a report can tell which ranks share a host.

The collective hot path does no store round trip: it appends to the in-memory
ring and updates two dict slots (about 6 us per collective, frame walk
included, on the 2-core CPU this was written on). Publishing on every
collective would cost a round trip to one store server per collective on
every rank -- 1,000 ranks x hundreds of collectives per step -- and still say
nothing more about a frozen rank than its last heartbeat does: what the
report knows exactly about a frozen or dead rank comes from its peers (a
collective they completed needed its part: it got through it).

When a collective fails, its rank bumps the ``alarm`` counter. Every heartbeat
thread reads it each ``poll_s`` = min(heartbeat_s, 1 s) (one ``add(key, 0)``:
at 1,000 ranks 1,000 small requests a second, a few percent of what one store
server serves -- about 30,000 a second on the 2-core CPU this was written on)
and republishes as soon as it changes. So a live rank answers within
``poll_s``, whatever the timeout, and the report waits ``answer_s`` =
2 * poll_s + 1 s for the answers; a rank silent by then is named as dead,
stopped or hung, and a host none of whose ranks answered as a lost node.
(Waiting two publish periods instead, a job with the default 10-minute timeout
took 60 s to name ranks that were already dead.) The first rank to fail wins
``claim`` (an atomic ``add``) and reports: the rank that has waited longest,
usually the nearest to the stuck one, and the only choice that needs no
agreement among ranks that are failing at different moments. It reads the
records of the failing group, O(group size), and follows a rank that is itself
blocked into the group it is blocked on, so whichever rank reports, the report
ends at the ranks that are stuck outside any collective; for a silent rank it
also reads its host's ranks and a peer per group, O(ranks per host + 3).
Every other failing rank waits for ``done`` and then ``printed`` (polled with
``check``, bounded) and exits with a one-line pointer to the report: exiting
earlier could make the launcher stop the reporter before it printed.

On NCCL a collective returns before it completes and the backend's watchdog ends
the process at the timeout without a word to Python; there the heartbeat also
watches the collectives in flight and runs this protocol itself for one past
the timeout (:mod:`hybrid.diagnostics.watch`).

Every store operation runs on a clone of the store with its own timeout
(``store_timeout``), one clone per thread: a dead store server cannot hang the
report for longer than that.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch

from hybrid.diagnostics import report
from hybrid.diagnostics.entry import Entry, callers, fmt_frame
from hybrid.diagnostics.watch import PendingWatch
from hybrid.errors import CollectiveError

RING = 64  # collectives kept per rank
ALARM_POLL_S = 1.0  # the heartbeat reads the alarm at least this often (see the note)


def _periods(timeout_s: float) -> tuple[float, float, float]:
    """(heartbeat period, alarm poll period, store timeout) in seconds for a collective
    timeout."""
    heartbeat = min(30.0, max(0.25, timeout_s / 8))
    return heartbeat, min(heartbeat, ALARM_POLL_S), min(30.0, max(2.0, timeout_s))


def backstop(timeout: datetime.timedelta) -> datetime.timedelta:
    """The process groups' own timeout when the recorder watches for hangs
    (:mod:`hybrid.diagnostics.watch`): ``timeout`` plus the time the ranks may take to
    notice (one heartbeat), read fresh records (``answer_s``: at most two heartbeats and
    1 s) and, on a pointing rank, wait for the report (:meth:`FlightRecorder._reporter`:
    four heartbeats, two store timeouts and 2 s), with a margin."""
    heartbeat, _, store = _periods(timeout.total_seconds())
    return timeout + datetime.timedelta(seconds=8 * heartbeat + 2 * store + 10)


def exit_on_hang(error: CollectiveError) -> None:
    """The default ``on_hang``: say it on stderr, let the other ranks go, end the process
    (the backend's watchdog would end it anyway, without a word)."""
    print(str(error), file=sys.stderr, flush=True)
    error.reported()
    os._exit(2)


class FlightRecorder:
    """This process's ring of collectives, its heartbeat, and the failure protocol.

    Args:
        rank, world_size: this process in the job.
        store: the rendezvous store the process groups were built from (a
            ``torch.distributed.Store``), namespaced for this job; None in a
            one-process run or when unknown: failures are then reported from
            this rank's own ring only.
        timeout: the collective timeout (sets the heartbeat period).
        watch: the backend completes collectives after they return (NCCL): keep
            their handles and let the heartbeat report one running past the
            timeout, through ``on_hang`` (:mod:`hybrid.diagnostics.watch`).
        connections: (main thread's, heartbeat's) stores instead of two clones of
            ``store`` (new TCP connects) -- for a process making many recorders.
    """

    def __init__(self, rank: int, world_size: int, store=None,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10),
                 watch: bool = False, dump_dir: str | None = None,
                 check_collectives: bool = False, connections: tuple | None = None):
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout.total_seconds()
        self.heartbeat_s, self.poll_s, store_s = _periods(self.timeout_s)
        # how long a report waits for the live ranks to answer the alarm (module note)
        self.answer_s = 2 * self.poll_s + 1.0
        self.store_timeout = datetime.timedelta(seconds=store_s)
        self.watch = PendingWatch() if watch else None
        # called on the heartbeat thread with the report
        self.on_hang: Callable[[CollectiveError], None] = exit_on_hang
        self.ring: collections.deque = collections.deque(maxlen=RING)
        self.groups: dict = {}  # name -> CommGroup
        self.last: dict = {}  # group name -> (last Entry, the one before)
        self.waiting: Entry | None = None  # the collective this rank is blocked in
        self.waiting_since = 0.0
        self.failure: dict | None = None
        self.dump_dir = dump_dir  # --collective-dump-dir
        self.check_collectives = check_collectives  # --check-collectives
        self._main = threading.get_ident()
        self._connections = connections
        self._store = self._clone(store, 0)
        self._base_store = store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._alarm_seen = 0
        self._dumped_on_alarm = False
        self._closed = False
        self._host = socket.gethostname()
        self._protocol = threading.Lock()  # one failure protocol at a time, on either thread
        self._first_failure: tuple | None = None  # (entry, (message, is the report))

    # -- setup -------------------------------------------------------------------------
    def _clone(self, store, thread: int):
        """``thread``'s store connection (0: main, 1: heartbeat), with its own timeout."""
        if store is None:
            return None
        s = store.clone() if self._connections is None else self._connections[thread]
        s.set_timeout(self.store_timeout)
        return s

    def configure(self, dump_dir: str | None = None, check_collectives: bool = False) -> None:
        """``--collective-dump-dir`` and ``--check-collectives`` for a recorder built
        without them (the test pool's, which serves many runs)."""
        self.dump_dir = dump_dir
        self.check_collectives = check_collectives

    def register(self, group) -> None:
        self.groups[group.name] = group

    def start(self) -> None:
        """Publish a first record, say which host this rank runs on, and start the
        heartbeat (no-op without a store)."""
        if self._store is None or self._thread is not None:
            return
        self._publish(self._store)
        self._store.append(_host_key(self._host), f"{self.rank},")
        self._thread = threading.Thread(target=self._heartbeat,
                                        args=(self._clone(self._base_store, 1),),
                                        name="hybrid-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat; the last record says this rank left (a rank that finished
        while the others wait for a collective it skipped is named as such)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.store_timeout.total_seconds() + 1)
        self._thread = None
        self._closed = True
        with contextlib.suppress(Exception):  # the store may be gone at shutdown
            self._publish(self._store)

    # -- the hot path --------------------------------------------------------------------
    def issue(self, group, op: str, t: torch.Tensor, peers=None, about: str | None = None,
              heard=None) -> Entry:
        """Number and record a collective of ``group`` about to run (no I/O); ``peers``,
        ``heard`` and ``about`` for a point-to-point exchange (:class:`Entry`)."""
        group.seq += 1
        e = Entry(group.seq, group, op, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                  callers(sys._getframe(2)), time.time(), peers, about, heard)
        self.ring.append(e)
        prev = self.last.get(group.name)
        self.last[group.name] = (e, prev[0] if prev else None)
        return e

    def begin_wait(self, e: Entry) -> None:
        self.waiting, self.waiting_since = e, time.time()

    def end_wait(self, e: Entry) -> None:
        e.state = "done" if e.state == "issued" else e.state
        self.waiting = None

    # -- records ---------------------------------------------------------------------------
    def record(self) -> dict:
        """This rank's O(1) state: see the module note."""
        now = time.time()
        groups = {}
        for name, g in list(self.groups.items()):
            last, prev = self.last.get(name, (None, None))
            groups[name] = {"ranks": g.ranks, "seq": g.seq,
                            "last": last.to_dict() if last else None,
                            "prev": prev.to_dict() if prev else None}
        w, since = self.waiting, self.waiting_since
        if w is None and self.watch is not None:  # queued, not complete: waited for, too
            w, since = self.watch.oldest() or (None, 0.0)
        last_t = max((e.t for e, _ in list(self.last.values())), default=None)
        return {"rank": self.rank, "t": now, "host": self._host, "pid": os.getpid(),
                "heartbeat_s": self.heartbeat_s, "alarm": self._alarm_seen,
                "closed": self._closed,
                "groups": groups, "last_t": last_t, "where": self.where(),
                "waiting": ({"group": w.group.name, "seq": w.seq, "since": since}
                            if w is not None else None),
                "failed": self.failure}

    def where(self) -> str | None:
        """Where this process's main thread is now: its innermost frame of interest."""
        frame = sys._current_frames().get(self._main)
        out = callers(frame, depth=1) if frame is not None else ()
        return fmt_frame(out[0]) if out else None

    def _publish(self, store) -> None:
        store.set(_hb(self.rank), json.dumps(self.record()))

    def _heartbeat(self, store) -> None:
        """Every ``poll_s`` read the alarm; publish every ``heartbeat_s``, and at once when
        the alarm changed (the module note)."""
        due = time.time() + self.heartbeat_s
        while not self._stop.wait(self.poll_s):
            try:
                alarm = store.add(_ALARM, 0)
                if alarm != self._alarm_seen or time.time() >= due:
                    self._alarm_seen = alarm
                    self._publish(store)
                    due = time.time() + self.heartbeat_s
                if self._alarm_seen and not self._dumped_on_alarm:
                    self._dumped_on_alarm = True
                    self.dump("another rank's collective failed")
            except Exception:  # noqa: BLE001 - a missing store must not kill training
                pass
            self._check_watch()

    def _check_watch(self) -> None:
        """On the heartbeat thread: report the oldest collective still running past the
        timeout, once, through ``on_hang`` (see :mod:`hybrid.diagnostics.watch`)."""
        if self.watch is None or self._first_failure is not None:
            return
        oldest = self.watch.oldest()
        if oldest is None or time.time() - oldest[1] < self.timeout_s:
            return
        e, since = oldest
        msg, is_report = self.failed(e, f"still running {time.time() - since:.1f} s after it "
                                        f"was queued")
        self.on_hang(CollectiveError(msg, is_report, self.reported if is_report else None))

    def dump(self, reason: str) -> str | None:
        """Write the ring as JSON to ``dump_dir/collectives_rank<rank>.json``."""
        if not self.dump_dir:
            return None
        os.makedirs(self.dump_dir, exist_ok=True)
        path = os.path.join(self.dump_dir, f"collectives_rank{self.rank:05d}.json")
        rec = self.record()
        rec["reason"] = reason
        rec["collectives"] = [e.to_dict() for e in list(self.ring)]
        # (the heartbeat's alarm and a failing collective may dump at once, one from each
        # thread: each writes a file of its own, and the last one renamed stays)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1)
        os.replace(tmp, path)
        return path

    # -- failures ----------------------------------------------------------------------------
    def failed(self, e: Entry, detail: str) -> tuple[str, bool]:
        """(message, is the report) for collective ``e`` that failed with ``detail``.

        Runs the protocol of the module note. Without a store, or if the store
        fails, the message is this rank's own view and counts as the report.
        The watch and the collective's own error may both report ``e``: the
        second gets the first's answer.
        """
        with self._protocol:
            if self._first_failure is not None and self._first_failure[0] is e:
                return self._first_failure[1]
            out = self._failed(e, detail)
            self._first_failure = (e, out)
            return out

    def _failed(self, e: Entry, detail: str) -> tuple[str, bool]:
        e.state = "failed"
        self.waiting = None
        self.failure = {"group": e.group.name, "seq": e.seq, "op": e.op,
                        "error": report.short_error(detail)}
        self._dumped_on_alarm = True  # this dump says more than the heartbeat's would
        self.dump(f"{e.op} #{e.seq} of the {e.group.name} group failed: "
                  f"{report.short_error(detail)}")
        head = report.headline(self.rank, e.to_dict(), self.timeout_s, detail)
        if self._store is None:
            return head + report.own_view(self.record()), True
        try:
            self._publish(self._store)
            self._store.add(_ALARM, 1)
            if not self._claim():
                return self._pointer(e), False
            deadline = time.time() + self.answer_s
            msg = report.explain(head, e.to_dict(), self.record(),
                                 lambda ranks: self._read_fresh(ranks, deadline), self.dump_dir,
                                 host_ranks=self._host_ranks)
            self._finish()
            return msg, True
        except Exception as err:  # noqa: BLE001 - the store itself failed: say what we know
            return (head + report.own_view(self.record())
                    + f"\n  (the ranks could not compare notes through the store: {err})"), True

    def mismatch(self, message: str) -> tuple[str, bool]:
        """(message, is the report) for a --check-collectives mismatch every rank of the
        group found at once: one of them reports it."""
        if self._store is None:
            return message, True
        try:
            self._store.add(_ALARM, 1)
            if not self._claim():
                return f"rank {self.rank}: collective mismatch; see the report of rank " \
                       f"{self._reporter()}", False
            self._finish()
        except Exception:  # noqa: BLE001
            pass
        return message, True

    def _claim(self) -> bool:
        if self._store.add(_CLAIM, 1) == 1:
            self._store.set(_REPORTER, str(self.rank))
            return True
        return False

    def _finish(self) -> None:
        self._store.set(_DONE, "1")

    def reported(self) -> None:
        """The report is on the console: the other ranks may exit now. (Their exit makes a
        launcher such as torchrun stop this rank, which must not happen before.)"""
        if self._store is not None:
            with contextlib.suppress(Exception):  # they stop waiting on their own
                self._store.set(_PRINTED, "1")

    def _wait_for(self, key: str, seconds: float) -> bool:
        deadline = time.time() + seconds
        while not self._store.check([key]):
            if time.time() >= deadline:
                return False
            time.sleep(min(0.1, self.heartbeat_s))
        return True

    def _reporter(self) -> str:
        """The reporting rank, once its report is written and printed (waits, bounded)."""
        if self._wait_for(_DONE, 4 * self.heartbeat_s + 2 * self.store_timeout.total_seconds()):
            self._wait_for(_PRINTED, 2.0)  # if nobody calls reported(), go on after 2 s
        return (self._store.get(_REPORTER).decode() if self._store.check([_REPORTER])
                else "unknown")

    def _pointer(self, e: Entry) -> str:
        return (f"rank {self.rank}: {report.subject(e.to_dict())} failed too; see the "
                f"collective report of rank {self._reporter()}")

    def _read_fresh(self, ranks: list[int], deadline: float) -> dict:
        """Records of ``ranks``, waiting until each is fresh (published after the alarm,
        or a failure record) or ``deadline`` passes: O(len(ranks)) reads per poll."""
        keys = [_hb(r) for r in ranks]
        while True:
            recs = {}
            if self._store.check(keys):
                vals = self._store.multi_get(keys)
                recs = {r: json.loads(v) for r, v in zip(ranks, vals)}
            else:
                for r, k in zip(ranks, keys):
                    if self._store.check([k]):
                        recs[r] = json.loads(self._store.get(k))
            if self.rank in recs:
                recs[self.rank] = self.record()
            stale = [r for r in ranks if r not in recs or not report.is_fresh(recs[r])]
            left = deadline - time.time()
            if not stale or left <= 0:
                return recs
            time.sleep(min(left, self.poll_s / 2))

    def _host_ranks(self, host: str) -> list[int]:
        """The ranks that said at start they run on ``host`` (none if it is unknown)."""
        key = _host_key(host)
        if not self._store.check([key]):
            return []
        return sorted(int(r) for r in self._store.get(key).decode().split(",") if r)


_ALARM, _CLAIM, _REPORTER = "fr/alarm", "fr/claim", "fr/reporter"
_DONE, _PRINTED = "fr/done", "fr/printed"


def _hb(rank: int) -> str:
    return f"fr/hb/{rank}"


def _host_key(host: str) -> str:
    return f"fr/host/{host}"
