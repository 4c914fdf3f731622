"""One training step, written once: a schedule's forwards and backwards over this rank's
micro-batches, the loss path, and the optimizer step on the rank's shard.

    lists = checked_schedule("1f1b", p, n)          # at PP 1: F0 B0 F1 B1 ... END
    total, result, losses = train_step(forward, lists, engine, lr, pp_group,
                                       shape=(B, T, C), dtype=..., device=...)

Every door that trains a batch runs this function: the Trainer (``pretrain_gpt.py``;
:func:`hybrid.train.step.gpt_train_step` gives it GPT's stages) and DeepSpeed's
``PipelineEngine.train_batch`` (a ``PipelineModule``'s stages). At PP 1 the schedule is
the trivial one, a forward and a backward per micro-batch, run by the same executor as
any pipeline schedule (:mod:`hybrid.pipeline.executor`), so the loss path, the read-ahead
of an offloaded optimizer (``prefetch_step``), ``--timing-breakdown`` and the activation
meter are the same at every PP size. The API engine's per-micro-batch verbs
(``engine.backward(loss)``, ``engine.step()``: the user's loop owns the schedule) take
the same loss path, :func:`micro_batch_loss`.

[Note: the loss path]
Each micro-batch's loss is a mean over its tokens. Divided by the step's micro-batch
count ``n``, the accumulated gradient is that of the mean over the rank's share, and the
DP average makes it the global batch's. Backward runs on that times the fp16 loss scale,
multiplied in fp32 (:func:`~hybrid.zero.loss_scaler.scaled_loss`: a half-precision loss
would overflow in its own dtype). What is recorded is ``loss / n``, detached, in fp32;
the step's loss is their sum in micro-batch order (the non-finite check reads it, the
log line shows it). Under a pipeline the last stage computes them, and one all-reduce
over the pipeline group (the other stages adding zeros) gives them to every stage.

[Note: what the watch sees]
``--timing-breakdown``'s clock times each action: a forward as ``forward``, a backward
(or either half of one) as ``backward``, a send, a receive or the wait for the sends at
the end as ``pipeline`` (at PP 1 there are none), and the optimizer step as
``optimizer``. The activation meter
(:class:`hybrid.train.activation_meter.SavedActivationMeter`, on logged steps) runs from
the rank's first action to the end of micro-batch 0's backward at the rank's first
stage: at PP 1 one micro-batch's forward and backward, under a pipeline the warm-up's
micro-batches too -- what the stage holds at once, the peak 1F1B is known by.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from hybrid.parallel.comm import CommGroup
from hybrid.pipeline import wire
from hybrid.pipeline.actions import RECVS, SENDS, Action, Kind, Schedule
from hybrid.pipeline.executor import Forward, ZeroHooks, run_actions
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulator import check
from hybrid.tensor_parallel.weight_grad import WeightGradStore
from hybrid.zero.engine import StepResult
from hybrid.zero.loss_scaler import LossScaler, scaled_loss

# (at PP 1 every schedule's one rank runs this order; 1F1B writes it)
TRIVIAL = "1f1b"


class StepEngine(ZeroHooks, Protocol):
    """What the step asks of the rank's ZeRO engine (:class:`~hybrid.zero.ZeroEngine`)
    besides the executor's hooks: the loss scale, clearing the gradients, and the step."""

    scaler: LossScaler

    def zero_grad(self) -> None: ...

    def prefetch_step(self, lr: float | None = None, grad_divisor: float = 1.0) -> None: ...

    def step(self, lr: float, loss: torch.Tensor | None = None,
             grad_divisor: float = 1.0) -> StepResult: ...


class Clock(Protocol):
    """``--timing-breakdown``'s clock (:mod:`hybrid.train.phase_clock`): a context per
    phase."""

    def phase(self, name: str) -> AbstractContextManager[object]: ...


_PHASES = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward",
           Kind.BACKWARD_INPUT: "backward", Kind.BACKWARD_WEIGHT: "backward"}


