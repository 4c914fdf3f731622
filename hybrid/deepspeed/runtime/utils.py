"""``deepspeed.runtime.utils``: ``set_random_seed`` and ``see_memory_usage``.

``set_random_seed(seed)`` seeds Python's ``random``, numpy's global generator (with
``seed`` mod 2**32, the most it takes) and torch's (mod 2**63), as DeepSpeed's does, so
the draws after it are DeepSpeed's. ``see_memory_usage(message, force=False)`` does
nothing unless ``force``; then, on rank 0 (or in a process without torch.distributed),
it prints ``message``, the device's memory (allocated, its peak, reserved, its peak, in
GB: :func:`hybrid.deepspeed.accelerator.get_accelerator`'s, the process's resident set
on a CPU) and the host's, in DeepSpeed's words, and resets the peaks, as DeepSpeed's does.
"""

from __future__ import annotations

import gc
import random
from typing import NoReturn

import numpy
import torch
import torch.distributed as dist

from hybrid.deepspeed.accelerator import get_accelerator
from hybrid.deepspeed.missing import refuse

__all__ = ["see_memory_usage", "set_random_seed"]

_GB = 1024 ** 3


def set_random_seed(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` and torch (module doc)."""
    random.seed(seed)
    numpy.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed % 2 ** 63)


def _host_used() -> tuple[float, float] | None:
    """(GB in use, percent) of the host's memory, from /proc/meminfo (None elsewhere)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.strip()}
        total, available = kb["MemTotal"] * 1024, kb["MemAvailable"] * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return (total - available) / _GB, round(100 * (total - available) / total, 1)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` and the memory in use on rank 0 when ``force`` (module doc)."""
    if not force or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # (what Python has not collected yet would count as used)
    acc = get_accelerator()
    print(message)
    gap = " " * 8  # (DeepSpeed's line carries its source's indentation between the fields)
    print(f"MA {round(acc.memory_allocated() / _GB, 2)} GB {gap}"
          f"Max_MA {round(acc.max_memory_allocated() / _GB, 2)} GB {gap}"
          f"CA {round(acc.memory_reserved() / _GB, 2)} GB {gap}"
          f"Max_CA {round(acc.max_memory_reserved() / _GB)} GB ")
    host = _host_used()
    if host is not None:
        print(f"CPU Virtual Memory:  used = {round(host[0], 2)} GB, percent = {host[1]}%")
    acc.reset_peak_memory_stats()


def __getattr__(name: str) -> NoReturn:
    refuse("runtime.utils", name, "hybrid serves set_random_seed and see_memory_usage from it; "
                                  "clip gradients with the ds_config's gradient_clipping")
