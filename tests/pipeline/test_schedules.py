"""The schedule generators and their simulator, torch-free.

What this proves:

* every generator's lists, for several (p, m, v), are complete and in dependency
  order, counted here without the simulator: each stage runs one forward and one
  backward (or input then weight half) of every micro-batch, each after what it
  reads; every send meets its receive, per pair of ranks in one order; and the
  simulator finds no deadlock;
* lists the executor could not run are refused, each with a message that names the
  rank, the action and what is wrong (a deadlock names every stuck rank);
* the simulator against the formulas, exactly (fractions): 1F1B and GPipe idle
  ``(p-1)/(m+p-1)`` of the step, interleaved 1F1B ``(p-1)/(v m+p-1)``, with a whole
  backward as long as a forward and with the paper's ``F = I = W``; ZB-H1, in the
  paper's setting ``F = I = W``, idles ``p - 1`` per rank, a third of 1F1B's
  ``3 (p - 1)`` (so at most 0.4x) at the same peak of held micro-batches (p); its bubble
  fraction is at most 0.4x 1F1B's once m >= 3 (p - 1); with other times its idle
  is the paper's ``(p-1)(F + I - W)``;
* 1F1B holds at most ``min(p - s, m)`` micro-batches on stage s;
* times given per (virtual) stage: equal ones play exactly as the single figure does
  (every case above), each stage's actions take its own, and a hand-checked 1F1B with
  its last stage twice as slow comes out as computed by hand;
* ``--pipeline-schedule``'s registry: names, interleaving from the virtual size,
  and the errors naming the flags.
"""

from __future__ import annotations

import itertools
from collections import Counter
from fractions import Fraction

import pytest

from hybrid.errors import ConfigError
from hybrid.pipeline.actions import (
    COMPUTE,
    RECVS,
    SENDS,
    Action,
    Kind,
    Schedule,
    matching_receive,
    parse_action,
    stage_rank,
)
from hybrid.pipeline.schedules import SCHEDULES, build_schedule, schedule_name
from hybrid.pipeline.simulator import ScheduleError, Times, simulate

SIZES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 3), (4, 2), (4, 8), (4, 12), (5, 7),
         (8, 16)]
CASES = ([(name, p, m, 1) for name in ("gpipe", "1f1b", "zb_h1") for p, m in SIZES]
         + [("interleaved_1f1b", p, m, v) for v in (2, 3) for p, m in SIZES if m % p == 0])
EQUAL = Times(1, 1, 1)  # the zero-bubble paper's setting: F = I = W (a whole backward 2F)
WHOLE_EQUAL = Times(2, 1, 1)  # a whole backward as long as a forward


def _ids(case):
    name, p, m, v = case
    return f"{name}-p{p}-m{m}-v{v}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_schedule_is_complete_ordered_matched_and_deadlock_free(case):
    name, p, m, v = case
    schedule = build_schedule(name, p, m, v)
    assert (schedule.p, schedule.m, schedule.v, len(schedule.ranks)) == (p, m, v, p)
    stages = p * v
    computes: Counter = Counter()
    for rank, actions in enumerate(schedule.ranks):
        assert actions[-1].kind is Kind.END and Kind.END not in [a.kind for a in actions[:-1]]
        seen: set[tuple[Kind, int, int]] = set()
        for a in actions[:-1]:
            assert stage_rank(a.stage, p) == rank, (rank, a)
            s, j = a.stage, a.microbatch
            remote_before = s > 0 and stage_rank(s - 1, p) != rank
            remote_after = s < stages - 1 and stage_rank(s + 1, p) != rank
            if a.kind is Kind.FORWARD:
                assert s == 0 or (Kind.RECV_ACT, s, j) in seen or (Kind.FORWARD, s - 1, j) in seen
            if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                assert (Kind.FORWARD, s, j) in seen
                assert s == stages - 1 or (Kind.RECV_GRAD, s, j) in seen or any(
                    (k, s + 1, j) in seen for k in (Kind.BACKWARD, Kind.BACKWARD_INPUT))
            if a.kind is Kind.BACKWARD_WEIGHT:
                assert (Kind.BACKWARD_INPUT, s, j) in seen
            if a.kind is Kind.SEND_ACT:
                assert remote_after and (Kind.FORWARD, s, j) in seen
            if a.kind is Kind.SEND_GRAD:
                assert remote_before and any(
                    (k, s, j) in seen for k in (Kind.BACKWARD, Kind.BACKWARD_INPUT))
            if a.kind in COMPUTE:
                computes[a.kind, s, j] += 1
            seen.add((a.kind, s, j))
    for s, j in itertools.product(range(stages), range(m)):
        assert computes[Kind.FORWARD, s, j] == 1
        split = (computes[Kind.BACKWARD_INPUT, s, j], computes[Kind.BACKWARD_WEIGHT, s, j])
        assert (computes[Kind.BACKWARD, s, j], *split) in ((1, 0, 0), (0, 1, 1)), (s, j)
    # every send meets one receive, and per ordered pair of ranks in the same order
    for src, dst in itertools.permutations(range(p), 2):
        sent = [matching_receive(a, src) for a in schedule.ranks[src]
                if a.kind in SENDS and a.peer == dst]
        taken = [a for a in schedule.ranks[dst] if a.kind in RECVS and a.peer == src]
        assert sent == taken, (src, dst)
    simulate(schedule)  # no ScheduleError: no deadlock


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_text_forms_read_back(case):
    schedule = build_schedule(*case)
    assert Schedule.from_text(schedule.name, schedule.p, schedule.m, schedule.v,
                              schedule.text()) == schedule


