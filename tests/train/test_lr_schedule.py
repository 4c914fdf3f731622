"""The learning-rate schedule matches its formulas."""

import math

import pytest

from hybrid.config.lr_schedule import learning_rate

LR, MIN, WARM, DECAY = 1e-3, 1e-4, 10, 110


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero(style):
    for done in (0, 1, 5, 10):
        assert learning_rate(done, LR, MIN, WARM, DECAY, style) == pytest.approx(LR * done / WARM)


@pytest.mark.parametrize("unit", ["iterations", "samples"])
def test_iteration_k_runs_at_the_position_after_k_minus_1_steps(unit):
    """Megatron's counting: the first step of a warmup runs at --lr-warmup-init, step
    WARM + 1 at the peak; in samples, the samples consumed before the step count."""
    from hybrid.config.lr_schedule import scheduled_lr
    from hybrid.config.sections import LRScheduleConfig
    per = 1 if unit == "iterations" else 8
    sched = LRScheduleConfig(lr=LR, min_lr=MIN, decay_style="cosine", unit=unit,
                             warmup=WARM * per, decay=DECAY * per, warmup_init=1e-5)
    got = [scheduled_lr(sched, k, (k - 1) * 8) for k in (1, 2, WARM + 1, DECAY + 1)]
    assert got == pytest.approx([1e-5, 1e-5 + (LR - 1e-5) / WARM, LR, MIN])


def test_linear_and_cosine_decay_at_chosen_iterations():
    for it, frac in ((10, 0.0), (35, 0.25), (60, 0.5), (110, 1.0)):
        lin = learning_rate(it, LR, MIN, WARM, DECAY, "linear")
        cos = learning_rate(it, LR, MIN, WARM, DECAY, "cosine")
        if it > WARM:
            assert lin == pytest.approx(MIN + (LR - MIN) * (1 - frac))
            assert cos == pytest.approx(MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi * frac)))
    assert learning_rate(60, LR, MIN, WARM, DECAY, "cosine") == pytest.approx((LR + MIN) / 2)


def test_min_lr_after_decay_and_constant_stays():
    assert learning_rate(500, LR, MIN, WARM, DECAY, "cosine") == MIN
    assert learning_rate(500, LR, MIN, WARM, DECAY, "linear") == MIN
    assert learning_rate(500, LR, MIN, WARM, DECAY, "constant") == LR


@pytest.mark.peer("megatron.core")
@pytest.mark.parametrize("style,init", [("cosine", 0.0), ("linear", 1e-5), ("constant", 0.0)])
def test_every_iteration_runs_at_megatron_core_s_rate(style, init):
    """megatron-core 0.16.1's OptimizerParamScheduler, built and stepped as Megatron-LM's
    training loop does (warmup and decay in samples: iterations x the global batch;
    stepped by the global batch after each optimizer step): the rate each iteration runs
    at is hybrid's, counted in iterations and in samples."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hybrid.config.lr_schedule import scheduled_lr
    from hybrid.config.sections import LRScheduleConfig
    gbs = 8
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    theirs = OptimizerParamScheduler(opt, init_lr=init, max_lr=LR, min_lr=MIN,
                                     lr_warmup_steps=WARM * gbs, lr_decay_steps=DECAY * gbs,
                                     lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                     wd_incr_steps=DECAY * gbs, wd_incr_style="constant")
    ours = [LRScheduleConfig(lr=LR, min_lr=MIN, decay_style=style, unit=unit,
                             warmup=WARM * per, decay=DECAY * per, warmup_init=init)
            for unit, per in (("iterations", 1), ("samples", gbs))]
    for k in range(1, DECAY + 6):
        want = opt.param_groups[0]["lr"]  # what optimizer step k runs at
        for sched in ours:
            assert scheduled_lr(sched, k, (k - 1) * gbs) == pytest.approx(want, rel=1e-12,
                                                                         abs=1e-15), (k, sched)
        theirs.step(increment=gbs)
