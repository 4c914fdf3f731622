"""DeepSpeed's OneCycle and LRRangeTest schedulers for ``hybrid.initialize``.

Unlike WarmupLR and its kin (points of hybrid's warmup + decay schedule,
:mod:`hybrid.config.deepspeed_schedule`), these two have shapes of their own,
and OneCycle also cycles Adam's beta1. They are scheduler objects over the
optimizer's ``param_groups``, counting as DeepSpeed's do ([Note: DeepSpeed's
step counting] in :mod:`hybrid.config.lr_schedule`): built, they write the rate of
optimizer step 1; each ``step()`` after an applied optimizer step moves ``i`` (the
count minus one) on and writes the next.

OneCycle (``i`` from -1; ``T = first + second`` step sizes): within the cycle the
rate climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over ``first`` steps and comes
back over ``second``, in stairs when a stair count is set; beta1 runs the other
way, ``cycle_max_mom`` down to ``cycle_min_mom`` and back, beta2 held at 0.99. After
the cycle, with ``decay_step_size``, the rate is ``cycle_min_lr / (1 + decay_lr_rate
* k / decay_step_size)`` and beta1 ``cycle_max_mom * (1 + decay_mom_rate * k /
decay_step_size)`` at the ``k``-th step past it; without, they stay at the
minimum rate and the maximum momentum.

LRRangeTest: ``lr_range_test_min_lr * (1 + lr_range_test_step_rate * x)`` with
``x = (i + 1) / lr_range_test_step_size``, floored with ``lr_range_test_staircase``.

A cycled beta1 must reach the update, so a OneCycle with ``cycle_momentum`` runs
torch's AdamW on the shards (hybrid's fused AdamW takes its betas from the config):
:func:`hybrid.engine.optimizer.resolve_optimizer` decides it.
"""

from __future__ import annotations

import abc
import math
from typing import Any

from hybrid.config.kinds import BOOL, INT, NUMBER, typed
from hybrid.errors import ConfigError

KINDS = ("onecycle", "lrrangetest")
_PARAMS: dict[str, dict[str, tuple[Any, Any]]] = {  # name: (kind, default; None: required)
    "onecycle": {
        "cycle_min_lr": (NUMBER, None), "cycle_max_lr": (NUMBER, None),
        "decay_lr_rate": (NUMBER, 0.0), "cycle_first_step_size": (INT, 2000),
        "cycle_second_step_size": (INT, None), "cycle_first_stair_count": (INT, 0),
        "cycle_second_stair_count": (INT, None), "decay_step_size": (INT, 0),
        "cycle_momentum": (BOOL, True), "cycle_min_mom": (NUMBER, 0.8),
        "cycle_max_mom": (NUMBER, 0.9), "decay_mom_rate": (NUMBER, 0.0),
    },
    "lrrangetest": {
        "lr_range_test_min_lr": (NUMBER, 1e-3), "lr_range_test_step_size": (INT, 2000),
        "lr_range_test_step_rate": (NUMBER, 1.0), "lr_range_test_staircase": (BOOL, False),
    },
}
_OPTIONAL = {"cycle_second_step_size", "cycle_second_stair_count"}


def kind_of(block: object) -> str | None:
    """``"onecycle"`` or ``"lrrangetest"`` for a ds_config scheduler block of those types."""
    if not isinstance(block, dict):
        return None
    kind = str(block.get("type", "")).lower()
    return kind if kind in KINDS else None


def cycles_momentum(block: Any) -> bool:
    """Whether ``block`` is a OneCycle that writes beta1 (its default)."""
    return kind_of(block) == "onecycle" and block.get("params", {}).get("cycle_momentum",
                                                                        True) is not False


def settings(block: dict) -> dict[str, Any]:
    """The block's params, each checked against its type, with DeepSpeed's defaults."""
    kind = kind_of(block)
    assert kind is not None
    where = f"ds_config scheduler ({block['type']})"
    for name in block:
        if name not in ("type", "params"):
            raise ConfigError(f"{where}: {name!r} is not a scheduler key")
    given = dict(block.get("params", {}))
    if given.pop("last_batch_iteration", -1) != -1:
        raise ConfigError(f"{where}: params.last_batch_iteration: resume from a checkpoint "
                          f"instead")
    out = {}
    for name, value in given.items():
        if name not in _PARAMS[kind]:
            raise ConfigError(f"{where}: params.{name} is not a parameter of {block['type']}")
        out[name] = typed(value, _PARAMS[kind][name][0], f"scheduler.params.{name}")
    for name, (_, default) in _PARAMS[kind].items():
        if name not in out:
            if default is None and name not in _OPTIONAL:
                raise ConfigError(f"{where}: params.{name} is required")
            out[name] = default
    return out


