"""The hang watch (hybrid/diagnostics/watch.py): on a backend whose collectives return
before they complete (NCCL), the heartbeat reports one still running past the timeout,
with the same report as a failed collective, and ends the process by default."""

import dataclasses
import datetime
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from hybrid.diagnostics.recorder import FlightRecorder, backstop
from hybrid.diagnostics.watch import PendingWatch
from tests.diagnostics.test_diagnostics import _line_of
from tests.helpers.harness import run_ranks


class _Work:
    """A backend handle that completes when the test says so."""

    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


@dataclasses.dataclass
class _Entry:
    group: object
    seq: int
    state: str = "issued"


def test_pending_holds_only_collectives_in_flight_and_names_the_oldest():
    watch = PendingWatch()
    tp, dp = (type("G", (), {"name": n})() for n in ("tp", "dp"))
    works = {}
    for seq in range(1, 4):  # dp #1, tp #1, dp #2, tp #2, ...
        for g in (dp, tp):
            e = _Entry(g, seq)
            works[(g.name, seq)] = (e, _Work())
            watch.add(e, works[(g.name, seq)][1])
            time.sleep(0.002)
    assert len(watch) == 6
    assert watch.oldest()[0] is works[("dp", 1)][0]
    # a group completes in issue order: dp #1 done leaves tp #1 as the oldest
    works[("dp", 1)][1].done = True
    e, since = watch.oldest()
    assert e is works[("tp", 1)][0] and works[("dp", 1)][0].state == "done"
    assert len(watch) == 5 and since <= time.time()
    # the next collective of a group drops the finished ones first: no growth with steps
    for seq in range(1, 4):
        works[("tp", seq)][1].done = True
    e4 = _Entry(tp, 4)
    watch.add(e4, _Work())
    assert len(watch) == 3  # dp #2, dp #3, tp #4
    assert watch.oldest()[0] is works[("dp", 2)][0]
    for seq in (2, 3):
        works[("dp", seq)][1].done = True
    assert watch.oldest()[0] is e4
    assert all(works[k][0].state == "done" for k in works)


def test_the_backstop_outlasts_noticing_agreeing_and_printing():
    for minutes in (0.05, 1, 10, 60):
        timeout = datetime.timedelta(minutes=minutes)
        rec = FlightRecorder(0, 2, None, timeout, watch=True)
        hb, store = rec.heartbeat_s, rec.store_timeout.total_seconds()
        # notice (one period) + read fresh records + a pointer rank's longest wait
        protocol = hb + rec.answer_s + (4 * hb + 2 * store + 2.0)
        assert backstop(timeout).total_seconds() > rec.timeout_s + protocol, minutes


# -- on two ranks, as NCCL does it: the call returns, the host waits elsewhere -----------

def _watching(ps, timeout_s):
    """``ps`` with a fresh watching recorder over the same groups, on a store of its own
    (rank 0 serves it; the port goes round on the pool's world group)."""
    from hybrid.parallel.comm import CommGroup, CommStats

    port, server = torch.tensor([0]), None
    if ps.rank == 0:
        server = dist.TCPStore("127.0.0.1", 0, ps.world_size, True, wait_for_workers=False)
        port[0] = server.port
    ps.world_group.broadcast(port)
    store = server or dist.TCPStore("127.0.0.1", int(port), ps.world_size, False)
    rec = FlightRecorder(ps.rank, ps.world_size, store,
                         datetime.timedelta(seconds=timeout_s), watch=True)
    stats = CommStats()

    def fresh(g):
        return CommGroup(g.name, g.pg, g.ranks, g.global_rank, stats, g.timeout, rec)

    out = dataclasses.replace(ps, tp_group=fresh(ps.tp_group), dp_group=fresh(ps.dp_group),
                              world_group=fresh(ps.world_group), comm_stats=stats,
                              recorder=rec)
    rec.start()
    return out, store


