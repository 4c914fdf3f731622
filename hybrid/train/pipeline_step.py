"""One optimizer step, and one evaluation, through the pipeline (PP > 1).

The same data flow as :mod:`hybrid.train.step`, cut into stages: this rank's
micro-batches -> its stage's forward (the first from tokens, the others from the
activations received) -> the last stage's loss / n_micro -> backward, stage by
stage in the schedule's order (:mod:`hybrid.pipeline.executor`; each stage's
ZeRO hooks reduce its gradients over DP once a step) -> the norm over every
stage -> AdamW on each rank's shard of its stage.

The loss lives on the last stage; one all-reduce over the pipeline group (the
other stages adding zeros) gives every stage the step's micro-batch losses, so
the log line, the non-finite check and the skip decision read them on any rank.

With interleaving (``--virtual-pipeline-model-parallel-size v``) the rank's model
holds v chunks, stages r, r + p, ... (:class:`models.gpt.GPT`'s ``chunks``): stage
s runs chunk ``s // p``, its backward reaches that chunk's parameters, and the
engine reduces each chunk's at the chunk's last backward
(:mod:`hybrid.zero.parts`).
"""

from __future__ import annotations

import functools

import torch

from hybrid.config.sections import LoopConfig
from hybrid.data.dataset import dp_micro_batches
from hybrid.parallel.state import ParallelState
from hybrid.pipeline.actions import Schedule, stage_chunk
from hybrid.pipeline.executor import run_actions
from hybrid.pipeline.schedules import build_schedule, forward_only
from hybrid.pipeline.simulator import check
from hybrid.zero import ZeroEngine
from models.gpt import GPT