class GroupSchedule(abc.ABC):
    """A DeepSpeed scheduler over an optimizer's ``groups``: built, it writes the values
    of optimizer step 1; ``step()`` after each applied step moves DeepSpeed's count
    ``i`` (steps taken minus one) on and writes the next. ``get_lr()`` and
    ``get_last_lr()`` are the rates in the groups now: the next step's, as DeepSpeed's.
    A subclass gives :meth:`_values` at ``i``."""

    def __init__(self, groups: list[dict[str, Any]]):
        self.groups = groups
        self.last_batch_iteration = -1
        self._write()

    @abc.abstractmethod
    def _values(self) -> tuple[list[float], list[tuple[float, float]] | None]:
        """Per group, the rate and (None: unchanged) the betas at ``i``."""

    def _write(self) -> None:
        lrs, betas = self._values()
        for g, lr in zip(self.groups, lrs):
            g["lr"] = lr
        for g, b in zip(self.groups, betas or []):
            g["betas"] = b

    def step(self, last_batch_iteration: int | None = None) -> None:
        """After an optimizer step: the groups get the next step's values."""
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._write()

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._write()


class OneCycleSchedule(GroupSchedule):
    """DeepSpeed's OneCycle over ``groups`` (module note); ``p``: :func:`settings`."""

    def __init__(self, groups: list[dict[str, Any]], p: dict[str, Any]):
        self.p = p
        self.first = float(p["cycle_first_step_size"])
        second = p["cycle_second_step_size"]
        self.second = self.first if second is None else float(second)
        if self.first <= 0 or self.second < 0:
            raise ConfigError("ds_config scheduler (OneCycle): cycle_first_step_size must be "
                              "positive and cycle_second_step_size not negative")
        self.total = self.first + self.second
        self.ratio = self.first / self.total
        self.stairs = (p["cycle_first_stair_count"],
                       p["cycle_first_stair_count"] if p["cycle_second_stair_count"] is None
                       else p["cycle_second_stair_count"])
        no_decay = math.isclose(p["decay_step_size"], 0)
        self.decay_lr = not (no_decay or math.isclose(p["decay_lr_rate"], 0))
        self.decay_mom = not (no_decay or math.isclose(p["decay_mom_rate"], 0))
        self.momentum = bool(p["cycle_momentum"]) and all("betas" in g for g in groups)
        super().__init__(groups)

    def _scale(self) -> float:
        """Where in the cycle the next step is: 0 at the bottom, 1 at the top."""
        b = self.last_batch_iteration + 1
        x = 1.0 + b / self.total - math.floor(1 + b / self.total)
        if x <= self.ratio:
            scale, stairs = x / self.ratio, self.stairs[0]
        else:
            scale, stairs = (x - 1) / (self.ratio - 1), self.stairs[1]
        if stairs > 0:
            at = b % self.total
            pos = (at * stairs / self.first if at <= self.first
                   else (self.total - at) * stairs / self.second)
            scale = math.floor(pos) / stairs
        return scale

    def _values(self) -> tuple[list[float], list[tuple[float, float]] | None]:
        p, n = self.p, len(self.groups)
        i = self.last_batch_iteration
        lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
        mlo, mhi = p["cycle_min_mom"], p["cycle_max_mom"]
        if i < 0:  # built: the bottom of the cycle, beta1 at its minimum
            return [lo] * n, [(mlo, 0.99)] * n if self.momentum else None
        if i < self.total:
            s = self._scale()
            lr, mom = lo + (hi - lo) * s, mhi - (mhi - mlo) * s
        else:
            k = i - self.total + 1
            lr = lo / (1 + p["decay_lr_rate"] * k / p["decay_step_size"]) if self.decay_lr else lo
            mom = (mhi * (1 + p["decay_mom_rate"] * k / p["decay_step_size"]) if self.decay_mom
                   else mhi)
        return [lr] * n, [(mom, 0.99)] * n if self.momentum else None


class RangeTestSchedule(GroupSchedule):
    """DeepSpeed's LRRangeTest over ``groups`` (module note); ``p``: :func:`settings`."""

    def __init__(self, groups: list[dict[str, Any]], p: dict[str, Any]):
        self.p = p
        if p["lr_range_test_step_size"] <= 0:
            raise ConfigError("ds_config scheduler (LRRangeTest): lr_range_test_step_size "
                              "must be positive")
        super().__init__(groups)

    def _values(self) -> tuple[list[float], list[tuple[float, float]] | None]:
        p = self.p
        x = (self.last_batch_iteration + 1) / p["lr_range_test_step_size"]
        if p["lr_range_test_staircase"]:
            x = math.floor(x)
        lr = p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * x)
        return [lr] * len(self.groups), None
