"""Pipeline parallelism's share of the estimate, torch-free: what the schedule keeps in
flight on each stage, the bytes the stages send each other, the bubble.

``w`` is a :class:`hybrid.estimate.workload.Workload` with ``pp > 1``: ``p`` pipeline
ranks of ``v`` chunks each (``w.vpp``), ``m`` micro-batches a step (``w.micro_batches``),
``w.schedule`` the ``--pipeline-schedule``. The schedule is the one a run executes
(:func:`hybrid.pipeline.schedules.build_schedule`), played by the simulator
(:func:`hybrid.pipeline.simulator.simulate`): the estimator and the run read the same
lists. Played twice: with equal times (a forward, an input gradient and a weight
gradient of 1 each, free messages; :func:`bubble`, the textbook figure, which the
activations' walk reads too) and with each virtual stage's times in proportion to its
FLOPs per token (:func:`weighted_bubble`; [Note: stage times from FLOPs]).

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

[Note: stage times from FLOPs]
Stages are not equal: virtual stage 0 holds the embedding, the last the final norm,
the output layer and the loss, and the split (:mod:`hybrid.config.stage_split`: the first
and last overrides, the account-for flags, the layout) may give stages different layer
counts. :func:`stage_flops` counts each virtual stage's training FLOPs per token as
:meth:`hybrid.config.model.ModelConfig.stage_flops_per_token` does (the count behind
the training log's TFLOP/s): dense matmuls and the attention scores, summed over the
TP ranks, with the head over the vocabulary padded for ``tp``; the embedding (a
lookup), the norms, the softmax and the cross-entropy count none. Per token, with
``M`` a layer's matmul forward, ``A`` its attention scores (``QK^T`` and ``AV``,
``4 T C``) and ``H = 2 C V`` the head's forward, a stage of ``n`` layers computes

* forward ``n (M + A)`` (+ ``H`` on the last stage);
* input gradient ``n (M + 2 A)`` (+ ``H``): a matmul's input gradient costs its
  forward again, and the attention scores, which have no weights, put their whole
  backward (twice their forward) here;
* weight gradient ``n M`` (+ ``H``): a matmul's weight gradient costs its forward
  again; the embedding's backward is a scatter into its weight gradient (no input
  gradient, no FLOPs counted);

so the three sum to ``ModelConfig.stage_flops_per_token`` (3x the forward), the
stages' sum to the model's ``flops_per_token``. Recompute adds what the run reruns to
the input half, where the run reruns it: under full recompute each checkpointed layer's
forward (the first ``recompute_num_layers`` of each chunk with the block method, all
with the uniform), under selective each layer's ``A``. An action that counts no FLOPs
(stage 0's input gradient when it holds only the embedding, a stage the layout leaves
empty) takes 1, as good as nothing against a layer's millions (the simulator wants
positive times). The simulator is played with these integers as times; the bubble is
scale-free, so it is that of stage times in proportion to the FLOPs.

Where the model is crude: FLOPs, not measured times. It prices memory-bound work at
nothing -- the loss's softmax over the vocabulary, the norms, the embedding's gather
and scatter -- which on a GPU can take as long as the head's matmul, so the last stage
is heavier than this says; and small layers on a CPU are bound by overheads, not
FLOPs, so measured stage ratios come out flatter than the FLOP ratios. The messages
are free, as in the equal play. ``python -m benchmarks.bench_pipeline`` (PP 2, 8
layers x 256 hidden, vocabulary 8192, 4 + 4 layers) measured the last stage's
compute per micro-batch at 1.58x stage 0's, where the FLOPs say 1.62x
(``docs/pipeline-parallelism.md``, "Measured").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from hybrid.estimate.model_states import BYTES
from hybrid.estimate.workload import Workload
from hybrid.pipeline.actions import Kind
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulator import Simulation, Times, simulate


@functools.lru_cache(maxsize=32)
def _simulation(schedule: str, p: int, m: int, v: int) -> Simulation:
    return simulate(build_schedule(schedule, p, m, v))


def simulation(w: Workload) -> Simulation:
    """The schedule ``w`` runs, played with equal times (module doc)."""
    return _simulation(w.schedule, w.pp, w.micro_batches, w.vpp)


def bubble(w: Workload) -> Fraction:
    """The predicted bubble: the fraction of all ranks' step time idle, equal times."""
    return simulation(w).bubble if w.pp > 1 else Fraction(0)


