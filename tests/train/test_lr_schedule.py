"""The learning-rate schedule matches its formulas."""

import math

import pytest

from hybrid.config.lr_schedule import learning_rate

LR, MIN, WARM, DECAY = 1e-3, 1e-4, 10, 110


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero(style):
    for it in (1, 5, 10):
        assert learning_rate(it, LR, MIN, WARM, DECAY, style) == pytest.approx(LR * it / WARM)


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