def _queued_then_host_wait(ps):
    """Rank 0's all-reduce returns queued and rank 0 goes on to wait on the host (as at
    a loss read on NCCL); rank 1 sleeps in Python past the 1.5 s timeout, then joins."""
    w, store = _watching(ps, 1.5)
    hangs = []

    def on_hang(err):
        hangs.append((time.time(), str(err), err.reporter))
        err.reported()

    w.recorder.on_hang = on_hang
    t0 = time.time()
    if ps.rank == 1:
        time.sleep(3.5)  # ASLEEP
    work = w.world_group.all_reduce(torch.ones(4), async_op=True)  # QUEUED
    if ps.rank == 0:
        time.sleep(4.0)  # the host waits for the device
    work.wait()
    w.world_group.all_reduce(torch.ones(4))  # completes: nothing more to report
    time.sleep(2 * w.recorder.heartbeat_s)
    pending = len(w.recorder.watch)
    w.recorder.close()
    ps.world_group.all_reduce(torch.ones(1))  # rank 0's store outlives rank 1's use
    del store
    return [(t - t0, msg, rep) for t, msg, rep in hangs], pending


@pytest.mark.usefixtures("hang_alone")  # its process waits out its timeout meanwhile
def test_a_collective_queued_past_the_timeout_is_reported_by_the_heartbeat():
    res = run_ranks(_queued_then_host_wait, world_size=2)
    (hangs0, pending0), (hangs1, pending1) = res
    assert hangs1 == [] and pending0 == pending1 == 0
    assert len(hangs0) == 1, hangs0  # once, though it stayed queued for 3.5 s
    took, msg, reporter = hangs0[0]
    assert reporter and 1.5 <= took < 3.0, took
    here = "tests/diagnostics/test_watch.py:{} in _queued_then_host_wait"
    assert msg.startswith(
        "rank 0: all_reduce #1 of the world group (global ranks [0, 1]) did not complete "
        "(timeout 1.5 s; still running "), msg
    assert f"\n  it was called at {here.format(_line_of(_queued_then_host_wait, '# QUEUED'))}" \
        in msg, msg
    assert "\n  rank 1 never reached it.\n" in msg, msg
    asleep = here.format(_line_of(_queued_then_host_wait, "# ASLEEP"))
    assert "\n  rank 1: it is alive (heartbeat " in msg and f" and at {asleep}, with " in msg, msg
    assert msg.endswith("\n  stuck: rank 1."), msg


# -- by default the process ends with the report -------------------------------------------

_ALONE = textwrap.dedent("""
    import datetime, time, types
    import torch, torch.distributed as dist
    from hybrid.diagnostics.recorder import FlightRecorder

    class Never:
        def is_completed(self):
            return False

    def train(rec, group):
        e = rec.issue(group, "all_reduce", torch.ones(3))
        rec.watch.add(e, Never())

    def main():
        rec = FlightRecorder(0, 2, dist.HashStore(), datetime.timedelta(seconds=1), watch=True)
        group = types.SimpleNamespace(name="dp", ranks=[0, 1], seq=0)
        rec.register(group)
        train(rec, group)
        rec.start()
        time.sleep(60)
        print("still here")

    main()
""")


@pytest.fixture(scope="module")
def hang_alone():
    """The process of :data:`_ALONE`, started when the heartbeat test above starts: both
    mostly wait (on a timeout, on sleeping ranks), so they wait side by side. Its
    (process, start time); killed at the module's end if no test read it."""
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-c", _ALONE], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    yield p, t0
    if p.poll() is None:
        p.kill()
        p.communicate()


def test_by_default_a_hang_ends_the_process_with_the_report(hang_alone):
    p, t0 = hang_alone
    try:
        out, err = p.communicate(timeout=max(1.0, t0 + 60 - time.time()))
    finally:
        if p.poll() is None:
            p.kill()
    took = time.time() - t0
    assert p.returncode == 2 and "still here" not in out, (p.returncode, err)
    assert took < 30, took
    assert err.startswith("rank 0: all_reduce #1 of the dp group (global ranks [0, 1]) did not "
                          "complete (timeout 1 s; still running "), err
    assert "\n  rank 1: published no record (it may have died before its first collective)." \
        in err and "\n  stuck: rank 1." in err, err
