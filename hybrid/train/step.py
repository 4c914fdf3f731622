"""GPT's stages on :mod:`hybrid.pipeline.step`: one optimizer step, and one evaluation,
over this rank's micro-batches, at any PP size.

Data flows one way::

    this DP rank's micro-batches -> its stage of the GPT (TP layers; the first stage
    from the tokens, the others from the activations received) -> the last stage's
    loss / n_micro -> backward, stage by stage in the schedule's order (ZeRO hooks
    reduce each stage's grads over DP in buckets) -> unscale, clip by the global norm
    -> AdamW on this rank's shard -> all-gather params

At PP 1 the one stage is the whole model and the schedule the trivial one (a forward and
a backward per micro-batch); the step itself, its loss path and what it shares between
stages are :func:`hybrid.pipeline.step.train_step`'s.

With interleaving (``--virtual-pipeline-model-parallel-size v``) the rank's model
holds v chunks, stages r, r + p, ... (:class:`models.gpt.GPT`'s ``chunks``): stage
s runs chunk ``s // p``, its backward reaches that chunk's parameters, and the
engine reduces each chunk's at the chunk's last backward
(:mod:`hybrid.zero.parts`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from hybrid.config.sections import LoopConfig
from hybrid.data.dataset import dp_micro_batches
from hybrid.parallel.state import ParallelState
from hybrid.pipeline.actions import stage_chunk
from hybrid.pipeline.executor import Forward, run_actions
from hybrid.pipeline.schedules import forward_only
from hybrid.pipeline.step import TRIVIAL, Clock, checked_schedule, train_step as schedule_step
from hybrid.pipeline.wire import Activation
from hybrid.zero import StepResult, ZeroEngine
from models.gpt import GPT


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


def gpt_forward(model: GPT, batches: list, p: int) -> Forward:
    """Stage ``stage``'s forward of micro-batch ``j`` (``batches[j]``: ``(tokens, labels[,
    loss mask])``, this stage's share): the first stage from the tokens, the others from
    ``x``; the last stage returns the loss (at PP 1 the one stage does both)."""
    v = len(model.chunks)

    def forward(stage: int, j: int, x: Activation | None) -> torch.Tensor:
        b = batches[j]
        last = stage == p * v - 1
        if x is None:
            return model(*b) if last else model(b[0])
        assert isinstance(x, torch.Tensor)  # (GPT's stages pass one tensor)
        if not last:
            return model(hidden=x, chunk=stage_chunk(stage, p))
        return model(hidden=x, labels=b[1], loss_mask=b[2] if len(b) > 2 else None,
                     chunk=v - 1)
    return forward


def train_step(model: GPT, engine: ZeroEngine, micro_batches, lr: float,
               meter: AbstractContextManager[object] | None = None,
               clock: Clock | None = None, *, schedule: str = TRIVIAL,
               shape: tuple[int, int, int] | None = None, dtype: torch.dtype = torch.float32,
               reshard_after_micro_batch: bool = False
               ) -> tuple[torch.Tensor, StepResult, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns (the step's loss,
    StepResult, the ``(n,)`` micro-batch losses, each divided by n), equal on every
    stage. ``micro_batches``: this stage's share of each (:func:`stage_reads`).
    ``meter`` measures the activations saved for backward and ``clock``
    (:mod:`hybrid.train.phase_clock`) times forward, backward, pipeline messages and
    the optimizer (hybrid/pipeline/step.py, [Note: what the watch sees]). Under a
    pipeline (the engine's ``ps.pp_size > 1``): ``schedule``, ``--pipeline-schedule``'s
    name; ``shape`` and ``dtype``, of the activations between stages
    (:func:`activation_shape`); ``reshard_after_micro_batch``: ZeRO-3 frees the stage's
    gathered parameters after each micro-batch's forward and backward instead of
    holding them for the step (``--pipeline-reshard-after-micro-batch``;
    hybrid/pipeline/executor.py, [Note: ZeRO-3's parameters over a step]). At PP 1 the
    one stage is the whole model: it is freed after each micro-batch, as ever. A
    non-finite loss skips the step even if the gradients are finite."""
    ps = engine.ps
    batches = list(micro_batches)
    p, v = ps.pp_size, len(model.chunks)
    # the MoE layers' losses get the gradient the main loss gets: 1 / n times the loss
    # scale ([Note: the loss path] in hybrid/pipeline/step.py; models/moe.py, [Note: the
    # MoE losses' gradient])
    model.moe_loss_scale.value = engine.scaler.scale / len(batches)
    io: tuple[int, ...] | None = shape
    if p == 1:
        schedule, io, reshard_after_micro_batch = TRIVIAL, (), True  # (nothing is sent)
    elif io is None:
        raise ValueError("train_step under a pipeline: pass the activations' shape")
    lists = checked_schedule(schedule, p, len(batches), v)
    # what each stage's weight gradient goes to: its chunk's parameters
    chunks = [[q for q in c if q.requires_grad] for c in model.chunk_parameters()]
    params = {c * p + ps.pp_rank: chunks[c] for c in range(v)}
    # the store its linears defer weight gradients to (GPT(split_backward=True)), or none
    store = model.weight_grads
    weight_grads = None if store is None else {s: store for s in params}
    return schedule_step(gpt_forward(model, batches, p), lists, engine, lr, ps.pp_group,
                         shape=io, dtype=dtype, device=ps.device, params=params,
                         weight_grads=weight_grads,
                         reshard_after_micro_batch=reshard_after_micro_batch,
                         clock=clock, meter=meter)


@torch.no_grad()
def evaluate(model: GPT, samples, s: LoopConfig, ps: ParallelState,
             shape: tuple[int, int, int] | None = None, dtype: torch.dtype = torch.float32,
             eod: int | None = None, keep: torch.Tensor | None = None) -> float:
    """Mean loss over ``--eval-iters`` full global batches from the start of ``samples``
    (the same batches every time, so evaluations compare), forward only: each
    micro-batch's activations go stage to stage (each stage reading its share of the
    data, :func:`stage_reads`), the last stage's losses are summed, averaged over DP (one
    all-reduce over the DP group; the CP ranks of a DP rank already agree) and shared
    with every stage. ``shape``/``dtype``: as :func:`train_step`'s (PP > 1); ``keep``:
    this CP rank's sequence positions (see ``dp_micro_batches``)."""
    model.eval()
    total = torch.zeros((), device=ps.device)
    count = 0
    p, r, v = ps.pp_size, ps.pp_rank, len(model.chunks)
    for k in range(s.eval_iters):
        batches = list(dp_micro_batches(samples, k * s.global_batch_size, s.global_batch_size,
                                        s.micro_batch_size, ps.dp_rank, ps.dp_size, ps.device,
                                        eod, keep, stage_reads(ps)))
        lists = forward_only(p, len(batches), v)
        got = run_actions(lists.ranks[r], gpt_forward(model, batches, p), {}, ps.pp_group,
                          shape=shape if p > 1 else (), dtype=dtype, device=ps.device,
                          stages=p * v, peers=lists.ranks)
        for j in sorted(got):
            total += got[j].float()
        count += len(batches)
    model.train()
    ps.dp_group.all_reduce(total)
    ps.pp_group.all_reduce(total)  # the last stage's sum, on every stage
    return float(total) / (count * ps.dp_size)
