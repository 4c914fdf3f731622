"""Record DeepSpeed's scheduler rates for tests/engine/test_deepspeed_schedules.py.

    python -m tests.engine.record_deepspeed_schedules   # rewrites deepspeed_schedules.json

Each case is a ds_config ``scheduler`` block; its rates are those DeepSpeed's own
scheduler class (``deepspeed.runtime.lr_schedules``) writes into an optimizer whose
rate is ``LR`` (the ds_config's ``optimizer.params.lr``), read before each of
``STEPS`` optimizer steps, as a DeepSpeed engine applies them (with Adam's betas,
which OneCycle cycles).
"""

from __future__ import annotations

import json
import logging
import os

import torch

LR, STEPS = 0.01, 16
CASES = {
    f"{kind}-{shape}": {"type": kind, "params": {**params, "warmup_type": shape}}
    for shape in ("log", "linear")
    for kind, params in (
        ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}),
        ("WarmupDecayLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                           "warmup_num_steps": 4, "total_num_steps": 12}),
        ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                            "cos_min_ratio": 0.01, "total_num_steps": 12}),
    )
}
CASES["WarmupLR-one-step"] = {"type": "WarmupLR", "params": {
    "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 1,
    "warmup_type": "linear"}}
CASES["OneCycle"] = {"type": "OneCycle", "params": {
    "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 5}}
CASES["OneCycle-stairs-decay"] = {"type": "OneCycle", "params": {
    "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 6,
    "cycle_second_step_size": 4, "cycle_first_stair_count": 3, "decay_step_size": 3,
    "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}}
CASES["LRRangeTest"] = {"type": "LRRangeTest", "params": {
    "lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}}
CASES["LRRangeTest-staircase"] = {"type": "LRRangeTest", "params": {
    "lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3,
    "lr_range_test_staircase": True}}
PATH = os.path.join(os.path.dirname(__file__), "deepspeed_schedules.json")


def deepspeed_rates(block: dict) -> list[list[float]]:
    """[rate, beta1, beta2] DeepSpeed's scheduler of ``block`` gives each of ``STEPS``
    steps of an AdamW (betas 0.9, 0.999 unless the scheduler writes them)."""
    from deepspeed.runtime import lr_schedules
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=LR)
    sched = getattr(lr_schedules, block["type"])(opt, **block["params"])
    rates = []
    for _ in range(STEPS):
        g = opt.param_groups[0]
        rates.append([float(g["lr"]), *map(float, g["betas"])])
        sched.step()  # what DeepSpeed's engine does after each applied step
    return rates


def main() -> None:
    logging.disable(logging.WARNING)  # its "before it has started" warnings
    import deepspeed
    out = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "lr": LR,
           "cases": {name: {"scheduler": block, "rates": deepspeed_rates(block)}
                     for name, block in CASES.items()}}
    with open(PATH, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {len(CASES)} cases to {PATH} (DeepSpeed {deepspeed.__version__})")


if __name__ == "__main__":
    main()
