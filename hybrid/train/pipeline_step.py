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
"""

from __future__ import annotations

import functools

import torch

from hybrid.config.sections import LoopConfig
from hybrid.data.dataset import dp_micro_batches
from hybrid.parallel.state import ParallelState
from hybrid.pipeline.actions import Action, Kind, Schedule
from hybrid.pipeline.executor import run_actions
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulator import check
from hybrid.zero import ZeroEngine


@functools.lru_cache(maxsize=8)
def checked_schedule(name: str, p: int, m: int) -> Schedule:
    """The schedule ``name`` for ``p`` stages and ``m`` micro-batches, its lists refused
    unless the simulator's checks pass (built once per micro-batch count: a batch
    ramp-up changes it)."""
    schedule = build_schedule(name, p, m)
    check(schedule)
    return schedule


def activation_shape(micro_batch: int, seq_length: int, hidden: int, ps: ParallelState,
                     sequence_parallel: bool) -> tuple[int, int, int]:
    """What travels between stages: ``(B, T / cp, C)``, or ``(B, T / (cp * tp), C)``
    under sequence parallelism (known from the config: no shape handshake)."""
    t = seq_length // ps.cp_size
    return (micro_batch, t // ps.tp_size if sequence_parallel else t, hidden)


def pipeline_train_step(model: torch.nn.Module, engine: ZeroEngine, micro_batches, lr: float,
                        ps: ParallelState, schedule: str, shape: tuple[int, int, int],
                        dtype: torch.dtype):
    """One optimizer step over this rank's micro-batches, through the pipeline; returns
    (the step's loss, StepResult, the ``(n,)`` micro-batch losses), equal on every
    stage (module doc). ``schedule``: ``--pipeline-schedule``'s name; ``shape`` and
    ``dtype``: of the activations between stages (:func:`activation_shape`)."""
    engine.zero_grad()
    batches = list(micro_batches)  # (tokens, labels[, loss mask]) each
    n = len(batches)
    lists = checked_schedule(schedule, ps.pp_size, n)
    scale = engine.scaler.scale
    last = ps.is_last_stage

    def forward(stage: int, j: int, x: torch.Tensor | None) -> torch.Tensor:
        b = batches[j]
        if x is None:  # the first stage reads the tokens
            return model(b[0])
        if not last:
            return model(hidden=x)
        loss = model(hidden=x, labels=b[1], loss_mask=b[2] if len(b) > 2 else None)
        return loss / n * scale if scale != 1.0 else loss / n

    params = [p for p in model.parameters() if p.requires_grad]
    got = run_actions(lists.ranks[ps.pp_rank], forward, {ps.pp_rank: params}, ps.pp_group,
                      shape=shape, dtype=dtype, device=ps.device, stages=ps.pp_size,
                      zero=engine)
    losses = torch.zeros(n, dtype=torch.float32, device=ps.device)
    for j, v in got.items():  # (what was backpropagated: loss / n * scale)
        losses[j] = v.float() * (n / scale)
    ps.pp_group.all_reduce(losses)  # the last stage's, on every stage
    total = losses.sum() / n
    result = engine.step(lr, loss=total)
    return total, result, losses / n


@torch.no_grad()
def pipeline_evaluate(model: torch.nn.Module, samples, s: LoopConfig, ps: ParallelState,
                      shape: tuple[int, int, int], dtype: torch.dtype, eod: int | None = None,
                      keep: torch.Tensor | None = None) -> float:
    """:func:`hybrid.train.step.evaluate` through the pipeline, forward only: each
    micro-batch's activations go stage to stage, the last stage's losses are summed,
    then averaged over DP and shared with every stage."""
    model.eval()
    total = torch.zeros((), device=ps.device)
    count = 0
    p, r = ps.pp_size, ps.pp_rank
    for k in range(s.eval_iters):
        batches = list(dp_micro_batches(samples, k * s.global_batch_size, s.global_batch_size,
                                        s.micro_batch_size, ps.dp_rank, ps.dp_size, ps.device,
                                        eod, keep))
        actions: list[Action] = []
        for j in range(len(batches)):
            if r > 0:
                actions.append(Action(Kind.RECV_ACT, r, j, r - 1))
            actions.append(Action(Kind.FORWARD, r, j))
            if r < p - 1:
                actions.append(Action(Kind.SEND_ACT, r, j, r + 1))
        actions.append(Action(Kind.END, -1, -1))

        def forward(stage: int, j: int, x: torch.Tensor | None,
                    batches=batches) -> torch.Tensor:
            b = batches[j]
            if x is None:
                return model(b[0])
            if stage < p - 1:
                return model(hidden=x)
            return model(hidden=x, labels=b[1], loss_mask=b[2] if len(b) > 2 else None)

        got = run_actions(actions, forward, {}, ps.pp_group, shape=shape, dtype=dtype,
                          device=ps.device, stages=p)
        for v in got.values():
            total += v.float()
        count += len(batches)
    model.train()
    ps.dp_group.all_reduce(total)
    ps.pp_group.all_reduce(total)  # the last stage's sum, on every stage
    return float(total) / (count * ps.dp_size)
