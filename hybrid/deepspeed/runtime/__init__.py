"""``deepspeed.runtime``: the two of its modules training scripts import, over hybrid's.

* :mod:`.utils`         ``set_random_seed`` (Python's, numpy's and torch's generators) and
                        ``see_memory_usage`` (a memory line on rank 0)
* :mod:`.lr_schedules`  DeepSpeed's scheduler classes (WarmupLR, WarmupDecayLR,
                        WarmupCosineLR, OneCycle, LRRangeTest) over an optimizer's groups,
                        for ``initialize(lr_scheduler=...)``
* :mod:`.activation_checkpointing`  its ``checkpointing``: :mod:`hybrid.deepspeed.checkpointing`
                        itself (``deepspeed.checkpointing`` under DeepSpeed's other name)

DeepSpeed's other runtime modules (its engines, ZeRO stages, pipeline internals,
config) are refused by name, each with what a hybrid script uses instead: the engine
``initialize`` returns, ``deepspeed.zero``, ``deepspeed.pipe``, the ds_config.
"""

from __future__ import annotations

from typing import NoReturn

from hybrid.deepspeed.missing import advice, refuse
from hybrid.deepspeed.runtime import activation_checkpointing, lr_schedules, utils

__all__ = ["activation_checkpointing", "lr_schedules", "utils"]


def __getattr__(name: str) -> NoReturn:
    refuse("runtime", name, advice(f"runtime.{name}") or
           "hybrid serves deepspeed.runtime.utils, lr_schedules and "
           "activation_checkpointing.checkpointing")
