"""Play a schedule's lists without torch: check them, time them, count what they hold.

:func:`simulate` reads a :class:`~hybrid.pipeline.actions.Schedule` and runs it under the
rules of :mod:`hybrid.pipeline.actions` (sends do not block, receives wait for their
send, ``END`` waits for its sends to be received), with a fixed time per compute
action of each kind, on every stage or per stage (:class:`Times`). It raises
:class:`ScheduleError`, naming the rank, the action's place and what is wrong, for a
list the executor could not run:

* a list that breaks the vocabulary: an action on a stage of another rank, a stage
  or micro-batch out of range, a peer that is not the neighbouring stage's rank, a
  missing or misplaced ``END``;
* a list that is incomplete or out of order: each (stage, micro-batch) needs one
  forward and one backward (or its input half then its weight half), the backward
  after the forward, each after the receive that brings its input, each send after
  the compute that makes its tensor;
* messages that do not meet: per ordered pair of ranks, the sends of one and the
  receives of the other must be the same messages in the same order;
* a deadlock: no rank can go on and some have not finished; the message names each
  stuck rank, the action it waits at and what it waits for.

What passes cannot deadlock under those rules; the executor refuses what does not.
The :class:`Simulation` gives each rank's timeline, the step time, the bubble
(the fraction of rank-time idle), and the peak number of micro-batches each rank and
each stage holds activations for: from the start of a forward to the end of the
backward, or of the weight half when the backward is split (which still needs the
stage's inputs). All times are exact fractions.

Torch-free: stdlib and :mod:`hybrid.pipeline.actions` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from hybrid.pipeline.actions import (
    COMPUTE,
    INPUT_GRAD,
    RECVS,
    SENDS,
    Action,
    Kind,
    Schedule,
    matching_receive,
    stage_rank,
)

Number = int | float | str | Fraction
Value = Fraction | tuple[Fraction, ...]  # one time for every stage, or one per stage


def _exact(value: Number) -> Fraction:
    # str(0.1) is '0.1': a float typed by a user is meant as its decimal, not its binary
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


def _text(value: Value) -> str:
    return (str(value) if isinstance(value, Fraction)
            else "(" + ", ".join(str(x) for x in value) + ")")


@dataclass(frozen=True, init=False)
class Times:
    """Seconds (or any unit) of one action on one micro-batch: the same on every stage,
    or one figure per (virtual) stage.

    ``forward``, ``backward_input`` (the input-gradient half) and ``backward_weight``
    (the weight-gradient half); a whole backward takes their sum. Each is a number, for
    every stage, or a sequence of numbers, stage 0's first (with interleaving the
    virtual stages in model order, ``s`` on rank ``s % p``): the sequences given must
    be equally long, and :func:`simulate` wants one figure for each of the schedule's
    stages. A number is kept as an exact Fraction, a sequence as a tuple of them (a
    float as the decimal it prints as, ``0.1`` as 1/10; a string such as ``"1/3"`` is
    read by Fraction). ``comm``: from a send to its tensor's arrival, one figure.
    Defaults: the zero-bubble paper's setting, all three equal, and free messages.
    """

    forward: Value
    backward_input: Value
    backward_weight: Value
    comm: Fraction

    def __init__(self, forward: Number | Sequence[Number] = 1,
                 backward_input: Number | Sequence[Number] = 1,
                 backward_weight: Number | Sequence[Number] = 1, comm: Number = 0):
        given = {"forward": forward, "backward_input": backward_input,
                 "backward_weight": backward_weight}
        lengths = set()
        for name, raw in given.items():
            value: Value
            values: tuple[Fraction, ...]
            if isinstance(raw, (int, float, str, Fraction)):
                value = _exact(raw)
                values = (value,)
            else:
                values = value = tuple(_exact(x) for x in raw)
                if not values:
                    raise ValueError(f"Times.{name}: no stage's time given")
                lengths.add(len(values))
            for k, x in enumerate(values):
                if x <= 0:
                    where = "" if isinstance(value, Fraction) else f"[{k}] (stage {k})"
                    raise ValueError(f"Times.{name}{where} = {x}: must be positive")
            object.__setattr__(self, name, value)
        if len(lengths) > 1:
            raise ValueError("Times: the per-stage sequences differ in length ("
                             + ", ".join(f"{n} {len(v)}" for n, v in given.items()
                                         if not isinstance(v, (int, float, str, Fraction)))
                             + ")")
        value = _exact(comm)
        if value < 0:
            raise ValueError(f"Times.comm = {value}: must be positive or zero")
        object.__setattr__(self, "comm", value)

    @property
    def stages(self) -> int | None:
        """How many stages the per-stage sequences give (None: every figure is for
        every stage)."""
        for value in (self.forward, self.backward_input, self.backward_weight):
            if not isinstance(value, Fraction):
                return len(value)
        return None

    def _one(self, value: Value, stage: int | None) -> Fraction:
        if isinstance(value, Fraction):
            return value
        if stage is None:
            raise ValueError(f"Times {self.describe()} differ by stage: name the stage")
        return value[stage]

    def of(self, kind: Kind, stage: int | None = None) -> Fraction:
        """How long one action of ``kind`` computes on virtual stage ``stage`` (0 for
        communication); ``stage`` may be left out when the times are every stage's."""
        if kind is Kind.FORWARD:
            return self._one(self.forward, stage)
        if kind is Kind.BACKWARD_INPUT:
            return self._one(self.backward_input, stage)
        if kind is Kind.BACKWARD_WEIGHT:
            return self._one(self.backward_weight, stage)
        if kind is Kind.BACKWARD:
            return (self._one(self.backward_input, stage)
                    + self._one(self.backward_weight, stage))
        return Fraction(0)

    def describe(self) -> str:
        """The figures in words (a sequence as ``(x0, x1, ...)``, stage 0 first)."""
        return (f"forward {_text(self.forward)}, input gradient "
                f"{_text(self.backward_input)}, weight gradient "
                f"{_text(self.backward_weight)}, message {self.comm}")


