"""The optimizer and scheduler a Trainer's loop holds when hybrid's engine trains.

The engine takes the optimizer step and the schedule's step itself, inside
``engine.step()`` at the end of each accumulation window (the Trainer's
``training_step`` calls it, as accelerate's DeepSpeed wrapper calls DeepSpeed's).
The Trainer's loop still calls ``optimizer.step()``, ``optimizer.zero_grad()`` and
``lr_scheduler.step()`` afterwards: here they do nothing, so nothing steps twice.
What the loop and callbacks read (``param_groups``, ``get_last_lr()``) is the
engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybrid.engine.api import Engine


class EngineStepsOptimizer:
    """``trainer.optimizer``: the engine's optimizer (``engine.optimizer``: its
    ``param_groups`` hold the next step's rate), whose step the engine takes."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Nothing: ``engine.step()`` in ``training_step`` took this window's step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine clears the gradients when a window starts."""

    def state_dict(self) -> dict:
        """The engine's answer (its optimizer state is sharded: saved by the
        engine's checkpoint, which the Trainer's save writes)."""
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.optimizer.load_state_dict(state)


class EngineStepsSchedule:
    """``trainer.lr_scheduler``: whatever sets the engine's rates (the config's schedule,
    the Trainer's own scheduler), which the engine steps after each optimizer step."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def step(self, *args: object, **kwargs: object) -> None:
        """Nothing: ``engine.step()`` stepped the schedule with the optimizer."""

    def get_last_lr(self) -> list[float]:
        """The rates in the groups now: after an optimizer step, the next step's. The
        Trainer logs it as that step's ``learning_rate``, as it does under DeepSpeed, whose
        engine has stepped its scheduler by then (without DeepSpeed the Trainer logs the
        rate the step ran at: one step behind, on a schedule that changes)."""
        return [float(g["lr"]) for g in self.engine.optimizer.param_groups]

    def state_dict(self) -> dict:
        """The engine's scheduler's (saved with the engine's checkpoint too)."""
        sched = self.engine.lr_scheduler
        return {} if sched is None else sched.state_dict()

    def load_state_dict(self, state: dict) -> None:
        sched = self.engine.lr_scheduler
        if sched is not None:
            sched.load_state_dict(state)