@functools.lru_cache(maxsize=8)
def checked_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` for ``p`` ranks of ``v`` stages each and ``m`` micro-batches,
    its lists refused unless the simulator's checks pass (built once per micro-batch
    count: a batch ramp-up changes it)."""
    schedule = build_schedule(name, p, m, v)
    check(schedule)
    return schedule


def micro_batch_loss(loss: torch.Tensor, n: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss path ([Note: the loss path]): ``(loss / n, what backward runs on)``, the
    second being the first times the loss ``scale`` in fp32 (itself at scale 1)."""
    divided = loss / n if n != 1 else loss
    return divided, scaled_loss(divided, scale)


class _Watch:
    """The context each action runs in ([Note: what the watch sees])."""

    def __init__(self, clock: Clock | None, meter: AbstractContextManager[object] | None,
                 actions: tuple[Action, ...]):
        self.clock, self.meter = clock, meter
        first = min((a.stage for a in actions if a.kind in _PHASES), default=0)
        # the action that ends micro-batch 0's backward at the rank's first stage
        self.meter_until = next((a for a in actions if a.stage == first and a.microbatch == 0
                                 and a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT)), None)
        self.metering = False
        self.metered = False  # (once a step: from the first action to meter_until)
        # (at PP 1 the list sends nothing: its END waits for nothing and is not timed)
        self.p2p = any(a.kind in SENDS or a.kind in RECVS for a in actions)

    @contextlib.contextmanager
    def __call__(self, a: Action) -> Iterator[None]:
        if self.meter is not None and not self.metered and self.meter_until is not None:
            self.meter.__enter__()
            self.metering = self.metered = True
        phase = _PHASES.get(a.kind, "pipeline" if self.p2p else None)
        if self.clock is None or phase is None:
            yield
        else:
            with self.clock.phase(phase):
                yield
        if self.metering and a == self.meter_until:
            self.stop()

    def stop(self) -> None:
        if self.metering:
            assert self.meter is not None
            self.meter.__exit__(None, None, None)
            self.metering = False


def train_step(forward: Forward, lists: Schedule, engine: StepEngine, lr: float,
               pp: CommGroup, *, shape: tuple[int, ...] | None, dtype: torch.dtype,
               device: torch.device, params: dict[int, list[torch.nn.Parameter]],
               weight_grads: dict[int, WeightGradStore] | None = None,
               reshard_after_micro_batch: bool = False, learnt: wire.Learnt | None = None,
               clock: Clock | None = None, meter: AbstractContextManager[object] | None = None
               ) -> tuple[torch.Tensor, StepResult, torch.Tensor]:
    """One optimizer step over this rank's ``lists.m`` micro-batches (``n``); returns (the
    step's loss, the engine's StepResult, the ``(n,)`` recorded losses ``loss_j / n``), the
    same on every stage ([Note: the loss path]).

    ``forward(stage, j, x)``: stage ``stage``'s forward of micro-batch ``j`` from ``x``
    (None on stage 0: it reads the data), returning its output, or on the last stage the
    micro-batch's loss (undivided; this function divides and scales it). ``lists``: every
    pipeline rank's actions (:func:`checked_schedule`), this rank's run here; ``pp``: the
    pipeline group (this rank alone at PP 1). ``shape``/``dtype``/``learnt``,
    ``params``, ``weight_grads``, ``reshard_after_micro_batch``: as
    :func:`~hybrid.pipeline.executor.run_actions` takes them. ``clock``, ``meter``:
    [Note: what the watch sees]; None times and measures nothing."""
    engine.zero_grad()
    n, stages, scale = lists.m, lists.stages, engine.scaler.scale
    recorded: dict[int, torch.Tensor] = {}

    def run_stage(stage: int, j: int, x: wire.Activation | None) -> wire.Activation:
        out = forward(stage, j, x)
        if stage < stages - 1:
            return out
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise TypeError("the last stage's forward must return the micro-batch's loss, "
                            "one scalar tensor")
        divided, backpropagated = micro_batch_loss(out, n, scale)
        recorded[j] = divided.detach().float()
        return backpropagated

    mine = lists.ranks[pp.rank]
    watch = _Watch(clock, meter, mine) if clock is not None or meter is not None else None
    try:
        run_actions(mine, run_stage, params, pp, shape=shape, dtype=dtype, device=device,
                    stages=stages, zero=engine, weight_grads=weight_grads, peers=lists.ranks,
                    reshard_after_micro_batch=reshard_after_micro_batch, learnt=learnt,
                    around=watch)
    finally:
        if watch is not None:
            watch.stop()
    # the other stages may still drain their backwards: the offloaded step's first reads
    # and their speculative update start now (hybrid/zero/offload/host_step.py, [Note:
    # what starts before the step]); ``lr`` is the step's, its divisor step()'s default
    engine.prefetch_step(lr)
    # [n losses, their sum in order], from the last stage to every stage (one all-reduce)
    shared = torch.zeros(n + 1, dtype=torch.float32, device=device)
    if recorded:
        total = recorded[0]
        for j in range(1, n):
            total = total + recorded[j]
        shared[:n] = torch.stack([recorded[j] for j in range(n)])
        shared[n] = total
    pp.all_reduce(shared)
    with clock.phase("optimizer") if clock is not None else contextlib.nullcontext():
        result = engine.step(lr, loss=shared[n])
    return shared[n], result, shared[:n]
