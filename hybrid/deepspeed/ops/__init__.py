"""``deepspeed.ops``: the optimizers DeepSpeed scripts build themselves, as torch's.

* :mod:`.adam`  ``FusedAdam`` and ``DeepSpeedCPUAdam``: torch's Adam(W) with DeepSpeed's
                arguments, stepping each rank's shard as any client optimizer does

DeepSpeed's other ops (its LAMB, Lion, transformer and attention kernels, the op
builders) are refused by name, with what to use instead.
"""

from __future__ import annotations

from typing import NoReturn

from hybrid.deepspeed.missing import advice, refuse
from hybrid.deepspeed.ops import adam

__all__ = ["adam"]


def __getattr__(name: str) -> NoReturn:
    refuse("ops", name, advice(f"ops.{name}") or "hybrid serves deepspeed.ops.adam only")