class ScheduleError(ValueError):
    """A schedule the executor cannot run; the message names the rank, the action's
    place in its list (``#i``, from 0) and what is wrong."""


@dataclass(frozen=True)
class Slot:
    """One action of a rank's timeline: it ran from ``start`` to ``end`` (for a receive,
    the wait for its tensor; for a send, no time)."""

    action: Action
    start: Fraction
    end: Fraction


@dataclass(frozen=True)
class Simulation:
    """What one step of a schedule does under some :class:`Times`."""

    schedule: Schedule
    times: Times
    timelines: tuple[tuple[Slot, ...], ...]  # per rank, every action in list order
    step_time: Fraction  # from 0 to the last rank's END
    busy: tuple[Fraction, ...]  # per rank: time computing
    peak_held: tuple[int, ...]  # per rank: most (stage, micro-batch) activations at once
    peak_held_per_stage: tuple[int, ...]  # the same, per virtual stage

    @property
    def idle(self) -> tuple[Fraction, ...]:
        """Per rank: the step time not spent computing."""
        return tuple(self.step_time - b for b in self.busy)

    @property
    def bubble(self) -> Fraction:
        """The fraction of all ranks' time in the step that is idle."""
        return sum(self.idle, Fraction(0)) / (self.schedule.p * self.step_time)


def _describe(action: Action) -> str:
    """What a receive waits for, in words."""
    what = "input" if action.kind is Kind.RECV_ACT else "output gradient"
    return (f"stage {action.stage}'s {what} for micro-batch {action.microbatch} "
            f"from rank {action.peer}")


class _Problems:
    """The errors of one check, reported together (the first few)."""

    LIMIT = 12

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.lines: list[str] = []

    def add(self, rank: int, index: int | None, action: Action | None, text: str) -> None:
        where = f"rank {rank}" + (f" #{index} {action}" if index is not None else "")
        self.lines.append(f"  {where}: {text}")

    def raise_if_any(self, what: str) -> None:
        if not self.lines:
            return
        s = self.schedule
        shown = self.lines[: self.LIMIT]
        more = len(self.lines) - len(shown)
        raise ScheduleError(
            f"schedule {s.name!r} (p={s.p}, m={s.m}, v={s.v}) {what}:\n" + "\n".join(shown)
            + (f"\n  ... and {more} more" if more else ""))


