"""What steps the shard, and what sets its rates, for ``hybrid.initialize``.

DeepSpeed's ``initialize`` takes the optimizer three ways, and so does hybrid's:

==========================  ===============================================================
given                       what steps each rank's shard
==========================  ===============================================================
``optimizer=`` an object    that ``torch.optim`` optimizer, its groups' parameters swapped
or a callable of the params for views of the shard (:mod:`hybrid.zero.client_optimizer`)
``model_parameters`` groups ``torch.optim.AdamW`` over those groups, the ds_config's
(dicts)                     ``"optimizer"`` params as its defaults (each group keeps its own
                            ``weight_decay``, ``lr``, ...)
neither (or a plain list    hybrid's fused AdamW, decaying every parameter it is given, as
or filter of parameters)    DeepSpeed's does (hybrid's GPT keeps Megatron's rule instead)
==========================  ===============================================================

Parameters that require grad must all be given (frozen ones, ``requires_grad``
False, are in no ZeRO unit: no state, no reduction).

The rates: a client ``lr_scheduler`` (an object, or a callable of the optimizer)
drives the groups; else the ds_config's ``"scheduler"`` block
(:class:`ConfigSchedule`, DeepSpeed's rates step for step); else, with a client
optimizer, the groups keep the rates the user gave them (no scheduler, as in
DeepSpeed); else the ``--lr*`` defaults (a constant rate).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hybrid.config import TrainConfig
from hybrid.config.lr_schedule import scheduled_lr
from hybrid.config.sections import AdamWConfig, LRScheduleConfig
from hybrid.engine.ds_schedulers import (
    GroupSchedule,
    OneCycleSchedule,
    RangeTestSchedule,
    kind_of,
    settings,
)
from hybrid.engine.surface import EngineOptimizer
from hybrid.errors import ConfigError
from hybrid.zero.client_optimizer import check_groups

log = logging.getLogger("hybrid")


def _groups(items: list) -> list[dict] | None:
    """``items`` (``model_parameters`` as a list) as groups when it is groups (dicts),
    else None (parameters)."""
    if not items or not isinstance(items[0], Mapping):
        if any(isinstance(i, Mapping) for i in items):
            raise ConfigError("initialize(model_parameters=...): a mix of parameters and "
                              "groups (dicts); pass one or the other")
        return None
    out = []
    for i, g in enumerate(items):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ConfigError(f"initialize(model_parameters=...): group {i} is not a dict "
                              f"with 'params'")
        ps = g["params"]
        out.append({**g, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
    return out


def resolve_optimizer(model: nn.Module, model_parameters: Any,
                      optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer]
                      | None, lr_scheduler: Any,
                      adamw: AdamWConfig, lr: float, where: str, *, torch_adamw: bool = False
                      ) -> torch.optim.Optimizer | None:
    """The client optimizer to step the shards with (module table), or None for hybrid's
    AdamW; every trainable parameter checked to be in it (the same check on every
    rank, before any collective). ``adamw``/``lr``: the ds_config's optimizer
    settings (the defaults of groups built here). A client ``lr_scheduler`` needs a
    torch optimizer to drive: a callable one gets torch's AdamW of those settings
    when no ``optimizer`` is given; a scheduler object must be over ``optimizer``.
    ``torch_adamw``: the schedule writes more than the rate (OneCycle's beta1), so
    torch's AdamW steps the shards, also without a client scheduler."""
    named = list(model.named_parameters())
    if optimizer is None and (lr_scheduler is not None or torch_adamw):
        bound = getattr(lr_scheduler, "optimizer", None)
        if bound is not None and not torch_adamw:
            raise ConfigError(f"{where}(lr_scheduler=...): the scheduler drives an optimizer "
                              f"initialize was not given; pass that optimizer too "
                              f"(optimizer=...)")
        if model_parameters is None:
            model_parameters = [p for p in model.parameters() if p.requires_grad]
        items = list(model_parameters)
        if _groups(items) is None:
            check_plain_parameters(model, items, where)
        model_parameters = _groups(items) or items
        optimizer = torch.optim.AdamW(model_parameters, lr=lr, betas=(adamw.beta1, adamw.beta2),
                                      eps=adamw.eps, weight_decay=adamw.weight_decay)
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            params = model_parameters if model_parameters is not None else model.parameters()
            optimizer = optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"{where}(optimizer=...): takes a torch.optim.Optimizer or a "
                              f"callable returning one, got {type(optimizer).__name__}")
        check_groups(optimizer, named, where)
        bound = getattr(lr_scheduler, "optimizer", None)
        if bound is not None and bound is not optimizer:
            raise ConfigError(f"{where}(lr_scheduler=...): the scheduler drives another "
                              f"optimizer than optimizer=...; build it over that one")
        return optimizer
    if model_parameters is None:
        return None
    items = list(model_parameters)  # (a generator, such as a requires_grad filter, once)
    groups = _groups(items)
    if groups is None:
        check_plain_parameters(model, items, where)
        return None
    client = torch.optim.AdamW(groups, lr=lr, betas=(adamw.beta1, adamw.beta2), eps=adamw.eps,
                               weight_decay=adamw.weight_decay)
    check_groups(client, named, where)
    return client