@functools.lru_cache(maxsize=8)
def checked_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` for ``p`` ranks of ``v`` stages each and ``m`` micro-batches,
    its lists refused unless the simulator's checks pass (built once per micro-batch
    count: a batch ramp-up changes it)."""
    schedule = build_schedule(name, p, m, v)
    check(schedule)
    return schedule


def activation_shape(micro_batch: int, seq_length: int, hidden: int, ps: ParallelState,
                     sequence_parallel: bool) -> tuple[int, int, int]:
    """What travels between stages: ``(B, T / cp, C)``, or ``(B, T / (cp * tp), C)``
    under sequence parallelism (known from the config: no shape handshake)."""
    t = seq_length // ps.cp_size
    return (micro_batch, t // ps.tp_size if sequence_parallel else t, hidden)


def stage_reads(ps: ParallelState) -> str:
    """What this rank reads of each sample (``dp_micro_batches``' ``reads``): at PP 1
    everything; under a pipeline the first stage the tokens, the last the labels (and
    the loss mask), a middle stage nothing."""
    if ps.pp_size == 1:
        return "all"
    return "tokens" if ps.is_first_stage else "labels" if ps.is_last_stage else "none"


def pipeline_train_step(model: GPT, engine: ZeroEngine, micro_batches, lr: float,
                        ps: ParallelState, schedule: str, shape: tuple[int, int, int],
                        dtype: torch.dtype, reshard_after_micro_batch: bool = False):
    """One optimizer step over this rank's micro-batches, through the pipeline; returns
    (the step's loss, StepResult, the ``(n,)`` micro-batch losses), equal on every
    stage (module doc). ``micro_batches``: this stage's share of each
    (:func:`stage_reads`). ``schedule``: ``--pipeline-schedule``'s name; ``shape`` and
    ``dtype``: of the activations between stages (:func:`activation_shape`);
    ``reshard_after_micro_batch``: ZeRO-3 frees the stage's gathered parameters after each
    micro-batch's forward and backward instead of holding them for the step
    (``--pipeline-reshard-after-micro-batch``; hybrid/pipeline/executor.py, [Note: ZeRO-3's
    parameters over a step])."""
    engine.zero_grad()
    batches = list(micro_batches)  # (tokens, labels[, loss mask]) each
    n = len(batches)
    p, v = ps.pp_size, len(model.chunks)
    lists = checked_schedule(schedule, p, n, v)
    scale = engine.scaler.scale

    def forward(stage: int, j: int, x: torch.Tensor | None) -> torch.Tensor:
        b = batches[j]
        if x is None:  # the first stage reads the tokens
            return model(b[0])
        if stage < p * v - 1:
            return model(hidden=x, chunk=stage_chunk(stage, p))
        loss = model(hidden=x, labels=b[1], loss_mask=b[2] if len(b) > 2 else None,
                     chunk=v - 1)
        return loss / n * scale if scale != 1.0 else loss / n

    # what each stage's weight gradient goes to: its chunk's parameters
    chunks = [[q for q in c if q.requires_grad] for c in model.chunk_parameters()]
    params = {c * p + ps.pp_rank: chunks[c] for c in range(v)}
    # the store its linears defer weight gradients to (GPT(split_backward=True)), or none
    store = model.weight_grads
    weight_grads = None if store is None else {s: store for s in params}
    got = run_actions(lists.ranks[ps.pp_rank], forward, params, ps.pp_group,
                      shape=shape, dtype=dtype, device=ps.device, stages=p * v,
                      zero=engine, weight_grads=weight_grads, peers=lists.ranks,
                      reshard_after_micro_batch=reshard_after_micro_batch)
    # the other stages may still drain their backwards: the offloaded step's first reads
    # and their speculative update start now (hybrid/zero/offload/host_step.py, [Note:
    # what starts before the step]); ``lr`` is the step's, its divisor step()'s default
    engine.prefetch_step(lr)
    losses = torch.zeros(n, dtype=torch.float32, device=ps.device)
    for j, loss in got.items():  # (what was backpropagated: loss / n * scale)
        losses[j] = loss.float() * (n / scale)
    ps.pp_group.all_reduce(losses)  # the last stage's, on every stage
    total = losses.sum() / n
    result = engine.step(lr, loss=total)
    return total, result, losses / n


@torch.no_grad()
def pipeline_evaluate(model: GPT, samples, s: LoopConfig, ps: ParallelState,
                      shape: tuple[int, int, int], dtype: torch.dtype, eod: int | None = None,
                      keep: torch.Tensor | None = None) -> float:
    """:func:`hybrid.train.step.evaluate` through the pipeline, forward only: each
    micro-batch's activations go stage to stage (each stage reading its share of the
    data, :func:`stage_reads`), the last stage's losses are summed, then averaged over
    DP and shared with every stage."""
    model.eval()
    total = torch.zeros((), device=ps.device)
    count = 0
    p, r, v = ps.pp_size, ps.pp_rank, len(model.chunks)
    for k in range(s.eval_iters):
        batches = list(dp_micro_batches(samples, k * s.global_batch_size, s.global_batch_size,
                                        s.micro_batch_size, ps.dp_rank, ps.dp_size, ps.device,
                                        eod, keep, stage_reads(ps)))

        def forward(stage: int, j: int, x: torch.Tensor | None,
                    batches=batches) -> torch.Tensor:
            b = batches[j]
            if x is None:
                return model(b[0])
            if stage < p * v - 1:
                return model(hidden=x, chunk=stage_chunk(stage, p))
            return model(hidden=x, labels=b[1], loss_mask=b[2] if len(b) > 2 else None,
                         chunk=v - 1)

        lists = forward_only(p, len(batches), v)
        got = run_actions(lists.ranks[r], forward, {}, ps.pp_group, shape=shape, dtype=dtype,
                          device=ps.device, stages=p * v, peers=lists.ranks)
        for loss in got.values():
            total += loss.float()
        count += len(batches)
    model.train()
    ps.dp_group.all_reduce(total)
    ps.pp_group.all_reduce(total)  # the last stage's sum, on every stage
    return float(total) / (count * ps.dp_size)
