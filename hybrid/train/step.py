"""One optimizer step, and one evaluation, over this rank's micro-batches.

Data flows one way::

    this DP rank's micro-batches -> GPT (TP layers) -> loss / n_micro -> backward
    (ZeRO hooks reduce grads over DP in buckets) -> unscale, clip by the global
    norm -> AdamW on this rank's shard -> all-gather params
"""

from __future__ import annotations

import contextlib

import torch

from hybrid.config.sections import LoopConfig
from hybrid.data.dataset import dp_micro_batches
from hybrid.parallel.state import ParallelState
from hybrid.train.activation_meter import SavedActivationMeter
from hybrid.train.phase_clock import UNTIMED, NoClock, PhaseClock
from hybrid.zero import ZeroEngine


def train_step(model: torch.nn.Module, engine: ZeroEngine, micro_batches, lr: float,
               meter: SavedActivationMeter | None = None,
               clock: PhaseClock | NoClock = UNTIMED):
    """One optimizer step over this rank's micro-batches; returns (local loss, StepResult,
    the ``(n,)`` micro-batch losses).

    Each micro-batch loss is a mean over its tokens; dividing by the number of
    micro-batches makes the accumulated gradient that of the mean over this
    rank's share, and the DP average makes it the global batch's. ``meter``
    measures the first micro-batch's forward and backward; ``clock``
    (:mod:`hybrid.train.phase_clock`) times forward, backward and the optimizer.
    A non-finite loss skips the step even if the gradients are finite.
    """
    engine.zero_grad()
    n = len(micro_batches)
    total, losses = None, []
    for i, batch in enumerate(micro_batches):  # (tokens, labels[, loss mask])
        with meter if (meter is not None and i == 0) else contextlib.nullcontext():
            with clock.phase("forward"):
                loss = model(*batch) / n
            with clock.phase("backward"):
                engine.backward(loss, sync=(i == n - 1))
        losses.append(loss.detach().float())
        total = losses[-1] if total is None else total + losses[-1]
    with clock.phase("optimizer"):
        result = engine.step(lr, loss=total)
    return total, result, torch.stack(losses)


@torch.no_grad()
def evaluate(model: torch.nn.Module, samples, s: LoopConfig, ps: ParallelState,
             eod: int | None = None, keep: torch.Tensor | None = None) -> float:
    """Mean loss over ``--eval-iters`` full global batches from the start of
    ``samples`` (the same batches every time, so evaluations compare), averaged
    over DP (one all-reduce over the DP group; the CP ranks of a DP rank already
    agree). ``keep``: this CP rank's sequence positions (see ``dp_micro_batches``)."""
    model.eval()
    total = torch.zeros((), device=ps.device)
    count = 0
    for k in range(s.eval_iters):
        for batch in dp_micro_batches(samples, k * s.global_batch_size, s.global_batch_size,
                                      s.micro_batch_size, ps.dp_rank, ps.dp_size, ps.device,
                                      eod, keep):
            total += model(*batch).float()
            count += 1
    model.train()
    ps.dp_group.all_reduce(total)
    return float(total) / (count * ps.dp_size)