@dataclass(frozen=True)
class StageFlops:
    """Training FLOPs per token of one virtual stage, by the simulator's three actions
    (see [Note: stage times from FLOPs])."""

    forward: int
    input_grad: int
    weight_grad: int

    @property
    def total(self) -> int:
        return self.forward + self.input_grad + self.weight_grad


def piece_layers(w: Workload) -> tuple[int, ...]:
    """Transformer layers of each virtual stage in model order (virtual stage ``s`` is
    chunk ``s // p`` of pipeline rank ``s % p``, as in
    :class:`hybrid.config.stage_split.StageSplit`): the run's split, as ``w`` carries it."""
    return tuple(w.stage_chunks(s % w.pp)[s // w.pp] for s in range(w.pp * w.vpp))


def stage_flops(w: Workload) -> tuple[StageFlops, ...]:
    """Each virtual stage's forward, input-gradient and weight-gradient FLOPs per token,
    model order ([Note: stage times from FLOPs]): its layers, the head on the last
    (the embedding on stage 0 counts none), what recompute reruns in the input half.
    Without recompute a stage's total is ``ModelConfig.stage_flops_per_token`` of its
    layers, and the stages' sum the model's ``flops_per_token``."""
    model, tp = w.model, w.tp
    # exact integers: ModelConfig's count is a product of ints (typed float)
    layer = int(model.stage_flops_per_token(tp, 1, last=False)) // 3  # M + A, forward
    head = int(model.stage_flops_per_token(tp, 0, last=True)) // 3  # H = 2 C V, forward
    scores = 2 * 2 * model.seq_length * model.attention_size  # A: its QK^T and AV terms
    matmul = layer - scores  # M
    pieces = piece_layers(w)
    out = []
    for s, n in enumerate(pieces):
        on_last = s == len(pieces) - 1
        rerun = 0
        if w.recompute:  # checkpointed layers rerun their forward before their backward
            rerun = min(w.recompute_num_layers or n, n) * layer
        elif w.selective_recompute:  # the attention core only
            rerun = n * scores
        out.append(StageFlops(forward=n * layer + head * on_last,
                              input_grad=n * (matmul + 2 * scores) + head * on_last + rerun,
                              weight_grad=n * matmul + head * on_last))
    return tuple(out)


def relative_flops(w: Workload) -> tuple[Fraction, ...]:
    """Each virtual stage's forward and backward FLOPs per token over the mean virtual
    stage's, model order (1 each when the stages are equal)."""
    totals = [f.total for f in stage_flops(w)]
    return tuple(Fraction(t * len(totals), sum(totals)) for t in totals)


def flop_times(w: Workload) -> Times:
    """The simulator's times of ``w``'s virtual stages: their FLOPs per token
    (:func:`stage_flops`), an action with none taking 1 (the simulator wants positive
    times)."""
    flops = stage_flops(w)
    return Times(forward=[max(f.forward, 1) for f in flops],
                 backward_input=[max(f.input_grad, 1) for f in flops],
                 backward_weight=[max(f.weight_grad, 1) for f in flops])


@functools.lru_cache(maxsize=32)
def _weighted_simulation(schedule: str, p: int, m: int, v: int, times: Times) -> Simulation:
    # the equal play's lists, built once: at p 64, m 512 building takes seconds
    return simulate(_simulation(schedule, p, m, v).schedule, times)


def weighted_simulation(w: Workload) -> Simulation:
    """The schedule ``w`` runs, played with each virtual stage's times in proportion to
    its FLOPs per token (:func:`flop_times`; PP > 1)."""
    return _weighted_simulation(w.schedule, w.pp, w.micro_batches, w.vpp, flop_times(w))


def weighted_bubble(w: Workload) -> Fraction:
    """The predicted bubble with each virtual stage's forward, input- and weight-gradient
    times in proportion to its FLOPs ([Note: stage times from FLOPs]); 0 at PP 1. Equal
    stages give :func:`bubble`; an uneven pipeline, as a rule, idles more."""
    return weighted_simulation(w).bubble if w.pp > 1 else Fraction(0)


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
