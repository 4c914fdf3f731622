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


def scheduled_lr(sched: LRScheduleConfig, iteration: int, consumed_samples: int) -> float:
    """LR for the step that ends at 1-based ``iteration`` having consumed
    ``consumed_samples`` (this step's batch included), under ``sched``: the
    schedule counts iterations or samples, as ``sched.unit`` says. With a
    constant batch the two give the same rates (the ratios are the same integers).
    ``sched.steps`` "deepspeed": DeepSpeed's counting, by iterations
    (:func:`deepspeed_lr`)."""
    if sched.steps == "deepspeed":
        return deepspeed_lr(iteration, sched.lr, sched.min_lr, sched.warmup, sched.decay,
                            sched.decay_style, sched.warmup_init, sched.warmup_style)
    step = consumed_samples if sched.unit == "samples" else iteration
    return learning_rate(step, sched.lr, sched.min_lr, sched.warmup, sched.decay,
                         sched.decay_style, sched.warmup_init, sched.warmup_style)
