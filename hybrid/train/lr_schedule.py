"""Learning rate as a pure function of the iteration or the samples consumed
(so resuming needs no state)."""

from __future__ import annotations

import math

from hybrid.config.sections import LRScheduleConfig


def learning_rate(iteration: int, lr: float, min_lr: float, warmup_iters: int,
                  decay_iters: int, style: str, warmup_init: float = 0.0,
                  warmup_style: str = "linear") -> float:
    """LR for 1-based ``iteration``.

    Warmup over ``warmup_iters`` from ``warmup_init`` towards ``lr``: the fraction
    ``iteration / warmup_iters`` of the way (linear, Megatron's; ``lr / warmup_iters``
    first with ``warmup_init`` 0) or ``log(iteration) / log(warmup_iters)`` (log,
    DeepSpeed's WarmupLR default: ``warmup_init`` first). Then ``constant``,
    ``linear`` or ``cosine`` decay to ``min_lr`` at ``decay_iters``, and ``min_lr`` after.
    """
    if warmup_iters > 0 and iteration <= warmup_iters:
        if warmup_style == "log":
            frac = math.log(iteration) / math.log(warmup_iters) if warmup_iters > 1 else 1.0
            return warmup_init + (lr - warmup_init) * frac
        # (in this order: with warmup_init 0, exactly the lr * iteration / warmup of old)
        return warmup_init + (lr - warmup_init) * iteration / warmup_iters
    if style == "constant":
        return lr
    if iteration >= decay_iters:
        return min_lr
    span = max(1, decay_iters - warmup_iters)
    frac = (iteration - warmup_iters) / span
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - frac)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"unknown lr decay style {style!r}")


def scheduled_lr(sched: LRScheduleConfig, iteration: int, consumed_samples: int) -> float:
    """LR for the step that ends at 1-based ``iteration`` having consumed
    ``consumed_samples`` (this step's batch included), under ``sched``: the
    schedule counts iterations or samples, as ``sched.unit`` says. With a
    constant batch the two give the same rates (the ratios are the same integers)."""
    step = consumed_samples if sched.unit == "samples" else iteration
    return learning_rate(step, sched.lr, sched.min_lr, sched.warmup, sched.decay,
                         sched.decay_style, sched.warmup_init, sched.warmup_style)