def test_the_text_form():
    assert str(Action(Kind.FORWARD, 1, 3)) == "F3.s1"
    assert str(Action(Kind.SEND_ACT, 1, 3, 2)) == "SA3.s1>2"
    assert str(Action(Kind.RECV_GRAD, 1, 3, 2)) == "RG3.s1<2"
    assert parse_action("W12.s7") == Action(Kind.BACKWARD_WEIGHT, 7, 12)
    assert parse_action("END").kind is Kind.END
    for wrong in ("F3", "SA3.s1", "F3.s1>2", "RA3.s1>2", "X3.s1"):
        with pytest.raises(ValueError, match="F3.s1"):
            parse_action(wrong)


# Hand-written lists that the executor could not run, and what the refusal says.
BROKEN = {
    "deadlock": (1, ["F0.s0 RG0.s0<1 SA0.s0>1 B0.s0 END",
                     "RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 END"],
                 ["deadlocks: no rank can go on",
                  "rank 0 #1 RG0.s0<1: waits for stage 0's output gradient for micro-batch 0 "
                  "from rank 1, which waits at #0 RA0.s1<0",
                  "rank 1 #0 RA0.s1<0: waits for stage 1's input for micro-batch 0 from rank 0"]),
    "out of order on a pair": (
        2, ["F0.s0 SA0.s0>1 F1.s0 SA1.s0>1 RG0.s0<1 B0.s0 RG1.s0<1 B1.s0 END",
            "RA1.s1<0 RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 F1.s1 B1.s1 SG1.s1>0 END"],
        ["rank 0: messages to rank 1 do not meet in order: its send #0 would "
         "meet RA0.s1<0, but rank 1's receive #0 from it is RA1.s1<0"]),
    "no END": (1, ["F0.s0 SA0.s0>1 RG0.s0<1 B0.s0", "RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 END"],
               ["rank 0: the list does not end with END"]),
    "another rank's stage": (1, ["F0.s1 END", "RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 END"],
                             ["rank 0 #0 F0.s1: stage 1 lives on rank 1"]),
    "backward first": (1, ["F0.s0 SA0.s0>1 RG0.s0<1 B0.s0 END",
                           "RA0.s1<0 B0.s1 SG0.s1>0 F0.s1 END"],
                       ["rank 1 #1 B0.s1: no F0.s1 before it"]),
    "no weight half": (1, ["F0.s0 SA0.s0>1 RG0.s0<1 I0.s0 END",
                           "RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 END"],
                       ["rank 0: never runs W0.s0"]),
    "wrong peer": (1, ["F0.s0 SA0.s0>0 RG0.s0<1 B0.s0 END", "RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 END"],
                   ["rank 0 #1 SA0.s0>0: the peer is rank 0, but stage 1 lives on rank 1"]),
    "no receive": (1, ["F0.s0 SA0.s0>1 RG0.s0<1 B0.s0 END", "F0.s1 B0.s1 SG0.s1>0 END"],
                   ["rank 1 #0 F0.s1: its input has not arrived: no RA0.s1 before it",
                    "rank 1 receives only 0 from it"]),
    "twice": (1, ["F0.s0 SA0.s0>1 RG0.s0<1 B0.s0 B0.s0 END",
                  "RA0.s1<0 F0.s1 B0.s1 SG0.s1>0 END"], ["rank 0 #4 B0.s0: done twice"]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_list_the_executor_could_not_run_is_refused_with_what_is_wrong(name):
    m, lines, says = BROKEN[name]
    with pytest.raises(ScheduleError) as caught:
        simulate(Schedule.from_text(name, 2, m, 1, lines))
    text = str(caught.value)
    assert text.startswith(f"schedule {name!r} (p=2, m={m}, v=1) ")
    for line in says:
        assert line in text, text


def test_a_generated_list_broken_by_one_swap_is_refused():
    """1F1B's rank 1 with a receive moved after the forward that needs it."""
    good = build_schedule("1f1b", 4, 8)
    rank1 = list(good.ranks[1])
    i = rank1.index(parse_action("RA3.s1<0"))
    rank1[i], rank1[i + 1] = rank1[i + 1], rank1[i]
    broken = Schedule("1f1b", 4, 8, 1, (good.ranks[0], tuple(rank1), *good.ranks[2:]))
    with pytest.raises(ScheduleError, match=r"rank 1 #\d+ F3.s1: its input has not arrived"):
        simulate(broken)


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_1f1b_and_gpipe_idle_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    for times in (WHOLE_EQUAL, EQUAL):
        sim = simulate(build_schedule(name, p, m), times)
        assert sim.bubble == Fraction(p - 1, m + p - 1)
        assert set(sim.idle) == {(p - 1) * times.of(Kind.BACKWARD) + (p - 1) * times.forward}


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3), (8, 16, 2)])
def test_interleaved_idles_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    for times in (WHOLE_EQUAL, EQUAL):
        assert simulate(build_schedule("interleaved_1f1b", p, m, v),
                        times).bubble == Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 9), (4, 16), (8, 8),
                                 (8, 21), (8, 32)])
