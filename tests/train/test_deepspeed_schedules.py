"""A ds_config ``scheduler`` block gives DeepSpeed's rates step for step: the warmup start
for steps 1 and 2 (WarmupCosineLR: 0, then the start), DeepSpeed's formulas after,
through the config path every door shares (ds_config -> flags -> LRScheduleConfig ->
scheduled_lr). Against DeepSpeed 0.19.8's numbers recorded by
``python -m tests.train.record_deepspeed_schedules``, and against the live classes when
DeepSpeed is installed."""

import json

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.deepspeed import apply_ds_config
from hybrid.train.lr_schedule import scheduled_lr
from tests.train.record_deepspeed_schedules import CASES, LR, PATH, STEPS, deepspeed_rates

RECORDED = json.load(open(PATH, encoding="utf-8"))


def _rates(block: dict) -> list[float]:
    flags = parse_args([])
    apply_ds_config(flags, {"optimizer": {"type": "AdamW", "params": {"lr": LR}},
                            "scheduler": block}, 1)
    sched = build_config(flags, 1).lr_schedule
    return [scheduled_lr(sched, k, k) for k in range(1, STEPS + 1)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rates_are_deepspeeds_recorded(name):
    case = RECORDED["cases"][name]
    assert case["scheduler"] == CASES[name]  # the recording is of these cases
    assert _rates(case["scheduler"]) == pytest.approx(case["rates"], rel=1e-12, abs=1e-15)


def test_rates_are_the_live_deepspeeds():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (../shared/"
                                            "BENCHMARKS.md says how, without CUDA)")
    for name, block in CASES.items():
        assert _rates(block) == pytest.approx(deepspeed_rates(block), rel=1e-12, abs=1e-15), name
