"""When a run goes wrong, it says where: a stuck rank, a mismatched collective, a drifted
replica, a non-finite step, a straggler (hybrid/diagnostics/)."""

import inspect
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hybrid.config import build_config, parse_args
from hybrid.diagnostics import report
from hybrid.errors import ConfigError
from hybrid.parallel.comm import CollectiveError
from tests.helpers.harness import run_ranks
from tests.helpers.launch import TINY, _pretrain_rank, pretrain, read_json_log

TP2DP2 = TINY + ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"]


def _line_of(fn, marker: str) -> int:
    """The line of ``fn``'s source that carries ``marker`` (a comment)."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if marker in ln)


def _patched_train_step(ps, cfg, before=None, after=None):
    """_pretrain_rank with ``before(ps, step)`` / ``after(ps, step, model, engine)`` around each
    train_step; pooled workers are reused, so the patch is undone on the way out."""
    from hybrid.train import trainer as training
    orig = training.train_step
    count = [0]

    def step(model, engine, *args, **kwargs):
        count[0] += 1
        if before is not None:
            before(ps, count[0])
        out = orig(model, engine, *args, **kwargs)
        if after is not None:
            after(ps, count[0], model, engine)
        return out

    training.train_step = step
    try:
        return _pretrain_rank(ps, cfg)
    finally:
        training.train_step = orig


# -- 1. a stuck rank: one report naming it ----------------------------------------------

def _stop_rank3_at_step2(ps, cfg):
    """Rank 3 freezes itself (SIGSTOP) as iteration 2 starts (after a whole step, every
    group's collectives numbered past 1); every rank notes when it returns, rank 3 when
    it stopped (next to the dump directory)."""
    out_dir = os.path.dirname(cfg.diagnostics.collective_dump_dir)

    def before(ps, step):
        if step == 2 and ps.rank == 3:
            with open(os.path.join(out_dir, "stopped_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

    try:
        return _patched_train_step(ps, cfg, before=before)
    finally:
        with open(os.path.join(out_dir, f"returned_{ps.rank}"), "w") as f:
            f.write(repr(time.time()))


STOPPED_TIMEOUT_S = 3.0


def _stopped_rank_run(tmp_path):
    """The job of :func:`test_a_stopped_rank_is_named_once_with_where_it_was`, on fresh
    ranks: the stopped one is killed at the end, and its groups are broken."""
    return pretrain(4, TP2DP2 + ["--train-iters", "6", "--distributed-timeout-minutes",
                                 str(STOPPED_TIMEOUT_S / 60), "--collective-dump-dir",
                                 str(tmp_path / "dump")],
                    reuse=False, rank_fn=_stop_rank3_at_step2, grace_s=1.0)


def _asleep_and_gone_run():
    return run_ranks(_asleep_and_gone, world_size=3, tp=1, collective_timeout=3,
                     reuse=False, early_exit=lambda r: r is not None, grace_s=0)[0]


@pytest.fixture(scope="module")
def silent_ranks(tmp_path_factory):
    """The two jobs below whose ranks wait out a 3 s collective timeout, each on its own
    fresh processes: run side by side. (the stopped rank's job, its directory; the
    asleep-and-gone job's rank 0 result)."""
    tmp_path = tmp_path_factory.mktemp("stopped")
    with ThreadPoolExecutor(2) as pool:
        stopped = pool.submit(_stopped_rank_run, tmp_path)
        asleep = pool.submit(_asleep_and_gone_run)
        return {"stopped": (stopped.result(), tmp_path), "asleep": asleep.result()}


def test_a_stopped_rank_is_named_once_with_where_it_was(silent_ranks):
    timeout_s = STOPPED_TIMEOUT_S
    r, tmp_path = silent_ranks["stopped"]
    dump = str(tmp_path / "dump")
    assert r.returncode == 2
    err = r.stderr
    # one report, on rank 2 (rank 3's TP peer, the first to wait for it) ...
    assert len(re.findall(r"^pretrain_gpt\.py: error", err, re.M)) == 1, err
    assert err.startswith("pretrain_gpt.py: error (rank 2): rank 2: all_reduce #"), err
    head = err.splitlines()[0]
    assert "of the tp group (global ranks [2, 3]) did not complete (timeout 3 s; " in head, err
    assert "it was called at hybrid/tensor_parallel/mappings.py:" in err
    # ... naming rank 3, the collective it got through and that it went silent
    assert "\n  rank 3 never reached it; all got through #" in err, err
    assert re.search(r"\n  rank 3: no heartbeat for \d+\.\d s \(the process is stopped, dead, "
                     r"or hung holding the Python interpreter\); its last one had it ", err), err
    assert "\n  stuck: rank 3.\n" in err, err
    # the other live ranks point at it, one line each
    pointers = re.findall(r"^pretrain_gpt\.py: rank ([01]): .* failed too; see the collective "
                          r"report of rank 2$", err, re.M)
    assert sorted(pointers) == ["0", "1"], err
    # not before the timeout, and near it: not at the process groups' own (minutes) or
    # never (the bound is loose, for a loaded machine; a miss would take 100 timeouts)
    stopped = float((tmp_path / "stopped_at").read_text())
    took = float((tmp_path / "returned_2").read_text()) - stopped
    assert timeout_s <= took < 10 * timeout_s, took
    # every live rank's ring on disk; the reporter's ends with the failed collective
    files = sorted(os.listdir(dump))
    assert files == [f"collectives_rank{r:05d}.json" for r in range(3)], files
    ring = json.loads((tmp_path / "dump" / "collectives_rank00002.json").read_text())
    last = ring["collectives"][-1]
    assert (last["group"], last["ranks"], last["op"], last["state"]) == \
        ("tp", [2, 3], "all_reduce", "failed")
    assert f"all_reduce #{last['seq']} of the tp group" in head
    assert ring["failed"]["seq"] == last["seq"]
    issued = {}  # per group, the last number issued (numbers start at 1)
    for e in ring["collectives"]:
        issued[e["group"]] = max(issued.get(e["group"], 0), e["seq"])
    assert len(ring["collectives"]) == min(64, sum(issued.values()))  # the last 64 at most
    seqs = [e["seq"] for e in ring["collectives"] if e["group"] == "tp"]
    assert seqs == list(range(seqs[0], last["seq"] + 1))  # numbered per group, none lost


def _asleep_and_gone(ps):
    """World all-reduce #2: rank 1 is asleep in Python, rank 2 skipped it and returned."""
    ps.world_group.all_reduce(torch.ones(4))  # FIRST
    if ps.rank == 1:
        time.sleep(8)  # ASLEEP
        return None
    if ps.rank == 2:
        return None  # skips the next collective and leaves
    try:
        ps.world_group.all_reduce(torch.ones(4))  # WAITS
    except CollectiveError as e:
        e.reported()
        return str(e), e.reporter
    return "no error"


def test_a_live_peer_and_one_that_left_are_named_with_their_lines(silent_ranks):
    msg, reporter = silent_ranks["asleep"]
    from hybrid.testing import worker as multiprocess_worker
    at = "tests/diagnostics/test_diagnostics.py:{} in _asleep_and_gone"
    line = _line_of(multiprocess_worker.worker_main, 'out = fn(ps')
    via = f"(via hybrid/testing/worker.py:{line} in worker_main)"
    first = at.format(_line_of(_asleep_and_gone, "# FIRST"))
    last = rf"the last: all_reduce #1 of the world group \(global ranks \[0, 1, 2\]\) at {first} " \
        + re.escape(via)
    assert reporter
    head, rest = msg.split(")\n", 1)
    assert head.startswith("rank 0: all_reduce #2 of the world group (global ranks [0, 1, 2]) "
                           "did not complete (timeout 3 s; Timed out waiting 3000ms for "), msg
    assert rest.startswith(
        f"  it was called at {at.format(_line_of(_asleep_and_gone, 'WAITS'))} {via} on a (4,) "
        f"float32 tensor\n  ranks 1, 2 never reached it; all got through #1, all_reduce at "
        f"{first} {via}.\n"), msg
    assert re.search(
        rf"\n  rank 1: it is alive \(heartbeat \d+\.\d s ago\) and at "
        rf"{at.format(_line_of(_asleep_and_gone, 'ASLEEP'))}, with no collective for \d+\.\d s "
        rf"\({last}\)\.\n  rank 2: it finished and left the job, with no collective for "
        rf"\d+\.\d s \({last}\)\.\n  stuck: rank 1\.\n  left early: rank 2\.$", msg), msg


def _record(rank, groups, t, waiting=None, failed=None, alarm=1, where=None):
    return {"rank": rank, "t": t, "heartbeat_s": 0.5, "alarm": alarm, "where": where,
            "waiting": waiting, "failed": failed,
            "groups": {name: {"ranks": ranks, "seq": seq,
                              "last": {"seq": seq, "group": name, "ranks": ranks,
                                       "op": "all_reduce", "caller": f"{name}.py:{seq}",
                                       "t": t - (1 if name == "tp" else 2), "shape": [4],
                                       "dtype": "float32"},
                              "prev": None}
                       for name, (ranks, seq) in groups.items()}}


def test_the_report_follows_a_blocked_rank_to_the_stuck_one():
    """Rank 0 waits in dp #12 for rank 2, which waits in tp #57 for rank 3, silent."""
    now = 1000.0
    recs = {0: _record(0, {"dp": ([0, 2], 12), "tp": ([0, 1], 60)}, now,
                       failed={"group": "dp", "seq": 12}),
            2: _record(2, {"dp": ([0, 2], 11), "tp": ([2, 3], 57)}, now,
                       waiting={"group": "tp", "seq": 57, "since": now - 4}),
            3: _record(3, {"dp": ([1, 3], 11), "tp": ([2, 3], 56)}, now - 9, alarm=0,
                       where="hybrid/train/step.py:40 in train_step")}
    failing = recs[0]["groups"]["dp"]["last"]
    reads = []

    def read(ranks):
        reads.append(list(ranks))
        return {r: recs[r] for r in ranks if r in recs}

    msg = report.explain("HEAD", failing, recs[0], read, None, now=now)
    # O(group size) per group followed, and one peer of each group of the silent rank that
    # none of those is in (rank 3's dp group: did it see rank 3 later than its record?)
    assert reads == [[0, 2], [2, 3], [1]]
    assert msg.splitlines() == [
        "HEAD",
        "  rank 2 never reached it; all got through #11, all_reduce at dp.py:11.",
        "  rank 2 is blocked in all_reduce #57 of the tp group (global ranks [2, 3]) at "
        "tp.py:57 for 4.0 s.",
        "  rank 3 never reached it; all got through #56, all_reduce at tp.py:56.",
        "  rank 3: no heartbeat for 9.0 s (the process is stopped, dead, or hung holding the "
        "Python interpreter); its last one had it at hybrid/train/step.py:40 in train_step "
        "with no collective for 1.0 s (the last: all_reduce #56 of the tp group (global "
        "ranks [2, 3]) at tp.py:56).",
        "  stuck: rank 3."]
    assert report.rank_list([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7, 8"


def _entry(group, ranks, seq, t, op="all_reduce", state="done", caller=None):
    return {"seq": seq, "group": group, "ranks": ranks, "op": op, "shape": [4],
            "dtype": "float32", "caller": caller or f"{group}.py:{seq}", "t": t, "state": state}


def _host_record(rank, host, t, groups, alarm=1, failed=None, where=None):
    """A record as FlightRecorder.record() writes it; ``groups``: name -> (ranks, [last
    entry, the one before])."""
    return {"rank": rank, "t": t, "host": host, "heartbeat_s": 30.0, "alarm": alarm,
            "where": where, "waiting": None, "failed": failed, "closed": False,
            "groups": {name: {"ranks": ranks, "seq": es[0]["seq"] if es else 0,
                              "last": es[0] if es else None,
                              "prev": es[1] if len(es) > 1 else None}
                       for name, (ranks, es) in groups.items()}}


def test_a_node_whose_ranks_all_went_silent_is_named_once_with_where_each_was_last_seen():
    """TP 2 x DP 2 on hosts n0 (ranks 0, 1) and n1 (ranks 2, 3); n1 dies in iteration 6, and
    ranks 0 and 1 fail in dp #16. Ranks 2 and 3 last published at start (one record per
    30 s heartbeat): where they were last seen comes from what their peers completed with
    them, the newest of it (the world all-gather after dp #15), not from that record."""
    now, world = 1000.0, [0, 1, 2, 3]

    def failed_in_dp16(rank, host, tp, dp, t_world):
        return _host_record(rank, host, now, {
            "tp": (tp, [_entry("tp", tp, 40, now - 3.3)]),
            "dp": (dp, [_entry("dp", dp, 16, now - 0.1, state="failed"),
                        _entry("dp", dp, 15, now - 3.2, caller="metrics.py:59")]),
            "world": (world, [_entry("world", world, 23, t_world, op="all_gather",
                                     caller="stragglers.py:26")])},
            failed={"group": "dp", "seq": 16})

    def at_start(rank, tp, dp):
        return _host_record(rank, "n1", now - 5, {"tp": (tp, []), "dp": (dp, []),
                                                  "world": (world, [])},
                            alarm=0, where="hybrid/parallel/state.py:149 in build")

    recs = {0: failed_in_dp16(0, "n0", [0, 1], [0, 2], now - 3.1),
            1: failed_in_dp16(1, "n0", [0, 1], [1, 3], now - 3.0),
            2: at_start(2, [2, 3], [0, 2]), 3: at_start(3, [2, 3], [1, 3])}
    hosts = {"n0": [0, 1], "n1": [2, 3]}
    failing = recs[0]["groups"]["dp"]["last"]

    def explain(recs):
        reads = []

        def read(ranks):
            reads.append(list(ranks))
            return {r: recs[r] for r in ranks if r in recs}
        return report.explain("HEAD", failing, recs[0], read, None, now=now,
                              host_ranks=hosts.get).splitlines(), reads

    lines, reads = explain(recs)
    world_ag = "all_gather #23 of the world group (global ranks [0, 1, 2, 3]) at stragglers.py:26"
    assert lines == [
        "HEAD",
        "  rank 2 never reached it; all got through #15, all_reduce at metrics.py:59.",
        "  node n1 (ranks 2, 3) lost: no heartbeat from any of its ranks since the failure "
        "(the processes died or are stopped, or the host is unreachable).",
        f"    rank 2: last seen 3.1 s ago, getting through {world_ag}.",  # (rank 0's record)
        f"    rank 3: last seen 3.0 s ago, getting through {world_ag}.",  # (rank 1's, later)
        "  lost: node n1 (ranks 2, 3)."]
    # the failing group, the silent rank's host-mates, one peer of rank 3's dp group
    assert reads == [[0, 2], [3], [1]]

    # rank 3 alive: no node is lost; rank 2 alone is silent, seen later by its peers
    recs[3] = failed_in_dp16(3, "n1", [2, 3], [1, 3], now - 2.9)
    lines, _ = explain(recs)
    assert lines == [
        "HEAD",
        "  rank 2 never reached it; all got through #15, all_reduce at metrics.py:59.",
        "  rank 2: no heartbeat for 5.0 s (the process is stopped, dead, or hung holding the "
        "Python interpreter); its last one had it at hybrid/parallel/state.py:149 in build "
        f"with no collective since it started; its peers saw it later, getting through "
        f"{world_ag}, 2.9 s ago.",
        "  stuck: rank 2."]


# -- 2. --check-collectives ------------------------------------------------------------

def _op_mismatch(ps):
    ps.recorder.configure(check_collectives=True)
    x = torch.full((8,), float(ps.rank))
    ps.world_group.all_reduce(x)  # agreed: it runs
    assert x.tolist() == [6.0] * 8
    try:
        if ps.rank == 3:
            ps.world_group.all_gather(torch.zeros(8), torch.zeros(2))  # ODD
        else:
            ps.world_group.all_reduce(torch.zeros(8))  # MAJORITY
    except CollectiveError as e:
        e.reported()
        return str(e), e.reporter
    return None, None


def _skipped_one(ps):
    ps.recorder.configure(check_collectives=True)
    try:
        if ps.rank != 3:
            ps.world_group.all_reduce(torch.zeros(8))  # MAJORITY
        ps.world_group.all_reduce(torch.zeros(8))  # ODD
    except CollectiveError as e:
        e.reported()
        return str(e), e.reporter
    return None, None


@pytest.mark.parametrize("fn,seq,odd_call,major_call", [
    (_op_mismatch, 2, "all_gather #2 (8,) float32", "all_reduce #2 (8,) float32 sum"),
    (_skipped_one, 1, "all_reduce #1 (8,) float32 sum", "all_reduce #1 (8,) float32 sum")],
    ids=["op", "skipped"])
def test_check_collectives_names_both_callers(fn, seq, odd_call, major_call):
    from hybrid.testing import worker as multiprocess_worker
    res = run_ranks(fn, world_size=4, tp=1)  # stops before the real collective: reusable
    here = "tests/diagnostics/test_diagnostics.py"
    line = _line_of(multiprocess_worker.worker_main, 'out = fn(ps')
    via = f"(via hybrid/testing/worker.py:{line})"
    want = (f"collective mismatch in the world group (global ranks [0, 1, 2, 3]): rank 3 "
            f"calls {odd_call} at {here}:{_line_of(fn, '# ODD')} {via} where ranks 0-2 call "
            f"{major_call} at {here}:{_line_of(fn, '# MAJORITY')} {via}")
    reporters = [r for r, (_, rep) in enumerate(res) if rep]
    assert len(reporters) == 1, res
    assert res[reporters[0]][0] == want
    for r, (msg, rep) in enumerate(res):
        if not rep:
            assert msg == (f"rank {r}: collective mismatch; see the report of rank "
                           f"{reporters[0]}")


# -- 3. --check-replicas-interval ------------------------------------------------------

def _perturb_rank3_after_step2(ps, cfg):
    """Rank 3 nudges one element of its copy of a TP-replicated parameter: a whole one
    (ZeRO-0: blocks.0.ln_1.weight) or, at ZeRO-3, its shard of a partitioned one."""
    def after(ps, step, model, engine):
        if step != 2 or ps.rank != 3:
            return
        with torch.no_grad():
            if engine.plan.stage == 0:
                dict(model.named_parameters())["blocks.0.ln_1.weight"][5] += 1e-3
                return
            pc = next(pc for pc in engine.owned_pieces() if pc.param is model.wpe.weight)
            u = engine.units[pc.unit]
            if u.home is None:
                u.shard[pc.part][0] += 1e-3
                return
            values = u.shard_values().clone()  # --offload-param: the drift is in its home
            values[pc.part.start] += 1e-3
            done = u.home.store(values)
            if done is not None:
                done.synchronize()

    return _patched_train_step(ps, cfg, after=after)


TP_DRIFT = ("1 of 15 TP-replicated parameters differ across the tp group (global ranks [2, 3]): "
            "{} (rank 2 / rank 3 hold different values)")


@pytest.mark.parametrize("zero,message", [
    (["--zero-stage", "0"],
     TP_DRIFT.format("blocks.0.ln_1.weight") + "; 1 of 28 DP-replicated parameters differ "
     "across the dp group (global ranks [1, 3]): blocks.0.ln_1.weight (rank 1 / rank 3 hold "
     "different values)"),
    (["--zero-stage", "3", "--zero-param-persistence-threshold", "1000"],
     TP_DRIFT.format("wpe.weight")),
    (["--zero-stage", "3", "--zero-param-persistence-threshold", "1000", "--offload-optimizer",
      "cpu", "--offload-param", "nvme", "--offload-nvme-path", "{tmp}"],
     TP_DRIFT.format("wpe.weight"))], ids=["zero0", "zero3-shard", "zero3-param-nvme"])
def test_replica_check_names_the_drifted_parameter_and_ranks(zero, message, tmp_path):
    # Checked every step: the check after step 1 passes, the one after step 2 sees rank 3's
    # drift before the next step spreads it (through the DP reduction, its TP peer's
    # gradients reach ranks 0 and 1). At ZeRO-0 every rank updates its own full copy; at
    # ZeRO-3 the TP peers' shards of a partitioned replicated parameter are compared.
    # (with --offload-param nvme the shards are read from each rank's params.swp)
    zero = [a.format(tmp=tmp_path) for a in zero]
    r = pretrain(4, TP2DP2 + ["--train-iters", "4", "--check-replicas-interval", "1", *zero],
                 rank_fn=_perturb_rank3_after_step2)
    assert r.returncode == 2
    assert r.stderr == (
        "pretrain_gpt.py: error: replica check at iteration 2 (--check-replicas-interval): "
        f"{message}. The copies diverged since the last check; stopping without saving\n"), \
        r.stderr
    assert "iteration        2/" in r.stdout and "iteration        3/" not in r.stdout


# -- 4. non-finite steps -----------------------------------------------------------------

def _nonfinite_steps(ps, cfg):
    """Step 2: an infinite loss (finite gradients) in DP rank 1's second micro-batch.
    Steps 4, 5: NaN gradients in one parameter, on DP rank 0."""
    handles = []

    def before(ps, step):
        from models.gpt import GPT
        if step == 2 and ps.dp_rank == 1:
            calls = [0]
            orig = GPT.forward

            def forward(self, tokens, labels=None):
                calls[0] += 1
                out = orig(self, tokens, labels)
                return out + float("inf") if calls[0] == 2 else out  # d/dparams unchanged

            GPT.forward = forward
            handles.append(lambda: setattr(GPT, "forward", orig))

    def after(ps, step, model, engine):
        while handles:
            handles.pop()()
        if step in (3, 4) and ps.dp_rank == 0:  # hooks for steps 4 and 5
            p = dict(model.named_parameters())["blocks.1.mlp.fc.bias"]
            h = p.register_hook(lambda g: g * float("nan"))
            handles.append(h.remove)

    try:
        return _patched_train_step(ps, cfg, before=before, after=after)
    finally:
        while handles:
            handles.pop()()


def test_nonfinite_steps_say_which_micro_batch_and_parameters(tmp_path):
    path = str(tmp_path / "log.jsonl")
    r = pretrain(2, TINY + ["--global-batch-size", "8", "--train-iters", "6",
                            "--exit-on-nan-iterations", "2", "--log-json", path],
                 rank_fn=_nonfinite_steps)
    assert r.returncode == 2, r.stderr
    log = read_json_log(path)
    # the infinite loss skipped step 2 although every gradient was finite
    assert [m["skipped_iterations"] for m in log] == [0, 1, 1, 2]
    assert torch.isfinite(torch.tensor(log[1]["grad_norm"])) and log[1]["loss"] == float("inf")
    # samples: step 2 starts at 8; DP rank 1 holds 12-15, its micro-batch 1 is 14-15
    assert ("iteration 2 skipped (loss scale now 1.0): non-finite loss in micro-batch 1 of DP "
            "rank 1 (samples 14-15, rank 1); every gradient finite\n") in r.stdout, r.stdout
    assert ("iteration 4 skipped (loss scale now 1.0): every micro-batch loss finite; "
            "non-finite gradients in 1 parameter: blocks.1.mlp.fc.bias\n") in r.stdout
    assert r.stderr == (
        "pretrain_gpt.py: error: loss or gradients were not finite for 2 consecutive "
        "iterations (up to 5; at 5: every micro-batch loss finite; non-finite gradients in 1 "
        "parameter: blocks.1.mlp.fc.bias); stopping without saving. Lower --lr, raise "
        "--clip-grad's strictness, or check the data (--exit-on-nan-iterations sets the "
        "patience)\n")


# -- 5. stragglers, and every check passing on a clean run -------------------------------

# Rank 1's extra work each step: far beyond the noise of a loaded 2-core machine, where
# 4 ranks' own busy times differ by a tenth of a second or more.
STRAGGLE_S = 1.0


def _rank1_slow(ps, cfg):
    def before(ps, step):
        if ps.rank == 1:
            time.sleep(STRAGGLE_S)  # outside any collective: the others wait for it

    return _patched_train_step(ps, cfg, before=before)


def test_straggler_fields_and_a_clean_run_under_every_check(tmp_path):
    path = str(tmp_path / "log.jsonl")
    # (the replica check reads the ZeRO-3 shards from their host homes here)
    # (two steps: each log line is checked, the first and one after it)
    r = pretrain(4, TP2DP2 + ["--train-iters", "2", "--zero-stage", "3",
                              "--zero-param-persistence-threshold", "1000",
                              "--offload-optimizer", "cpu", "--offload-param", "cpu",
                              "--check-collectives", "--check-replicas-interval", "1",
                              "--log-json", path], rank_fn=_rank1_slow)
    assert r.returncode == 0, r.stderr
    log = read_json_log(path)
    assert len(log) == 2, log
    for m in log:
        assert m["busy_time_max_rank"] == 1, m
        # the sleep counts in rank 1's busy time and in no one else's
        assert m["busy_time_max_s"] - m["busy_time_min_s"] >= STRAGGLE_S / 2, m
        assert m["step_time_min_s"] <= m["step_time_s"] <= m["step_time_max_s"]
        assert m["step_time_max_s"] >= STRAGGLE_S and \
            m["busy_time_max_s"] <= m["step_time_max_s"]
        assert m["step_time_min_rank"] in range(4) and m["busy_time_min_rank"] != 1
    assert re.search(r"busy time min/max \(ms\): \d+\.\d \(rank [023]\) / \d+\.\d \(rank 1\)",
                     r.stdout), r.stdout


def test_bad_interval_is_named():
    with pytest.raises(ConfigError, match="--check-replicas-interval must be >= 0"):
        build_config(parse_args(TINY + ["--check-replicas-interval", "-1"]), 1)
