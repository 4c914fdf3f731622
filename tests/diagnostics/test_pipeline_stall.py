"""A stuck pipeline is one report naming the stage, the action and the micro-batch: on
the rank that waits, its exchange in words and where its other end is; on a rank that
failed too, a pointer naming its own. Fresh ranks with a 2 s collective timeout: no hang."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hybrid.errors import CollectiveError
from tests.helpers.harness import run_ranks


def _stage(ps, lists, stop_at):
    """A 2-stage pipeline of one weight each running ``lists[rank]`` (text forms); stage
    0's forward of micro-batch ``stop_at`` stops sending (sleeps past the timeout)."""
    from hybrid.pipeline.actions import parse_actions
    from hybrid.pipeline.executor import run_actions
    stage = ps.pp_group.rank
    w = torch.nn.Parameter(torch.ones(4))
    # A process's first backward with given gradients imports torch's symbolic shapes
    # (sympy: 0.6 s on idle cores, past the 2 s timeout on loaded ones). Done here, before
    # the pipeline, so rank 0 is found in its stalled forward, not in B0's import.
    torch.autograd.backward([torch.ones(1, requires_grad=True) * 2], [torch.ones(1)])

    def forward(s, j, x):
        if s == 0:
            if j == stop_at:
                time.sleep(4)  # STOPS
            return (w * (j + 1)).reshape(1, 4)
        return (x * w).sum()

    try:
        run_actions(parse_actions(lists[stage]), forward, {stage: [w]}, ps.pp_group,
                    shape=(1, 4), dtype=torch.float32, device=torch.device("cpu"), stages=2)
    except CollectiveError as e:
        e.reported()
        return str(e), e.reporter
    return None


def _run(lists, stop_at=-1):
    return run_ranks(_stage, world_size=2, pp=2, args=(lists, stop_at), collective_timeout=2,
                     reuse=False, early_exit=lambda r: r is not None and r[1], grace_s=0)


ONE_F_ONE_B = ("F0.s0 SA0.s0>1 F1.s0 SA1.s0>1 RG0.s0<1 B0.s0 F2.s0 SA2.s0>1 RG1.s0<1 B1.s0 "
               "RG2.s0<1 B2.s0 END",
               "RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 RA1.s1<0 F1.s1 B1.s1 SG1.s1>0 RA2.s1<0 F2.s1 "
               "B2.s1 SG2.s1>0 END")


# The two stuck pipelines below, each its own fresh ranks waiting out a 2 s timeout:
# run side by side (their pools share nothing), each with its wall time.
STUCK = {"stops_sending": (ONE_F_ONE_B, 2), "wait_for_each_other": (("RG0.s0<1 END",
                                                                     "RA0.s1<0 END"), -1)}


def _timed(lists, stop_at):
    t0 = time.perf_counter()
    return _run(lists, stop_at), time.perf_counter() - t0


@pytest.fixture(scope="module")
def stuck():
    with ThreadPoolExecutor(len(STUCK)) as pool:
        futures = {name: pool.submit(_timed, *args) for name, args in STUCK.items()}
        return {name: f.result() for name, f in futures.items()}


def test_a_stage_that_stops_sending_is_named_by_the_one_waiting(stuck):
    (first, last), took = stuck["stops_sending"]
    assert took < 30
    assert first is None  # stopped by the job once rank 1 reported
    msg, reporter = last
    assert reporter
    assert msg.startswith(
        "rank 1: pipeline stuck at RA2.s1<0, receiving stage 1's input for micro-batch 2 from "
        "stage 0 (global rank 0): p2p #"), msg
    assert " of the pp group (global ranks [0, 1]) did not complete (timeout 2 s; " in msg
    assert "\n  its other end is rank 0.\n" in msg
    # rank 0 is alive, in its forward of micro-batch 2; its last exchange received RG0
    assert re.search(r"\n  rank 0: it is alive \(heartbeat \d+\.\d s ago\) and at "
                     r"tests/diagnostics/test_pipeline_stall\.py:\d+ in forward, .*the last: "
                     r"RG0\.s0<1 #\d+ of the pp group", msg), msg
    assert msg.endswith("stuck: rank 0."), msg