def test_zb_h1_idles_a_third_of_1f1b_at_the_same_peak(p, m):
    zb, ofb = (simulate(build_schedule(n, p, m), EQUAL) for n in ("zb_h1", "1f1b"))
    assert max(zb.peak_held) == max(ofb.peak_held) == p
    assert zb.peak_held == (p,) * p  # every stage holds what 1F1B's first does
    assert set(zb.idle) == {p - 1} and set(ofb.idle) == {3 * (p - 1)}
    assert sum(zb.idle) / sum(ofb.idle) == Fraction(1, 3) <= Fraction(2, 5)
    # as a fraction of its own (shorter) step: (m+p-1)/(3m+p-1) of 1F1B's
    assert zb.bubble / ofb.bubble == Fraction(m + p - 1, 3 * m + p - 1)
    if m >= 3 * (p - 1):
        assert zb.bubble <= Fraction(2, 5) * ofb.bubble


@pytest.mark.parametrize("times", [Times(1, 1, Fraction(1, 2)), Times(1, Fraction(1, 2),
                                                                     Fraction(1, 2)),
                                   Times(3, 2, 1)])
def test_zb_h1_idles_the_papers_p_minus_1_times_f_plus_i_minus_w(times):
    """With W no longer than F, the deferred weight halves fill all but (F + I - W)."""
    for p, m in [(4, 8), (8, 16)]:
        sim = simulate(build_schedule("zb_h1", p, m), times)
        assert set(sim.idle) == {(p - 1) * (times.forward + times.backward_input
                                            - times.backward_weight)}


def test_zb_h1_is_never_worse_than_1f1b_and_holds_min_p_m_on_every_stage():
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        zb, ofb = (simulate(build_schedule(n, p, m), EQUAL) for n in ("zb_h1", "1f1b"))
        assert sum(zb.idle) <= sum(ofb.idle), (p, m)
        assert zb.peak_held == (min(p, m),) * p


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (4, 2), (4, 8), (8, 5), (8, 32)])
def test_1f1b_holds_p_minus_s_micro_batches_on_stage_s(p, m):
    sim = simulate(build_schedule("1f1b", p, m))
    assert sim.peak_held == tuple(min(p - s, m) for s in range(p))
    assert sim.peak_held_per_stage == sim.peak_held
    assert simulate(build_schedule("gpipe", p, m)).peak_held == (m,) * p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 3)])
