"""The lines DeepSpeed's engines print every ``steps_per_print`` optimizer steps.

DeepSpeed's engine logs one line on global rank 0 when it is built and after every
``steps_per_print``-th optimizer step (its ``_report_progress``, through ``log_dist``)::

    [Rank 0] step=10, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]

``lr``: each group's rate of the next step; ``mom``: each group's ``betas`` (its
``momentum`` when the optimizer is SGD or RMSprop; 0.0 for a group without one; a list
when the ds_config's ``optimizer`` block writes them, as DeepSpeed's own Adam keeps them);
``skipped``: the optimizer steps fp16's loss scale skipped so far. Its pipeline engine
also prints (``print``, global rank 0), after the same steps::

    steps: 10 loss: 2.3026 iter time (s): 0.012 samples/sec: 1333.333

``loss``: the batch's mean loss ``train_batch`` returned; ``iter time``: the seconds the
``train_batch`` calls since the last such line took, per call; ``samples/sec``:
``train_batch_size()`` over that. Without ``steps_per_print`` (DeepSpeed's default is
None) neither is printed, and neither is here.

The logged line goes to the logger ``hybrid.deepspeed`` (``deepspeed.utils.logger``),
which writes INFO and above to the process's current stdout by itself, in DeepSpeed's
format, so a script sees the lines without configuring logging. (DeepSpeed 0.19.8's
own logger is at WARNING, where these INFO lines show only once its level is lowered;
earlier releases logged at INFO.)
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    import torch

    from hybrid.engine.surface import EngineOptimizer
    from hybrid.zero import StepResult


class Engine(Protocol):
    """What the lines read of :class:`hybrid.engine.api.Engine` (which imports this)."""

    global_steps: int
    optimizer: EngineOptimizer

    @property
    def global_rank(self) -> int: ...

    def get_lr(self) -> list[float]: ...

    def train_batch_size(self) -> int: ...


class _CurrentStdout(logging.StreamHandler):
    """A handler that writes to ``sys.stdout`` as it is at each record (a script's or a
    test's redirection applies), not as it was when the logger was made."""

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # (logging.StreamHandler's constructor sets it)


def deepspeed_logger() -> logging.Logger:
    """``hybrid.deepspeed``'s logger (DeepSpeed's ``deepspeed.utils.logger``): INFO and above
    to stdout in DeepSpeed's format, not passed on to the ``hybrid`` logger (so a training
    loop's own handler does not print a line twice). Made once per process."""
    logger = logging.getLogger("hybrid.deepspeed")
    if not any(isinstance(h, _CurrentStdout) for h in logger.handlers):
        handler = _CurrentStdout()
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _moments(engine: Engine, listed: bool) -> list[Any]:
    """DeepSpeed's ``engine.get_mom()``: per group, ``momentum`` for SGD and RMSprop, else
    ``betas`` (hybrid's AdamW's as a list when ``listed``); 0.0 for a group without it."""
    client = engine.optimizer.client
    key = "momentum" if type(client).__name__ in ("SGD", "RMSprop") else "betas"
    out = [g.get(key, 0.0) for g in engine.optimizer.param_groups]
    return [list(m) for m in out] if listed and client is None else out


class Progress:
    """An engine's progress lines (module doc), as the ds_config ``ds`` asks: its
    ``steps_per_print`` (none: no lines). Built once the engine is, it logs the step 0
    line, as DeepSpeed's engine does once its optimizer is made."""

    def __init__(self, ds: Mapping[str, Any], engine: Engine):
        every = ds.get("steps_per_print")  # ("auto" and the like: unset, as a missing key)
        self.every = every if isinstance(every, int) and not isinstance(every, bool) else None
        self.engine = engine
        # DeepSpeed's own Adam keeps the betas as the config wrote them, a JSON list
        # (mom=[[0.9, 0.999]]); torch's (torch_adam) and a client's hold a tuple
        block = ds.get("optimizer")
        params = block.get("params") if isinstance(block, Mapping) else None
        self.listed = (isinstance(params, Mapping) and isinstance(params.get("betas"), list)
                       and not params.get("torch_adam"))
        self.skipped = 0  # optimizer steps fp16 skipped (DeepSpeed's engine.skipped_steps)
        self._seconds = 0.0  # train_batch time since the last pipeline line
        self._started: float | None = None
        self.report(0)

    def get_mom(self) -> list[Any]:
        """DeepSpeed's ``engine.get_mom()``: each group's betas (SGD's momentum)."""
        return _moments(self.engine, self.listed)

    def due(self) -> bool:
        """Whether the optimizer step just counted ends a ``steps_per_print`` window."""
        return self.every is not None and self.engine.global_steps % self.every == 0

    def report(self, step: int) -> None:
        """The ``[Rank 0] step=...`` line, on global rank 0."""
        if self.every and self.engine.global_rank == 0:
            deepspeed_logger().info("[Rank %d] step=%d, skipped=%d, lr=%s, mom=%s",
                                    self.engine.global_rank, step, self.skipped,
                                    self.engine.get_lr(), self.get_mom())

    def stepped(self, result: StepResult) -> None:
        """After an optimizer step was counted (and the schedule stepped): the step's skip
        counted, and the line when it is due."""
        self.skipped += result.host_skipped is True
        if self.due():
            self.report(self.engine.global_steps)

    # -- the pipeline engine's line ---------------------------------------------------------
    def batch_started(self) -> None:
        self._started = time.perf_counter()

    def batch_ended(self, loss: torch.Tensor) -> None:
        """After ``train_batch`` counted its step: its time added, and on global rank 0 the
        ``steps: ...`` line when it is due (the time since the last line restarts)."""
        if self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._started = None
        if not self.due():
            return
        per_step = self._seconds / (self.every or 1)
        self._seconds = 0.0
        if self.engine.global_rank == 0:
            rate = self.engine.train_batch_size() / per_step if per_step > 0 else float("inf")
            print(f"steps: {self.engine.global_steps} loss: {float(loss):0.4f} "
                  f"iter time (s): {per_step:0.3f} samples/sec: {rate:0.3f}", flush=True)