def test_two_stages_waiting_for_each_other_give_one_report_and_a_pointer(stuck):
    # both receive first: a deadlock the simulator would refuse, run here on purpose
    res, _ = stuck["wait_for_each_other"]
    reports = [r for r in res if r is not None and r[1]]
    pointers = [r for r in res if r is not None and not r[1]]
    assert len(reports) == 1, res
    msg = reports[0][0]
    words = {0: "RG0.s0<1, receiving the gradient of stage 0's output for micro-batch 0 from "
                "stage 1 (global rank 1)",
             1: "RA0.s1<0, receiving stage 1's input for micro-batch 0 from stage 0 "
                "(global rank 0)"}
    me = int(msg.split(":", 1)[0].split()[1])
    other = 1 - me
    assert msg.startswith(f"rank {me}: pipeline stuck at {words[me]}: p2p #1 of the pp group"), msg
    assert f"  rank {other} is blocked in pipeline stuck at {words[other]}" in msg \
        or f"  rank {other} failed in pipeline stuck at {words[other]}" in msg, msg
    assert (f"its other end is rank {me}, this rank, blocked in the exchange above: rank "
            f"{other} and this rank wait for each other.") in msg, msg
    for text, _ in pointers:  # the other rank, if the job let it say it: its own action
        assert text.startswith(f"rank {other}: pipeline stuck at {words[other]}: p2p #1"), text
        assert text.endswith(f"failed too; see the collective report of rank {me}"), text


def _entry(seq: int, state: str, heard: list[int]) -> dict:
    """A flight-recorder entry of rank 0's exchange with rank 1 in the pp group [0, 1]."""
    return {"seq": seq, "group": "pp", "ranks": [0, 1], "op": f"X{seq}", "shape": [4],
            "dtype": "float32", "caller": "here", "t": 100.0 + seq, "state": state,
            "peers": [1], "heard": heard}


def test_a_silent_rank_is_seen_in_a_receive_from_it_not_in_a_send_to_it():
    """Where the report last saw a silent rank 1 (hybrid.diagnostics.report): rank 0's
    completed exchange #5 with it is a sighting when #5 received from rank 1 (rank 1 got
    through its send), and none when #5 only sent to it (the bytes may sit in a buffer
    while rank 1 is stopped). Every exchange the door records carries its receive peers
    (``heard``)."""
    from hybrid.diagnostics.report import _later_collective
    silent = {"groups": {"pp": {"ranks": [0, 1], "seq": 4, "last": None, "prev": None}}}
    for heard, seen in (([], None), ([1], 5)):
        peer = {"groups": {"pp": {"ranks": [0, 1], "seq": 6, "last": _entry(6, "issued", [1]),
                                  "prev": _entry(5, "done", heard)}}}
        got = _later_collective(1, silent, {0: peer, 1: silent}, lambda ranks: None)
        assert (got and got["seq"]) == seen, (heard, got)


def _exchange_entries(ps):
    """This rank's recorded entries of one exchange each way with the other rank."""
    other = 1 - ps.rank
    a, b = torch.zeros(2), torch.zeros(2)
    ps.world_group.exchange([(a, other)], [(b, other)], "both")
    ps.world_group.exchange([(a, other)] if ps.rank == 0 else [],
                            [(b, other)] if ps.rank == 1 else [], "one way")
    return [e.to_dict() for e in list(ps.recorder.ring)[-2:]]


def test_the_door_records_whom_an_exchange_hears_from():
    for rank, (both, one_way) in enumerate(run_ranks(_exchange_entries, world_size=2)):
        assert both["peers"] == both["heard"] == [1 - rank], both
        assert one_way["peers"] == [1 - rank], one_way
        assert one_way["heard"] == ([] if rank == 0 else [0]), one_way