def test_interleaved_holds_megatrons_warmup_plus_one_chunks(p, m, v):
    """Rank r runs 2 (p - r - 1) + (v - 1) p forwards before its first backward."""
    sim = simulate(build_schedule("interleaved_1f1b", p, m, v))
    assert sim.peak_held == tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)
                                  for r in range(p))


def test_messages_that_take_time_delay_the_step_without_breaking_it():
    base = simulate(build_schedule("1f1b", 4, 8), EQUAL)
    slow = simulate(build_schedule("1f1b", 4, 8), Times(1, 1, 1, comm=Fraction(1, 2)))
    assert slow.busy == base.busy and slow.step_time > base.step_time


def test_the_registry_names_and_interleaving_from_the_virtual_size():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}
    assert schedule_name("1f1b", 2) == "interleaved_1f1b"  # as Megatron: v > 1 interleaves
    assert schedule_name("Interleaved1F1B", 2) == "interleaved_1f1b"
    assert schedule_name("ZB-H1") == "zb_h1" and schedule_name("GPipe") == "gpipe"
    assert build_schedule("1f1b", 4, 8, 2).name == "interleaved_1f1b"


@pytest.mark.parametrize("args,flags", [
    (("interleaved_1f1b", 4, 6, 2), ["--pipeline-schedule interleaved_1f1b",
                                     "--virtual-pipeline-model-parallel-size 2",
                                     "--global-batch-size", "--micro-batch-size",
                                     "multiple of --pipeline-model-parallel-size 4",
                                     "they are 6"]),
    (("1f1b", 4, 6, 2), ["--pipeline-schedule interleaved_1f1b", "they are 6"]),
    (("interleaved_1f1b", 4, 8, 1), ["--virtual-pipeline-model-parallel-size of at least 2"]),
    (("zb_h1", 4, 8, 2), ["--pipeline-schedule zb_h1 runs one stage per rank",
                          "--virtual-pipeline-model-parallel-size 2"]),
    (("gpipe", 4, 8, 3), ["--pipeline-schedule gpipe runs one stage per rank"]),
    (("1f1b", 4, 0, 1), ["--global-batch-size", "are 0"]),
    (("1f1b", 0, 8, 1), ["--pipeline-model-parallel-size 0"]),
    (("pipedream", 4, 8, 1), ["--pipeline-schedule pipedream: unknown; one of gpipe, 1f1b"]),
])
def test_a_combination_a_schedule_cannot_run_names_the_flags(args, flags):
    with pytest.raises(ConfigError) as caught:
        build_schedule(*args)
    for flag in flags:
        assert flag in str(caught.value), str(caught.value)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_equal_times_given_per_stage_change_nothing(case):
    schedule = build_schedule(*case)
    for f, i, w in ((1, 1, 1), (3, 2, 1)):
        n = schedule.stages
        one, each = (simulate(schedule, Times(f, i, w)),
                     simulate(schedule, Times((f,) * n, [i] * n, (w,) * n)))
        assert (each.timelines, each.step_time, each.busy, each.peak_held) == (
            one.timelines, one.step_time, one.busy, one.peak_held)