def check_plain_parameters(model: nn.Module, params: list, where: str) -> None:
    """A plain list of parameters for hybrid's AdamW: every trainable parameter of the
    model, and nothing else."""
    given = {id(p) for p in params}
    named = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        if id(p) not in named:
            raise ConfigError(f"{where}(model_parameters=...): a tensor of shape "
                              f"{tuple(p.shape)} is not a parameter of the model")
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in given:
            raise ConfigError(f"{where}(model_parameters=...): parameter {n} requires grad "
                              f"but is not given: pass it, or freeze it "
                              f"(requires_grad_(False)) before initialize")


class ConfigSchedule(GroupSchedule):
    """The config's schedule (the ds_config's WarmupLR, WarmupDecayLR, WarmupCosineLR,
    or the ``--lr*`` defaults) as a DeepSpeed scheduler over the groups
    (:class:`~hybrid.engine.ds_schedulers.GroupSchedule`).

    ``peaks``: per group, the peak rate (the group's own rate when the schedule is
    relative to it); ``relative``: the warmup start and the end rate scale with the
    peak (WarmupCosineLR's ratios), rather than being shared.
    """

    def __init__(self, sched: LRScheduleConfig, groups: list[dict[str, Any]], batch: int,
                 peaks: list[float] | None = None, relative: bool = False):
        self.sched, self.batch = sched, batch
        peaks = peaks or [sched.lr] * len(groups)
        self._scheds = [_with_peak(sched, p, relative) for p in peaks]
        super().__init__(groups)

    def lr_at(self, step: int) -> list[float]:
        """Every group's rate of 1-based optimizer step ``step``."""
        return [scheduled_lr(s, step, (step - 1) * self.batch) for s in self._scheds]

    def _values(self) -> tuple[list[float], list[tuple[float, float]] | None]:
        return self.lr_at(self.last_batch_iteration + 2), None

    def load_state_dict(self, state: dict) -> None:
        """Also the ``{"steps": n}`` of checkpoints saved before."""
        if "last_batch_iteration" not in state:
            state = {"last_batch_iteration": int(state["steps"]) - 1}
        super().load_state_dict(state)


def _with_peak(sched: LRScheduleConfig, peak: float, relative: bool) -> LRScheduleConfig:
    if peak == sched.lr:
        return sched
    k = peak / sched.lr if sched.lr else 0.0
    if relative:
        return dataclasses.replace(sched, lr=peak, warmup_init=sched.warmup_init * k,
                                   min_lr=sched.min_lr * k)
    return dataclasses.replace(sched, lr=peak)


def resolve_schedule(lr_scheduler: Any, ds: dict, cfg: TrainConfig, optim: EngineOptimizer,
                     where: str) -> Any:
    """What sets the rates of ``optim`` (the engine's :class:`EngineOptimizer`) (module
    note): the ds_config's ``"scheduler"`` block first (as DeepSpeed's engine, which
    prefers its config's scheduler to a client's: a warning says so), then a client
    scheduler (an object over the client optimizer, or a callable of it), then, with
    a client optimizer, None; else the ``--lr*`` defaults."""
    block = ds.get("scheduler")
    client = optim.client
    kind = kind_of(block)
    if kind is not None:
        if lr_scheduler is not None:
            log.warning("%s: the ds_config's \"scheduler\" block sets the rates; the "
                        "lr_scheduler given is not used (as in DeepSpeed)", where)
        cls = OneCycleSchedule if kind == "onecycle" else RangeTestSchedule
        return cls(optim.param_groups, settings(dict(block or {})))
    if block is not None:
        if lr_scheduler is not None:
            log.warning("%s: the ds_config's \"scheduler\" block sets the rates; the "
                        "lr_scheduler given is not used (as in DeepSpeed)", where)
        params = block.get("params", {}) if isinstance(block, dict) else {}
        shared = params.get("warmup_max_lr") not in (None, "auto")
        cosine = cfg.lr_schedule.decay_style == "cosine"
        peaks = None if shared or client is None else [float(g["lr"]) for g in optim.param_groups]
        return ConfigSchedule(cfg.lr_schedule, optim.param_groups, cfg.loop.global_batch_size,
                              peaks, relative=cosine)
    if lr_scheduler is not None:
        if not hasattr(lr_scheduler, "step"):  # a callable of the optimizer
            assert client is not None  # (resolve_optimizer made one for it)
            lr_scheduler = lr_scheduler(client)
        return lr_scheduler
    if client is not None:
        return None
    return ConfigSchedule(cfg.lr_schedule, optim.param_groups, cfg.loop.global_batch_size)
