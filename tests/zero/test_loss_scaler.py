"""The dynamic fp16 loss scale: hysteresis, backoff on every overflow once it is used up,
growth after a clean window (Megatron's and DeepSpeed's schedule)."""

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
