"""Pipeline parallelism's share of the estimate, torch-free: what the schedule keeps in
flight on each stage, the bytes the stages send each other, the bubble.

``w`` is a :class:`hybrid.estimate.workload.Workload` with ``pp > 1``: ``p`` pipeline
ranks of ``v`` chunks each (``w.vpp``), ``m`` micro-batches a step (``w.micro_batches``),
``w.schedule`` the ``--pipeline-schedule``. The schedule is the one a run executes
(:func:`hybrid.pipeline.schedules.build_schedule`), played by the simulator
(:func:`hybrid.pipeline.simulator.simulate`) with equal times (a forward, an input
gradient and a weight gradient of 1 each, free messages): the estimator and the run
read the same lists.

[Note: activations under a schedule]
A micro-batch's activations on a stage live from its forward to the end of its
backward (of the weight half under ZB-H1): the simulator's ``peak_held``. The bytes of
one micro-batch on virtual stage ``s`` are its chunk's layers
(:func:`hybrid.estimate.memory.activation_bytes_per_layer` each, or what recompute
keeps of them), plus the embedding's saved ids on stage 0 and the head and loss on the
last (:func:`hybrid.estimate.memory.embedding_bytes`, :func:`~.memory.loss_bytes`).
Walking a rank's list in order, adding a stage's bytes at each forward and taking them
off at its backward, gives the most that rank holds: with one stage per rank (or equal
chunks) the peak count times one micro-batch's bytes, 1F1B's ``(p - r) x`` on rank
``r``, GPipe's ``m x``; with uneven chunks the walk weighs each chunk by its own layers.
The transients of :func:`~.memory.activation_bytes` (a recomputed group's backward,
the logits beside their softmax on the last stage) come on top, once.

[Note: P2P bytes]
Each stage sends its output forward and the gradient of its input backward, one
``(B, T / cp, C)`` tensor (``T / (cp tp)`` under sequence parallelism) of the
parameters' dtype per micro-batch each way, at every boundary between stages on
different ranks: ``p v - 1`` boundaries, ``2 (p v - 1) m B T C e`` bytes a step for the
pipeline (per TP, CP and DP position), counted as the comm door counts ``p2p``: by the
sender.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from fractions import Fraction

from hybrid.estimate.model_states import BYTES
from hybrid.estimate.workload import Workload
from hybrid.pipeline.actions import Kind
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulator import Simulation, simulate


@functools.lru_cache(maxsize=32)
def _simulation(schedule: str, p: int, m: int, v: int) -> Simulation:
    return simulate(build_schedule(schedule, p, m, v))


def simulation(w: Workload) -> Simulation:
    """The schedule ``w`` runs, played with equal times (module doc)."""
    return _simulation(w.schedule, w.pp, w.micro_batches, w.vpp)


def bubble(w: Workload) -> Fraction:
    """The predicted bubble: the fraction of all ranks' step time idle, equal times."""
    return simulation(w).bubble if w.pp > 1 else Fraction(0)


def held_peak(w: Workload, rank: int, per_stage: Mapping[int, tuple[int, ...]]) -> dict:
    """The most rank ``rank`` holds at once under ``w``'s schedule (see [Note: activations
    under a schedule]). ``per_stage``: for each of its virtual stages, one micro-batch's
    bytes by part (the same parts for every stage). Returns ``{"bytes": the parts at the
    peak, "held": (stage, micro-batch) activations alive then, "peak_held": the
    simulator's peak count}``."""
    sim = simulation(w)
    parts = len(next(iter(per_stage.values())))
    now, live = [0] * parts, 0
    best, best_live = list(now), 0
    for a in sim.schedule.ranks[rank]:
        if a.kind is Kind.FORWARD:
            sign = 1
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            sign = -1
        else:
            continue
        now = [x + sign * y for x, y in zip(now, per_stage[a.stage])]
        live += sign
        if sum(now) > sum(best):
            best, best_live = list(now), live
    return {"bytes": tuple(best), "held": best_live, "peak_held": sim.peak_held[rank]}


def message_bytes(w: Workload) -> int:
    """One tensor between two stages: ``B x T / cp (/ tp under SP) x C x e``."""
    s = w.seq_per_rank // (w.tp if w.sequence_parallel else 1)
    return w.micro_batch_size * s * w.model.hidden_size * BYTES[w.params_dtype]


def p2p_bytes_per_step(w: Workload) -> dict:
    """Bytes each pipeline rank sends a step (see [Note: P2P bytes]): ``{"message": one
    tensor, "ranks": [rank 0's, ...], "total": the pipeline's}``; zeros at PP 1."""
    p, v, m = w.pp, w.vpp, w.micro_batches
    msg = message_bytes(w)
    last = p * v - 1
    ranks = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        sends = sum((s < last) + (s > 0) for s in stages) if p > 1 else 0
        ranks.append(sends * m * msg)
    return {"message": msg, "ranks": ranks, "total": sum(ranks)}