def test_1f1b_with_its_last_stage_twice_as_slow_as_computed_by_hand():
    """p = 2, m = 4; stage 0: F = I = W = 1 (a whole backward 2), stage 1 twice that
    (F = 2, B = 4), messages free. Rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, rank 1 F0 B0 F1
    B1 F2 B2 F3 B3. Rank 1 waits for F0 on rank 0 (0-1), then runs its forwards and
    backwards back to back, every input having arrived before it is free (F1 at 2, F2
    at 10, F3 at 16): F0 1-3, B0 3-7, F1 7-9, B1 9-13, F2 13-15, B2 15-19, F3 19-21, B3
    21-25. Rank 0: F0 0-1, F1 1-2, then waits for B0's gradient (7): B0 7-9, F2 9-10,
    waits (13): B1 13-15, F3 15-16, waits (19): B2 19-21, waits (25): B3 25-27. Step
    time 27 = F_0 + m (F_1 + B_1) + B_0; busy m (F + B) = 12 and 24, so rank 0 idles
    15 and rank 1 3 (F_0 at the start, B_0 at the end): bubble 18 / 54 = 1/3.
    Averaging the stages (F = 1.5, B = 3) would predict (m + p - 1)(F + B) = 22.5 and
    4.5 idle on each rank, bubble 1/5."""
    schedule = build_schedule("1f1b", 2, 4)
    sim = simulate(schedule, Times((1, 2), (1, 2), (1, 2)))
    assert [str(s.action) for s in sim.timelines[0] if s.action.kind in COMPUTE] == (
        ["F0.s0", "F1.s0", "B0.s0", "F2.s0", "B1.s0", "F3.s0", "B2.s0", "B3.s0"])
    starts = {str(s.action): (s.start, s.end) for row in sim.timelines for s in row
              if s.action.kind in COMPUTE}
    assert starts["B0.s0"] == (7, 9) and starts["B3.s0"] == (25, 27)
    assert starts["F2.s1"] == (13, 15) and starts["B3.s1"] == (21, 25)
    assert sim.step_time == 27 and sim.busy == (12, 24) and sim.idle == (15, 3)
    assert sim.bubble == Fraction(1, 3) and sim.peak_held == (2, 1)
    mean = simulate(schedule, Times(Fraction(3, 2), Fraction(3, 2), Fraction(3, 2)))
    assert (mean.step_time, mean.idle, mean.bubble) == (Fraction(45, 2), (Fraction(9, 2),) * 2,
                                                        Fraction(1, 5))


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)])
def test_each_virtual_stage_takes_its_own_times(name, v):
    """Rank r computes, per micro-batch, its stages' F + I + W: stage s's own figures
    (with interleaving s = r, r + p, ..., not the rank's)."""
    p, m = 2, 4
    f, i, w = [1, 2, 3, 4][:p * v], [2, 1, 1, 5][:p * v], [1, 1, 2, 3][:p * v]
    sim = simulate(build_schedule(name, p, m, v), Times(f, i, w))
    assert sim.busy == tuple(m * sum(f[s] + i[s] + w[s] for s in range(r, p * v, p))
                             for r in range(p))


def test_per_stage_times_are_checked():
    with pytest.raises(ValueError, match=r"has 2 stages"):
        simulate(build_schedule("1f1b", 2, 4), Times((1, 1, 1), 1, 1))
    with pytest.raises(ValueError, match="differ in length"):
        Times((1, 2), (1, 2, 3))
    with pytest.raises(ValueError, match=r"Times.backward_input\[1\] \(stage 1\) = 0"):
        Times(1, (1, 0))
    with pytest.raises(ValueError, match="no stage"):
        Times(())
    uneven = Times((1, "1/3"), 1, 0.5)
    assert uneven.stages == 2 and uneven.forward == (1, Fraction(1, 3))
    assert uneven.of(Kind.BACKWARD, 1) == Fraction(3, 2) and uneven.of(Kind.SEND_ACT, 0) == 0
    with pytest.raises(ValueError, match="name the stage"):
        uneven.of(Kind.FORWARD)
    assert Times().stages is None and Times().of(Kind.FORWARD, 7) == 1


def test_times_are_exact_and_positive():
    assert Times(0.1, "1/3", 2).forward == Fraction(1, 10)
    assert Times(1, 1, 1).of(Kind.BACKWARD) == 2
    with pytest.raises(ValueError, match="backward_weight"):
        Times(1, 1, 0)


@pytest.mark.parametrize("p,m,v", [(2, 3, 1), (2, 4, 2), (4, 5, 3), (3, 1, 2)])
def test_forward_only_runs_every_stage_once_per_micro_batch_without_a_deadlock(p, m, v):
    """Evaluation's lists: rank r runs F(j) of its stages r, r + p, ... for every
    micro-batch, chunk by chunk; the messages meet in order and the play ends."""
    from hybrid.pipeline.schedules import forward_only
    from hybrid.pipeline.simulator import Times, _check_messages, _play, _Problems
    schedule = forward_only(p, m, v)
    for r, actions in enumerate(schedule.ranks):
        ran = [(a.stage, a.microbatch) for a in actions if a.kind is Kind.FORWARD]
        assert ran == [(c * p + r, j) for c in range(v) for j in range(m)]
        assert actions[-1].kind is Kind.END
    problems = _Problems(schedule)
    _check_messages(schedule, problems)
    problems.raise_if_any("is not runnable")
    slots, _ = _play(schedule, Times())
    assert [len(s) for s in slots] == [len(a) for a in schedule.ranks]
