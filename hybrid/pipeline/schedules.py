"""The schedule generators, and the registry ``--pipeline-schedule`` picks from.

Each generator writes, for each pipeline rank, the order of its compute actions
(forward, backward, or backward's input and weight halves) and hands it to
:func:`with_comms`, which places the sends and receives: a send right after the
compute that made its tensor, a receive right before the compute that reads it.
A new schedule is a new generator and nothing else: the simulator checks it and the
executor runs it like the others.

The schedules (name: order on each rank; peak micro-batches held):

* ``gpipe``: all m forwards, then all m backwards; m on every stage.
* ``1f1b``: p-r-1 forwards, then a forward and a backward by turns, then the backwards
  left; ``min(p - s, m)`` on stage s.
* ``interleaved_1f1b``: 1F1B over v chunks per rank, p micro-batches of a chunk at a
  time (Megatron's); ``min(2 (p-r-1) + (v-1) p + 1, v m)`` chunks on rank r.
* ``zb_h1``: 1F1B's order with the backward cut into input and weight halves, the
  weight half deferred to fill the bubble (Qi et al.); ``min(p, m)`` on every stage.

Evaluation runs :func:`forward_only`, which no flag names: forwards alone, each
chunk's micro-batches in turn.

Torch-free: stdlib and :mod:`hybrid.errors` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybrid.errors import ConfigError
from hybrid.pipeline.actions import (
    END,
    INPUT_GRAD,
    Action,
    Kind,
    Schedule,
    matching_receive,
    stage_rank,
)

# How the message a schedule cannot use is worded: m comes from these flags.
_M_FLAGS = ("the micro-batches per step (--global-batch-size / "
            "(--micro-batch-size x data-parallel size))")


def _check_sizes(name: str, p: int, m: int, v: int) -> None:
    if p < 1:
        raise ConfigError(f"--pipeline-model-parallel-size {p}: must be at least 1")
    if v < 1:
        raise ConfigError(f"--virtual-pipeline-model-parallel-size {v}: must be at least 1")
    if m < 1:
        raise ConfigError(f"--pipeline-schedule {name}: {_M_FLAGS} are {m}; "
                          f"there must be at least one")


def _needs(action: Action, p: int, stages: int) -> tuple[Kind, int, int] | None:
    """The receive a compute action waits for, as (kind, stage, peer), or None.

    A forward reads stage s-1's output, a backward (or its input half) the gradient
    of stage s's output from stage s+1, when that stage is on another rank.
    """
    rank = stage_rank(action.stage, p)
    if action.kind is Kind.FORWARD and action.stage > 0:
        peer = stage_rank(action.stage - 1, p)
        return (Kind.RECV_ACT, action.stage, peer) if peer != rank else None
    if action.kind in INPUT_GRAD and action.stage < stages - 1:
        peer = stage_rank(action.stage + 1, p)
        return (Kind.RECV_GRAD, action.stage, peer) if peer != rank else None
    return None


def _sends(action: Action, p: int, stages: int) -> Action | None:
    """The send that follows a compute action, or None (last stage, first stage, same rank)."""
    rank = stage_rank(action.stage, p)
    if action.kind is Kind.FORWARD and action.stage < stages - 1:
        peer = stage_rank(action.stage + 1, p)
        if peer != rank:
            return Action(Kind.SEND_ACT, action.stage, action.microbatch, peer)
    if action.kind in INPUT_GRAD and action.stage > 0:
        peer = stage_rank(action.stage - 1, p)
        if peer != rank:
            return Action(Kind.SEND_GRAD, action.stage, action.microbatch, peer)
    return None


def with_comms(name: str, p: int, m: int, v: int,
               compute: list[list[Action]]) -> Schedule:
    """The schedule whose compute order on rank r is ``compute[r]``, with its messages.

    Each send goes right after the compute that makes its tensor. Each receive goes
    before the compute that reads it; when the sender sent other messages to this
    rank first, their receives go there too, in the sender's order. That keeps
    every pair of ranks in one order (the contract's rule 4) and costs no wait: the
    sender posted those messages before the one awaited, so they have arrived by
    the time it has. ``END`` closes every list.
    """
    stages = p * v
    with_sends: list[list[Action]] = []
    # queue[(src, dst)]: the receives dst owes src, in the order src sends
    queue: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(compute):
        out = []
        for action in actions:
            out.append(action)
            send = _sends(action, p, stages)
            if send is not None:
                out.append(send)
                assert send.peer is not None
                queue.setdefault((rank, send.peer), []).append(matching_receive(send, rank))
        with_sends.append(out)
    ranks = []
    for rank, actions in enumerate(with_sends):
        taken = {src: 0 for src in range(p)}
        out = []
        for action in actions:
            need = _needs(action, p, stages)
            if need is not None:
                kind, stage, src = need
                pending = queue[(src, rank)]
                wanted = Action(kind, stage, action.microbatch, src)
                # receive up to and including the one this compute reads, unless it came already
                if wanted not in pending[:taken[src]]:
                    stop = pending.index(wanted, taken[src]) + 1
                    out.extend(pending[taken[src]:stop])
                    taken[src] = stop
            out.append(action)
        out.append(END)
        ranks.append(tuple(out))
    return Schedule(name, p, m, v, tuple(ranks))


def _f(stage: int, j: int) -> Action:
    return Action(Kind.FORWARD, stage, j)


def _b(stage: int, j: int) -> Action:
    return Action(Kind.BACKWARD, stage, j)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards, micro-batch 0 first.

    Holds all m micro-batches' activations at the turn; the bubble is 1F1B's.
    """
    _check_sizes("gpipe", p, m, 1)
    compute = [[_f(r, j) for j in range(m)] + [_b(r, j) for j in range(m)] for r in range(p)]
    return with_comms("gpipe", p, m, 1, compute)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Megatron's non-interleaved schedule).

    Rank r first runs ``p - r - 1`` forwards (the warm-up; all m when there are
    fewer), then one forward and one backward by turns, then the backwards left.
    So stage s holds at most ``min(p - s, m)`` micro-batches' activations.
    """
    _check_sizes("1f1b", p, m, 1)
    compute = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [_f(r, j) for j in range(warmup)]
        for j in range(m - warmup):
            order += [_f(r, warmup + j), _b(r, j)]
        order += [_b(r, j) for j in range(m - warmup, m)]
        compute.append(order)
    return with_comms("1f1b", p, m, 1, compute)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron's schedule with virtual stages).

    Rank r holds v stages (r, r + p, ...). Its forwards go through its chunks p
    micro-batches at a time: micro-batches 0..p-1 on chunk 0, then the same on
    chunk 1, ..., then micro-batches p..2p-1 on chunk 0; its backwards the same way
    from the last chunk down. It runs ``2 (p - r - 1) + (v - 1) p`` forwards before
    its first backward, then one of each by turns. With m a multiple of p, the
    bubble is ``(p-1) / (v m + p - 1)`` of the step. Needs ``m % p == 0`` (as
    Megatron's schedule does) and ``v >= 2``.
    """
    _check_sizes("interleaved_1f1b", p, m, v)
    if v < 2:
        raise ConfigError(
            f"--pipeline-schedule interleaved_1f1b needs --virtual-pipeline-model-parallel-size "
            f"of at least 2 (it is {v}); with one stage per rank use --pipeline-schedule 1f1b")
    if m % p:
        raise ConfigError(
            f"--pipeline-schedule interleaved_1f1b (--virtual-pipeline-model-parallel-size {v}) "
            f"needs {_M_FLAGS} to be a multiple of --pipeline-model-parallel-size {p}; "
            f"they are {m}. Change --global-batch-size or --micro-batch-size, or run "
            f"--pipeline-schedule 1f1b without --virtual-pipeline-model-parallel-size")
    total = v * m

    def unit(k: int, backward: bool) -> tuple[int, int]:
        """The k-th forward (or backward) of a rank: (chunk, micro-batch)."""
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    compute = []
    for r in range(p):
        def fwd(k: int, r: int = r) -> Action:
            chunk, j = unit(k, False)
            return _f(chunk * p + r, j)

        def bwd(k: int, r: int = r) -> Action:
            chunk, j = unit(k, True)
            return _b(chunk * p + r, j)

        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [fwd(warmup + k), bwd(k)]
        order += [bwd(k) for k in range(total - warmup, total)]
        compute.append(order)
    return with_comms("interleaved_1f1b", p, m, v, compute)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with the
    backward cut in two, the weight half deferred into what were 1F1B's bubbles.

    Stage s runs ``p - s`` forwards, its first input gradient, then ``s`` more
    forward and input-gradient pairs, then by turns a weight gradient, a forward
    and an input gradient; when the forwards run out, a weight and an input
    gradient by turns, then the weight gradients left. Every stage then holds at
    most p micro-batches (a micro-batch is held from its forward to its weight
    gradient): 1F1B's peak, on stage 0. With forward, input- and weight-gradient
    times equal and m >= p, each rank idles ``p - 1`` such times in a step, a
    third of 1F1B's ``3 (p - 1)``.
    """
    _check_sizes("zb_h1", p, m, 1)
    compute = []
    for s in range(p):
        order: list[Action] = []
        done = {Kind.FORWARD: 0, Kind.BACKWARD_INPUT: 0, Kind.BACKWARD_WEIGHT: 0}

        def run(kind: Kind, s: int = s, order: list[Action] = order,
                done: dict[Kind, int] = done) -> None:
            order.append(Action(kind, s, done[kind]))
            done[kind] += 1

        for _ in range(min(p - s, m)):
            run(Kind.FORWARD)
        run(Kind.BACKWARD_INPUT)
        for _ in range(min(s, m - done[Kind.FORWARD])):
            run(Kind.FORWARD)
            run(Kind.BACKWARD_INPUT)
        while done[Kind.FORWARD] < m:
            run(Kind.BACKWARD_WEIGHT)
            run(Kind.FORWARD)
            run(Kind.BACKWARD_INPUT)
        while done[Kind.BACKWARD_INPUT] < m:
            run(Kind.BACKWARD_WEIGHT)
            run(Kind.BACKWARD_INPUT)
        while done[Kind.BACKWARD_WEIGHT] < m:
            run(Kind.BACKWARD_WEIGHT)
        compute.append(order)
    return with_comms("zb_h1", p, m, 1, compute)


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Forwards and no backward (evaluation): each rank runs its chunks in model order,
    all m micro-batches of one chunk before the next, as GPipe's forward half. Not a
    ``--pipeline-schedule``: a step that trains needs a backward."""
    _check_sizes("forward_only", p, m, v)
    compute = [[_f(c * p + r, j) for c in range(v) for j in range(m)] for r in range(p)]
    return with_comms("forward_only", p, m, v, compute)


@dataclass(frozen=True)
class Generator:
    """A registered schedule: its generator and whether it takes virtual stages."""

    build: Callable[..., Schedule]
    interleaved: bool
    about: str  # (in --pipeline-schedule's help)


# the one list of schedules: --pipeline-schedule's choices and help, the config's
# closed set (hybrid.config.sections.PIPELINE_SCHEDULES) and the docs' table come from it
SCHEDULES: dict[str, Generator] = {
    "gpipe": Generator(gpipe, False, "all forwards, then all backwards"),
    "1f1b": Generator(one_f_one_b, False, "one forward, one backward"),
    "interleaved_1f1b": Generator(interleaved_1f1b, True,
                                  "implied by more than one virtual stage"),
    "zb_h1": Generator(zb_h1, False, "zero-bubble H1"),
}


def _key(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def schedule_name(name: str, v: int = 1) -> str:
    """The registered name ``--pipeline-schedule name`` means with virtual size ``v``.

    Spelling is loose (``Interleaved1F1B``, ``zb-h1``). As in Megatron, interleaving
    follows from the virtual size: ``1f1b`` with v > 1 is ``interleaved_1f1b``.
    ConfigError for an unknown name, or a schedule that has no virtual stages with v > 1.
    """
    found = {_key(n): n for n in SCHEDULES}.get(_key(name))
    if found is None:
        raise ConfigError(f"--pipeline-schedule {name}: unknown; one of {', '.join(SCHEDULES)}")
    if found == "1f1b" and v > 1:
        return "interleaved_1f1b"
    if v > 1 and not SCHEDULES[found].interleaved:
        raise ConfigError(
            f"--pipeline-schedule {found} runs one stage per rank; "
            f"--virtual-pipeline-model-parallel-size {v} needs --pipeline-schedule 1f1b "
            f"(interleaved_1f1b)")
    return found


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``--pipeline-schedule name`` runs on p ranks, m micro-batches and
    v stages per rank; ConfigError, naming the flags, for a combination it cannot run."""
    resolved = schedule_name(name, v)
    generator = SCHEDULES[resolved]
    if generator.interleaved:
        return generator.build(p, m, v)
    return generator.build(p, m)
