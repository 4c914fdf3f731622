"""The dynamic fp16 loss scale: hysteresis, backoff on every overflow once it is used up,
growth after a clean window (Megatron's schedule; DeepSpeed's waits one step more after an
overflow), and the state a checkpoint (or DeepSpeed's, imported) carries."""

from hybrid.zero.loss_scaler import LossScaler


def _scales(scaler, overflows):
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_hysteresis_then_halving_on_every_overflow():
    s = LossScaler(65536.0, dynamic=True, window=1000, hysteresis=2)
    # the first overflow is tolerated; every one after it halves the scale
    assert _scales(s, [True] * 4) == [65536.0, 32768.0, 16384.0, 8192.0]


def test_a_clean_window_doubles_and_restores_the_hysteresis():
    s = LossScaler(1024.0, dynamic=True, window=3, hysteresis=2)
    assert _scales(s, [True, True]) == [1024.0, 512.0]
    assert _scales(s, [False, False, False]) == [512.0, 512.0, 1024.0]
    assert _scales(s, [True, True]) == [1024.0, 512.0]  # one tolerated again


def test_min_scale_and_state_round_trip():
    s = LossScaler(4.0, dynamic=True, window=10, min_scale=1.0, hysteresis=1)
    assert _scales(s, [True] * 4) == [2.0, 1.0, 1.0, 1.0]
    t = LossScaler(99.0, dynamic=True, window=10, hysteresis=1)
    t.load_state_dict(s.state_dict())
    assert _scales(t, [False] * 10) == _scales(s, [False] * 10)


def test_an_imported_count_of_minus_one_doubles_a_step_later():
    """DeepSpeed's step right after an overflow (its ``cur_iter - last_overflow_iter - 1``
    is 0) comes over as a clean-step count of -1: the window then counts from the next
    step, where DeepSpeed's does."""
    s = LossScaler(1.0, dynamic=True, window=2, hysteresis=2)
    s.load_state_dict({"scale": 8.0, "clean_steps": -1, "hysteresis_left": 1})
    assert _scales(s, [False] * 5) == [8.0, 8.0, 16.0, 16.0, 32.0]
    assert _scales(s, [True]) == [32.0]  # (the hysteresis restored by the growth)


def test_a_static_or_unscaled_run_keeps_its_own_scale_on_load():
    """A saved dynamic scale loaded into a run that does not scale dynamically (bf16,
    fp32, ``--loss-scale``) leaves the run's configured scale."""
    saved = {"scale": 65536.0, "clean_steps": 3, "hysteresis_left": 1}
    for scaler, want in ((LossScaler(1.0), 1.0), (LossScaler(128.0), 128.0)):
        scaler.load_state_dict(saved)
        assert scaler.scale == want and _scales(scaler, [True, False]) == [want, want]
