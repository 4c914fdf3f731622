"""The ds_config ``scheduler`` blocks give DeepSpeed's rates step for step: WarmupLR,
WarmupDecayLR and WarmupCosineLR through the config path every door shares (ds_config
-> flags -> LRScheduleConfig -> scheduled_lr: the warmup start for steps 1 and 2,
DeepSpeed's formulas after), OneCycle (its beta1 too) and LRRangeTest as the API's
scheduler objects over an optimizer's groups. Against DeepSpeed 0.19.8's numbers
recorded by ``python -m tests.engine.record_deepspeed_schedules``, and against the live
classes when DeepSpeed is installed."""

import json
from pathlib import Path

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.deepspeed import apply_ds_config
from hybrid.config.lr_schedule import scheduled_lr
from hybrid.engine.ds_schedulers import OneCycleSchedule, RangeTestSchedule, kind_of, settings
from tests.engine.record_deepspeed_schedules import CASES, LR, PATH, STEPS, deepspeed_rates

RECORDED = json.loads(Path(PATH).read_text(encoding="utf-8"))


def _rates(block: dict) -> list[list[float]]:
    """[rate, beta1, beta2] of each step under hybrid, for an AdamW at ``LR``."""
    kind = kind_of(block)
    if kind is not None:  # a scheduler object over the groups
        groups = [{"params": [], "lr": LR, "betas": (0.9, 0.999)}]
        sched = (OneCycleSchedule if kind == "onecycle" else RangeTestSchedule)(
            groups, settings(block))
        out = []
        for _ in range(STEPS):
            out.append([groups[0]["lr"], *groups[0]["betas"]])
            sched.step()
        return out
    flags = parse_args([])
    apply_ds_config(flags, {"optimizer": {"type": "AdamW", "params": {"lr": LR}},
                            "scheduler": block}, 1)
    s = build_config(flags, 1).lr_schedule
    return [[scheduled_lr(s, k, k), 0.9, 0.999] for k in range(1, STEPS + 1)]


def _flat(rows):
    return [v for row in rows for v in row]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rates_are_deepspeeds_recorded(name):
    case = RECORDED["cases"][name]
    assert case["scheduler"] == CASES[name]  # the recording is of these cases
    assert _flat(_rates(case["scheduler"])) == pytest.approx(_flat(case["rates"]), rel=1e-12,
                                                             abs=1e-15)


@pytest.mark.peer("deepspeed")
def test_rates_are_the_live_deepspeeds():
    for name, block in CASES.items():
        assert _flat(_rates(block)) == pytest.approx(_flat(deepspeed_rates(block)), rel=1e-12,
                                                     abs=1e-15), name
