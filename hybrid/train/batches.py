"""How big each step's batch is and when the run ends, as pure functions of where
the run is (iteration, samples consumed): resuming needs no state of its own."""

from __future__ import annotations

from hybrid.config.sections import LoopConfig


def global_batch_size_at(s: LoopConfig, consumed_samples: int) -> int:
    """The global batch of the step that starts after ``consumed_samples``.

    With ``s.rampup = (start, incr, ramp_samples)`` (Megatron's
    ``--rampup-batch-size``) the batch is ``start + k * incr`` once ``k`` ramp
    intervals of ``ramp_samples / ((global - start) / incr)`` samples have been
    consumed, and ``s.global_batch_size`` from then on.
    """
    if s.rampup is None:
        return s.global_batch_size
    start, incr, ramp_samples = s.rampup
    increments = (s.global_batch_size - start) // incr
    if increments == 0 or consumed_samples >= ramp_samples:
        return s.global_batch_size
    k = int(consumed_samples / (ramp_samples / increments))
    return min(start + k * incr, s.global_batch_size)


def finished(s: LoopConfig, iteration: int, consumed_samples: int) -> bool:
    """Whether the run has done its ``--train-iters`` or ``--train-samples``.

    A sample-based run takes whole batches only: it stops before a step that
    would pass ``--train-samples``.
    """
    if s.train_samples is None:
        assert s.train_iters is not None  # exactly one of the two is set
        return iteration >= s.train_iters
    return consumed_samples + global_batch_size_at(s, consumed_samples) > s.train_samples


def total_iterations(s: LoopConfig) -> int:
    """How many iterations the run has in all (a sample-based run walks its ramp:
    one step of arithmetic per iteration, once at start-up)."""
    if s.train_samples is None:
        assert s.train_iters is not None  # exactly one of the two is set
        return s.train_iters
    n = consumed = 0
    if s.rampup is None:
        return s.train_samples // s.global_batch_size
    while not finished(s, n, consumed):
        consumed += global_batch_size_at(s, consumed)
        n += 1
    return n
