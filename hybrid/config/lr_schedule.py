"""Learning rate as a pure function of the iteration or the samples consumed
(so resuming needs no state)."""

from __future__ import annotations

import math

from hybrid.config.sections import LRScheduleConfig


def learning_rate(done: int, lr: float, min_lr: float, warmup_iters: int,
                  decay_iters: int, style: str, warmup_init: float = 0.0,
                  warmup_style: str = "linear") -> float:
    """LR of the step taken after ``done`` steps (or samples: whatever ``warmup_iters``
    and ``decay_iters`` count) -- Megatron-LM's scheduler position, which counts what was
    done before the step (the Note in :func:`scheduled_lr`).

    Warmup over ``warmup_iters`` from ``warmup_init`` towards ``lr``: the fraction
    ``done / warmup_iters`` of the way (linear, Megatron's: the first step runs at
    ``warmup_init``), or ``log(done + 1) / log(warmup_iters)`` (log, DeepSpeed's WarmupLR
    shape, on the 1-based step). Then ``constant``, ``linear`` or ``cosine`` decay to
    ``min_lr`` at ``decay_iters``, and ``min_lr`` after.
    """
    if warmup_style == "log" and warmup_iters > 0 and done + 1 <= warmup_iters:
        frac = math.log(done + 1) / math.log(warmup_iters) if warmup_iters > 1 else 1.0
        return warmup_init + (lr - warmup_init) * frac
    if warmup_style != "log" and warmup_iters > 0 and done <= warmup_iters:
        # (in this order: with warmup_init 0, exactly lr * done / warmup)
        return warmup_init + (lr - warmup_init) * done / warmup_iters
    if style == "constant":
        return lr
    if done >= decay_iters:
        return min_lr
    span = max(1, decay_iters - warmup_iters)
    frac = (done - warmup_iters) / span
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - frac)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"unknown lr decay style {style!r}")


def deepspeed_lr(step: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 style: str, warmup_init: float = 0.0, warmup_style: str = "log") -> float:
    """The rate DeepSpeed's scheduler gives optimizer step ``step`` (1-based), with the
    arguments of :func:`learning_rate` as a ds_config scheduler block sets them
    (:mod:`hybrid.config.deepspeed_schedule`).

    [Note: DeepSpeed's step counting] DeepSpeed's WarmupLR, WarmupDecayLR and
    WarmupCosineLR write their rate into the optimizer when built and after each
    optimizer step, from ``i``, the count of ``step()`` calls minus one: step 1 runs at
    ``i = -1`` (the warmup start; 0.0 for WarmupCosineLR), step 2 at ``i = 0`` (the
    warmup start again, since log(1) = 0 and 0 / N = 0), step ``k`` at ``i = k - 2``.
    The warmup lasts ``N = max(2, warmup_iters)``: a fraction log(i + 1) / log(N) or
    i / N of the way from ``warmup_init`` to ``lr``. After it, a constant ``lr``; a
    linear decay by (T - i) / (T - N) towards ``min_lr`` (0 past ``T = decay_iters``);
    or a cosine over ``(i - N + 1) / (T - N)`` of the way, held at its end.
    """
    i = step - 2
    if i < 0:
        return 0.0 if style == "cosine" else warmup_init
    n = max(2, warmup_iters)
    if i < n:
        frac = math.log(i + 1) / math.log(n) if warmup_style == "log" else i / n
        return warmup_init + (lr - warmup_init) * frac
    if style == "constant":
        return lr
    span = float(max(1, decay_iters - n))
    if style == "linear":
        return min_lr + (lr - min_lr) * max(0.0, (decay_iters - i) / span)
    if style == "cosine":
        progress = min(1.0, (i - n + 1) / span)
        return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * progress)) / 2
    raise ValueError(f"unknown lr decay style {style!r}")


def scheduled_lr(sched: LRScheduleConfig, iteration: int, consumed_before: int) -> float:
    """LR of the step that makes 1-based ``iteration``, ``consumed_before`` samples
    having been consumed before it, under ``sched``. ``sched.steps`` "deepspeed":
    DeepSpeed's counting, by iterations (:func:`deepspeed_lr`).

    [Note: Megatron's step counting]
    Megatron-LM's OptimizerParamScheduler sets the rate at its construction (position 0)
    and after each optimizer step (the position advanced by the global batch, in samples,
    or by one iteration): iteration ``k`` runs at the position after ``k - 1`` steps, so a
    linear warmup's first step runs at ``--lr-warmup-init`` (0 by default) and its
    ``warmup + 1``-th at the peak. The position here is the same: ``iteration - 1``, or
    ``consumed_before`` when the schedule counts samples. The two agree with a constant
    batch (the ratios are the same integers); with a batch-size ramp the samples count."""
    if sched.steps == "deepspeed":
        return deepspeed_lr(iteration, sched.lr, sched.min_lr, sched.warmup, sched.decay,
                            sched.decay_style, sched.warmup_init, sched.warmup_style)
    done = consumed_before if sched.unit == "samples" else iteration - 1
    return learning_rate(done, sched.lr, sched.min_lr, sched.warmup, sched.decay,
                         sched.decay_style, sched.warmup_init, sched.warmup_style)
