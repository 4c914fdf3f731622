"""``deepspeed.runtime.lr_schedules``: DeepSpeed's scheduler classes over an optimizer's groups.

    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)     # or deepspeed.ops.adam.FusedAdam
    sched = WarmupDecayLR(opt, total_num_steps=1000, warmup_num_steps=100)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=sched, config=ds)

Each class takes DeepSpeed's arguments and writes DeepSpeed's rates into
``optimizer.param_groups``: built, the rate of optimizer step 1; each ``step()`` (the
engine calls it after every applied optimizer step) the next ([Note: DeepSpeed's step
counting] in :mod:`hybrid.config.lr_schedule`). The numbers are those of the ds_config's
``scheduler`` block, from the same functions: WarmupLR, WarmupDecayLR and WarmupCosineLR
through :func:`hybrid.config.lr_schedule.deepspeed_lr` (per group: a list of rates, one a
group, as DeepSpeed takes them), OneCycle and LRRangeTest through
:mod:`hybrid.engine.ds_schedulers` (OneCycle also cycles beta1 when the groups have
betas); they equal DeepSpeed 0.19.8's within 1e-12 (tests/hybrid_deepspeed/test_runtime.py).

Refused, by name: ``last_batch_iteration`` other than -1 (resume with
``engine.load_checkpoint``, which restores the scheduler's place), per-group lists for
OneCycle and LRRangeTest, and the argparse helpers (``add_tuning_arguments``, ...):
the ds_config's ``scheduler`` block takes the same settings.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn

from hybrid.config.lr_schedule import deepspeed_lr
from hybrid.deepspeed.missing import refuse
from hybrid.engine.ds_schedulers import (
    GroupSchedule,
    OneCycleSchedule,
    RangeTestSchedule,
    settings,
)
from hybrid.errors import ConfigError

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

log = logging.getLogger("hybrid.deepspeed")

WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"


def _groups(optimizer: Any, cls: str) -> list[dict[str, Any]]:
    """The groups of ``optimizer`` (or of the torch optimizer it wraps, ``.optimizer``)."""
    for o in (optimizer, getattr(optimizer, "optimizer", None)):
        groups = getattr(o, "param_groups", None)
        if isinstance(groups, list):
            return groups
    raise ConfigError(f"{cls}(optimizer, ...): takes an optimizer with param_groups, got "
                      f"{type(optimizer).__name__}")


def _per_group(value: float | Sequence[float], n: int, name: str, cls: str) -> list[float]:
    """A number for every group, or one per group (DeepSpeed's lists)."""
    if isinstance(value, (int, float)):
        return [float(value)] * n
    if len(value) != n:
        raise ConfigError(f"{cls}({name}=...): {len(value)} values for {n} parameter "
                          f"groups; give one per group, or one number")
    return [float(v) for v in value]


def _start(last_batch_iteration: int, cls: str) -> None:
    if last_batch_iteration != -1:
        raise ConfigError(f"{cls}(last_batch_iteration={last_batch_iteration}): build it "
                          f"fresh and resume with engine.load_checkpoint, which restores "
                          f"the scheduler's place")


def _warmup(warmup_num_steps: object, warmup_type: str, cls: str) -> str:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ConfigError(f"{cls}(warmup_num_steps=...) must be a positive whole number, "
                          f"got {warmup_num_steps!r}")
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        log.warning("%s: unknown warmup_type %r; using 'log', as DeepSpeed does", cls,
                    warmup_type)
        return WARMUP_LOG_RATE
    return warmup_type


class _Warmup(GroupSchedule):
    """The three warmup schedules: per group ``deepspeed_lr`` with its own start, peak
    and end rates."""

    def __init__(self, optimizer: Any, starts: list[float], peaks: list[float],
                 ends: list[float], warmup: int, total: int, style: str, warmup_type: str):
        self.optimizer = optimizer
        self._rates = list(zip(starts, peaks, ends))
        self._shape = (warmup, total, style, warmup_type)
        super().__init__(_groups(optimizer, type(self).__name__))

    def _values(self) -> tuple[list[float], list[tuple[float, float]] | None]:
        warmup, total, style, shape = self._shape
        step = self.last_batch_iteration + 2  # ([Note: DeepSpeed's step counting])
        return [deepspeed_lr(step, peak, end, warmup, total, style, start, shape)
                for start, peak, end in self._rates], None


class WarmupLR(_Warmup):
    """``warmup_min_lr`` -> ``warmup_max_lr`` (default: each group's rate) over
    ``warmup_num_steps``, log or linear, then constant (module doc)."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        cls = type(self).__name__
        _start(last_batch_iteration, cls)
        shape = _warmup(warmup_num_steps, warmup_type, cls)
        groups = _groups(optimizer, cls)
        lows = _per_group(warmup_min_lr, len(groups), "warmup_min_lr", cls)
        highs = _per_group([g["lr"] for g in groups] if warmup_max_lr is None
                           else warmup_max_lr, len(groups), "warmup_max_lr", cls)
        total, style = self._decay(warmup_num_steps)
        super().__init__(optimizer, lows, highs, lows, warmup_num_steps, total, style, shape)

    def _decay(self, warmup_num_steps: int) -> tuple[int, str]:
        return warmup_num_steps, "constant"


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then linear down to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)

    def _decay(self, warmup_num_steps: int) -> tuple[int, str]:
        return self.total_num_steps, "linear"


class WarmupCosineLR(_Warmup):
    """``warmup_min_ratio`` x each group's rate -> the rate over ``warmup_num_steps``, then
    a cosine down to ``cos_min_ratio`` x the rate at ``total_num_steps`` (held there)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        cls = type(self).__name__
        _start(last_batch_iteration, cls)
        shape = _warmup(warmup_num_steps, warmup_type, cls)
        rates = [float(g["lr"]) for g in _groups(optimizer, cls)]
        super().__init__(optimizer, [r * warmup_min_ratio for r in rates], rates,
                         [r * cos_min_ratio for r in rates], warmup_num_steps,
                         total_num_steps, "cosine", shape)


def _scalars(cls: str, **given: object) -> None:
    for name, value in given.items():
        if isinstance(value, (list, tuple)):
            raise ConfigError(f"{cls}({name}=[...]): hybrid's {cls} takes one number for "
                              f"every group; give one, or pass a torch scheduler")


class OneCycle(OneCycleSchedule):
    """DeepSpeed's OneCycle (:class:`hybrid.engine.ds_schedulers.OneCycleSchedule`) over
    ``optimizer``'s groups, DeepSpeed's arguments and defaults."""

    def __init__(self, optimizer: Any, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        _start(last_batch_iteration, "OneCycle")
        params = {k: v for k, v in locals().items()
                  if k not in ("self", "optimizer", "last_batch_iteration", "__class__")
                  and v is not None}
        _scalars("OneCycle", **params)
        self.optimizer = optimizer
        super().__init__(_groups(optimizer, "OneCycle"),
                         settings({"type": "OneCycle", "params": params}))


class LRRangeTest(RangeTestSchedule):
    """DeepSpeed's LRRangeTest (:class:`hybrid.engine.ds_schedulers.RangeTestSchedule`) over
    ``optimizer``'s groups, DeepSpeed's arguments and defaults."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        _start(last_batch_iteration, "LRRangeTest")
        _scalars("LRRangeTest", lr_range_test_min_lr=lr_range_test_min_lr)
        self.optimizer = optimizer
        super().__init__(_groups(optimizer, "LRRangeTest"), settings({
            "type": "LRRangeTest", "params": {
                "lr_range_test_min_lr": lr_range_test_min_lr,
                "lr_range_test_step_size": lr_range_test_step_size,
                "lr_range_test_step_rate": lr_range_test_step_rate,
                "lr_range_test_staircase": lr_range_test_staircase}}))


_NOT_HERE = {
    "add_tuning_arguments": "hybrid has no autotuner; set the scheduler in the ds_config's "
                            "\"scheduler\" block or build one of these classes",
    "parse_arguments": "set the scheduler in the ds_config's \"scheduler\" block",
    "get_config_from_args": "set the scheduler in the ds_config's \"scheduler\" block",
    "get_lr_from_config": "read the rates from engine.get_lr()",
    "override_params": "set the scheduler in the ds_config's \"scheduler\" block",
}


def __getattr__(name: str) -> NoReturn:
    refuse("runtime.lr_schedules", name, _NOT_HERE.get(
        name, "it holds WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest"))
