"""``deepspeed.utils``: the helpers DeepSpeed's training scripts take from it.

* ``RepeatingLoader(loader)`` starts ``loader`` again at its end, for
  ``engine.train_batch(data_iter=RepeatingLoader(...))`` (DeepSpeedExamples' pipeline
  scripts).
* ``logger``: the logger ``hybrid.deepspeed``, INFO and above to stdout in DeepSpeed's
  format (:func:`hybrid.engine.progress.deepspeed_logger`); ``log_dist(message, ranks,
  level)`` logs ``[Rank R] message`` on the ranks listed (``[-1]``: every rank; all of
  them when torch.distributed is not initialized, as ``[Rank -1]``), as DeepSpeed's.
* ``safe_get_full_fp32_param(param)``, ``safe_get_full_optimizer_state(param, key)``,
  ``safe_get_full_grad(param)``: the whole fp32 master, optimizer state (``exp_avg``,
  ``exp_avg_sq`` of hybrid's AdamW; a client optimizer's per-element state) or reduced
  gradient of a ZeRO-partitioned parameter, on every rank of its group (collective:
  :mod:`hybrid.engine.full_values`). The gradient is there between the accumulation
  boundary's backward and its ``engine.step()``, unscaled (after a plain
  ``loss.backward()`` it is the window's sum, which ``step()`` divides by the
  micro-batch count); None for a frozen parameter.

* ``set_z3_leaf_modules(model, classes)`` (and ``unset_``, ``get_``, ``z3_leaf_module``):
  modules ZeRO stage 3 gathers as one unit (:mod:`.z3_leaf_module`).

:mod:`.zero_to_fp32` reads a saved checkpoint into a full fp32 state dict. DeepSpeed's
other helpers here (the ``safe_set_*`` writers, the groups, its timers) are refused by
name, with what to use instead.

* :mod:`.zero_to_fp32`  ``get_fp32_state_dict_from_zero_checkpoint``: a checkpoint
                        directory -> every parameter's full fp32 tensor
* :mod:`.z3_leaf_module` the leaf modules stage 3 gathers whole
"""

from __future__ import annotations

import logging
from typing import NoReturn

import torch
import torch.distributed as dist

from hybrid.deepspeed.missing import refuse
from hybrid.deepspeed.pipe_engine import RepeatingLoader
from hybrid.deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from hybrid.engine.full_values import engine_of, full_value
from hybrid.engine.progress import deepspeed_logger
from hybrid.errors import ConfigError

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "log_dist", "logger",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "set_z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module"]

logger = deepspeed_logger()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``[Rank R] message`` at ``level`` on the ranks in ``ranks`` (``[-1]``: all), or
    on every process (as rank -1) when torch.distributed is not initialized."""
    on = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if on else -1
    if not on or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, "[Rank %d] %s", rank, message)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (module doc; collective)."""
    return full_value(engine_of(param, "safe_get_full_fp32_param"), param, "master")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str
                                  ) -> torch.Tensor | None:
    """The whole of ``param``'s per-element optimizer state ``optim_state_key`` (module
    doc; collective)."""
    where = "safe_get_full_optimizer_state"
    if optim_state_key in ("master", "grad"):
        raise ConfigError(f"{where}(param, {optim_state_key!r}): use "
                          f"safe_get_full_fp32_param / safe_get_full_grad")
    return full_value(engine_of(param, where), param, optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole reduced fp32 gradient of ``param`` (module doc; collective)."""
    return full_value(engine_of(param, "safe_get_full_grad"), param, "grad")


_NOT_HERE = {
    "safe_set_full_fp32_param": "write the parameter inside "
                                "deepspeed.zero.GatheredParameters(param, modifier_rank=0): "
                                "that rank's values become the fp32 master",
    "safe_set_full_optimizer_state": "hybrid writes optimizer state from checkpoints only "
                                     "(engine.load_checkpoint)",
    "safe_set_full_grad": "hybrid's gradients are its reduction's; scale the loss instead",
    "safe_get_local_fp32_param": "use safe_get_full_fp32_param (the whole of it)",
    "safe_get_local_grad": "use safe_get_full_grad (the whole of it)",
    "safe_get_local_optimizer_state": "use safe_get_full_optimizer_state (the whole of it)",
    "groups": "the process groups are engine.ps (a hybrid ParallelState)",
    "SynchronizedWallClockTimer": "hybrid times its own steps",
    "ThroughputTimer": "hybrid times its own steps",
    "get_caller_func": "not one of the names scripts use",
    "OnDevice": "build the model under deepspeed.zero.Init, or on the meta device "
                "(torch.device('meta')), which initialize draws shard by shard",
}


def __getattr__(name: str) -> NoReturn:
    refuse("utils", name, _NOT_HERE.get(
        name, "it holds RepeatingLoader, logger, log_dist, the safe_get_full_* readers, "
              "the z3 leaf-module markers and zero_to_fp32"))