def _check_rank(schedule: Schedule, rank: int, problems: _Problems) -> tuple[int, list[int]]:
    """Rank ``rank``'s list against the vocabulary and its own order; returns its peak
    of held micro-batches and the peak per stage (indexed by stage)."""
    p, m, stages = schedule.p, schedule.m, schedule.stages
    actions = schedule.ranks[rank]
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, micro-batch) -> how often
    held, peak = 0, 0
    held_stage, peak_stage = [0] * stages, [0] * stages

    def did(kind: Kind, stage: int, j: int) -> bool:
        return done.get((kind, stage, j), 0) > 0

    for i, a in enumerate(actions):
        def bad(text: str, i: int = i, a: Action = a) -> None:
            problems.add(rank, i, a, text)

        if a.kind is Kind.END:
            if i != len(actions) - 1:
                bad("END before the end of the list")
            continue
        if not (0 <= a.stage < stages and 0 <= a.microbatch < m):
            bad(f"stage or micro-batch out of range (stages 0..{stages - 1}, "
                f"micro-batches 0..{m - 1})")
            continue
        if stage_rank(a.stage, p) != rank:
            bad(f"stage {a.stage} lives on rank {stage_rank(a.stage, p)}")
            continue
        s, j = a.stage, a.microbatch
        key = (a.kind, s, j)
        if did(*key):
            bad("done twice")
        done[key] = done.get(key, 0) + 1
        if a.kind in SENDS or a.kind in RECVS:
            neighbour = s + 1 if a.kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else s - 1
            if not 0 <= neighbour < stages:
                bad(f"stage {s} has no stage {neighbour} to exchange with")
            elif stage_rank(neighbour, p) == rank:
                bad(f"stage {neighbour} is on this rank too: nothing to send or receive")
            elif a.peer != stage_rank(neighbour, p):
                bad(f"the peer is rank {a.peer}, but stage {neighbour} lives on rank "
                    f"{stage_rank(neighbour, p)}")
        elif a.peer is not None:
            bad("a compute action names no peer")
        local_prev = s > 0 and stage_rank(s - 1, p) == rank
        local_next = s < stages - 1 and stage_rank(s + 1, p) == rank
        if a.kind is Kind.FORWARD:
            if s > 0 and not (did(Kind.RECV_ACT, s, j) or (
                    local_prev and did(Kind.FORWARD, s - 1, j))):
                bad(f"its input has not arrived: no RA{j}.s{s} before it"
                    if not local_prev else f"F{j}.s{s - 1} has not run before it")
            held += 1
            held_stage[s] += 1
            peak, peak_stage[s] = max(peak, held), max(peak_stage[s], held_stage[s])
        elif a.kind in INPUT_GRAD:
            other = Kind.BACKWARD_INPUT if a.kind is Kind.BACKWARD else Kind.BACKWARD
            if did(other, s, j):
                bad(f"micro-batch {j} of stage {s} already had a {other.name}")
            if not did(Kind.FORWARD, s, j):
                bad(f"no F{j}.s{s} before it")
            if s < stages - 1 and not (did(Kind.RECV_GRAD, s, j) or (local_next and (
                    did(Kind.BACKWARD, s + 1, j) or did(Kind.BACKWARD_INPUT, s + 1, j)))):
                bad(f"its output gradient has not arrived: no RG{j}.s{s} before it"
                    if not local_next else f"stage {s + 1}'s backward of {j} has not run")
            if a.kind is Kind.BACKWARD:
                held -= 1
                held_stage[s] -= 1
        elif a.kind is Kind.BACKWARD_WEIGHT:
            if not did(Kind.BACKWARD_INPUT, s, j):
                bad(f"no I{j}.s{s} before it")
            held -= 1
            held_stage[s] -= 1
        elif a.kind is Kind.SEND_ACT and not did(Kind.FORWARD, s, j):
            bad(f"sends what F{j}.s{s} makes, which has not run")
        elif a.kind is Kind.SEND_GRAD and not (did(Kind.BACKWARD, s, j)
                                               or did(Kind.BACKWARD_INPUT, s, j)):
            bad(f"sends what B{j}.s{s} (or I{j}.s{s}) makes, which has not run")
    if not actions or actions[-1].kind is not Kind.END:
        problems.add(rank, None, None, "the list does not end with END")
    missing = []
    for s in range(rank, schedule.stages, p):
        for j in range(m):
            if not did(Kind.FORWARD, s, j):
                missing.append(f"F{j}.s{s}")
            if not did(Kind.BACKWARD, s, j):
                if not did(Kind.BACKWARD_INPUT, s, j):
                    missing.append(f"B{j}.s{s} (or I{j}.s{s} and W{j}.s{s})")
                elif not did(Kind.BACKWARD_WEIGHT, s, j):
                    missing.append(f"W{j}.s{s}")
    if missing:
        problems.add(rank, None, None, "never runs " + ", ".join(missing[:8])
                     + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return peak, peak_stage


def _check_messages(schedule: Schedule, problems: _Problems) -> None:
    """Per ordered pair of ranks: the sends of one are the receives of the other, in order."""
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for a in actions:
            if a.kind in SENDS and a.peer is not None:
                sent.setdefault((rank, a.peer), []).append(matching_receive(a, rank))
            elif a.kind in RECVS and a.peer is not None:
                received.setdefault((a.peer, rank), []).append(a)
    for src, dst in sorted(set(sent) | set(received)):
        out, into = sent.get((src, dst), []), received.get((src, dst), [])
        if out == into:
            continue
        k = next((k for k, (x, y) in enumerate(zip(out, into)) if x != y), min(len(out),
                                                                              len(into)))
        sends = (f"its send #{k} would meet {out[k]}" if k < len(out)
                 else f"it sends only {len(out)}")
        takes = (f"rank {dst}'s receive #{k} from it is {into[k]}" if k < len(into)
                 else f"rank {dst} receives only {len(into)} from it")
        problems.add(src, None, None, f"messages to rank {dst} do not meet in order: "
                     f"{sends}, but {takes}")


def _play(schedule: Schedule, times: Times) -> tuple[list[list[Slot]], list[Fraction]]:
    """Run the checked lists under the contract's rules; ScheduleError on a deadlock."""
    p = schedule.p
    clock = [Fraction(0)] * p
    at = [0] * p  # the next action of each rank
    slots: list[list[Slot]] = [[] for _ in range(p)]
    busy = [Fraction(0)] * p
    # per ordered pair (src, dst): arrival times of the messages sent, and when each was taken
    arrivals: dict[tuple[int, int], list[Fraction]] = {}
    taken: dict[tuple[int, int], list[Fraction]] = {}
    peers_sent_to = [sorted({a.peer for a in acts if a.kind in SENDS and a.peer is not None})
                     for acts in schedule.ranks]

    def advance(rank: int) -> bool:
        """Run rank's actions until one must wait; whether any ran."""
        moved = False
        actions = schedule.ranks[rank]
        while at[rank] < len(actions):
            a, now = actions[at[rank]], clock[rank]
            if a.kind in COMPUTE:
                end = now + times.of(a.kind, a.stage)
                busy[rank] += end - now
            elif a.kind in SENDS:
                assert a.peer is not None
                arrivals.setdefault((rank, a.peer), []).append(now + times.comm)
                end = now
            elif a.kind in RECVS:
                assert a.peer is not None
                pair = (a.peer, rank)
                k = len(taken.setdefault(pair, []))
                if k >= len(arrivals.get(pair, [])):
                    return moved
                end = max(now, arrivals[pair][k])
                taken[pair].append(end)
            else:  # END: every send of this rank received
                pairs = [(rank, q) for q in peers_sent_to[rank]]
                if any(len(taken.get(pr, [])) < len(arrivals.get(pr, [])) for pr in pairs):
                    return moved
                end = max([now, *(t for pr in pairs for t in taken.get(pr, []))])
            slots[rank].append(Slot(a, now, end))
            clock[rank] = end
            at[rank] += 1
            moved = True
        return moved

    while True:  # a round lets every rank run as far as it can; stop when none moved
        if not [advance(rank) for rank in range(p)].count(True):
            break
    stuck = [r for r in range(p) if at[r] < len(schedule.ranks[r])]
    if stuck:
        problems = _Problems(schedule)
        for r in stuck:
            a = schedule.ranks[r][at[r]]
            if a.kind in RECVS:
                wait = f"waits for {_describe(a)}"
                if at[a.peer or 0] < len(schedule.ranks[a.peer or 0]):
                    wait += (f", which waits at #{at[a.peer or 0]} "
                             f"{schedule.ranks[a.peer or 0][at[a.peer or 0]]}")
            else:
                wait = "waits for its sends to be received"
            problems.add(r, at[r], a, wait)
        problems.raise_if_any("deadlocks: no rank can go on")
    return slots, busy


def check(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Raise ScheduleError if ``schedule``'s lists break the vocabulary, are incomplete or
    out of order, or their messages do not meet; else its peak held micro-batches per
    rank and per virtual stage. (Deadlocks are found by :func:`simulate`.)"""
    problems = _Problems(schedule)
    if len(schedule.ranks) != schedule.p:
        problems.add(0, None, None, f"{len(schedule.ranks)} lists for p = {schedule.p} ranks")
        problems.raise_if_any("is not runnable")
    peaks, per_stage = [], [0] * schedule.stages
    for rank in range(schedule.p):
        peak, stage_peaks = _check_rank(schedule, rank, problems)
        peaks.append(peak)
        per_stage = [max(x, y) for x, y in zip(per_stage, stage_peaks)]
    _check_messages(schedule, problems)
    problems.raise_if_any("is not runnable")
    return tuple(peaks), tuple(per_stage)


def simulate(schedule: Schedule, times: Times | None = None) -> Simulation:
    """Check ``schedule`` (ScheduleError if the executor could not run it, deadlocks
    included) and time one step of it under ``times`` (default :class:`Times`)."""
    times = times or Times()
    if times.stages is not None and times.stages != schedule.stages:
        raise ValueError(f"Times give {times.stages} stages' figures; schedule "
                         f"{schedule.name!r} (p={schedule.p}, v={schedule.v}) has "
                         f"{schedule.stages} stages")
    peaks, per_stage = check(schedule)
    slots, busy = _play(schedule, times)
    step_time = max(rank_slots[-1].end for rank_slots in slots)
    return Simulation(schedule, times, tuple(tuple(s) for s in slots), step_time,
                      tuple(busy), peaks, per_stage)
