"""Skipped steps: counted, explained and bounded, without a host wait per iteration.

A step the engine skipped (non-finite loss or gradients) is known on the device
first; its flag is read only when the loop reads anyway (a log line, a save, the
end: see :mod:`hybrid.train.step_stats`, [Note: one wait per log interval]).
:class:`SkippedSteps` then replays the held steps in order: it counts them,
says why each real one happened (:mod:`hybrid.train.nonfinite`), and stops the
run after ``--exit-on-nan-iterations`` in a row. fp16 overflows while the
dynamic loss scale is still coming down are routine and neither explained nor
counted towards the limit.
"""

from __future__ import annotations

import logging

import torch

from hybrid.errors import TrainingError
from hybrid.parallel.state import ParallelState
from hybrid.train import nonfinite
from hybrid.train.step_stats import PendingSteps

log = logging.getLogger("hybrid")


def scale_coming_down(scaler) -> bool:
    """An fp16 overflow with room left to lower the dynamic loss scale: routine."""
    return scaler.dynamic and scaler.scale > scaler.min_scale


class SkippedSteps:
    """The skip bookkeeping of one run (rank-local state; :meth:`settle` may run the
    collectives of :func:`hybrid.train.nonfinite.explain` on every rank together).

    ``patience``: ``--exit-on-nan-iterations``; ``micro_batch_size`` locates the
    micro-batch that went non-finite.
    """

    def __init__(self, model: torch.nn.Module, engine, ps: ParallelState,
                 micro_batch_size: int, patience: int):
        self.model, self.engine, self.ps = model, engine, ps
        self.micro_batch_size, self.patience = micro_batch_size, patience
        self.total = 0  # steps skipped so far (the log line's skipped_iterations)
        self.streak = 0  # consecutive non-routine skips up to the last settled step
        self._pending = PendingSteps()
        self._held: dict = {}  # iteration -> (micro-batch losses, first sample, batch size)
        self._newest = 0

    @property
    def clean(self) -> bool:
        """No non-finite step is outstanding: safe to save."""
        return self.streak == 0

    def add(self, iteration: int, result, losses: torch.Tensor, first_sample: int,
            batch_size: int) -> None:
        """Hold ``iteration``'s StepResult with what explaining a skip would need."""
        self._pending.add(iteration, result)
        self._held[iteration] = (losses, first_sample, batch_size)
        self._newest = iteration

    def settle(self, force: bool) -> None:
        """Replay the held steps whose flags are known (all of them when ``force``);
        TrainingError past the patience."""
        for iteration, _, skipped in self._pending.settle(force):
            losses, first, size = self._held.pop(iteration)
            self.total += int(skipped)
            why = ""
            if skipped and not scale_coming_down(self.engine.scaler):
                # Only steps already known non-finite pay for the explanation. The
                # gradients held are those of the newest step only.
                why = nonfinite.explain(self.model, self.engine, self.ps, losses, first, size,
                                        self.micro_batch_size,
                                        grads_held=iteration == self._newest)
                if self.ps.rank == 0:
                    log.warning("iteration %d skipped (loss scale now %.1f): %s", iteration,
                                self.engine.scaler.scale, why)
            self._count(skipped, iteration, why)
        if force:
            self.engine.poll_warnings()

    def _count(self, skipped: bool, iteration: int, why: str) -> None:
        if not skipped:
            self.streak = 0
            return
        if scale_coming_down(self.engine.scaler):
            return
        self.streak += 1
        if self.streak >= self.patience:
            raise TrainingError(
                f"loss or gradients were not finite for {self.streak} consecutive iterations "
                f"(up to {iteration}; at {iteration}: {why}); stopping without saving. Lower "
                f"--lr, raise --clip-grad's strictness, or check the data "
                f"(--exit-on-nan-iterations sets the patience)")
