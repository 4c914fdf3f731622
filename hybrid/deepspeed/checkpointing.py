"""``deepspeed.checkpointing``: activation checkpointing called from a model's forward.

    class Net(nn.Module):
        def forward(self, x):
            for block in self.blocks:
                x = deepspeed.checkpointing.checkpoint(block, x)   # recomputed in backward
            return self.head(x)

:func:`checkpoint` keeps only the call's inputs and runs ``function`` again in
backward (torch's non-reentrant checkpoint, which replays the CPU and device
RNG, so dropout draws the same masks). Under ZeRO-3 the recompute runs inside
the :class:`~hybrid.recompute.phase.RecomputePhase` that ``deepspeed.initialize``
gives the engine (:data:`PHASE`), so a recomputed module's parameters stay
gathered for its backward: the recompute's gather is the backward gather of
stage 3's budget, as with hybrid's own recompute (:mod:`hybrid.recompute`).

What DeepSpeed's :func:`configure` adds to that -- partitioning the kept
inputs over the model-parallel group, keeping them on the CPU, one contiguous
buffer -- is hybrid's ZeRO-R, which wraps whole transformer blocks of hybrid's
GPT (``scripts/pretrain_gpt.py --partition-activations --cpu-checkpointing
--contiguous-checkpointing``); asked for here it is one ConfigError saying so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import NoReturn, TypeVar

import torch.utils.checkpoint

from hybrid.config.deepspeed import load_ds_config
from hybrid.errors import ConfigError
from hybrid.recompute.phase import RecomputePhase

# Set around every recompute of :func:`checkpoint`; deepspeed.initialize hands it to the
# engine (a flag, not a process group: engines of one process may share it).
PHASE = RecomputePhase()

_T = TypeVar("_T")

_CONFIGURED: list[bool] = []  # [True] after configure()

_ZERO_R = {"partition_activations": "--partition-activations",
           "contiguous_memory_optimization": "--contiguous-checkpointing",
           "cpu_checkpointing": "--cpu-checkpointing"}


def configure(mpu_: object = None, deepspeed_config: str | os.PathLike | Mapping | None = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Accepts the plain recompute (every option off, from the arguments or the
    ds_config's ``activation_checkpointing`` block); ``num_checkpoints``,
    ``synchronize`` and ``profile`` change nothing here. Partitioned, CPU or
    contiguous checkpoints are refused (module note)."""
    asked = {"partition_activations": partition_activations,
             "contiguous_memory_optimization": contiguous_checkpointing,
             "cpu_checkpointing": checkpoint_in_cpu}
    if deepspeed_config is not None:
        block = load_ds_config(deepspeed_config).get("activation_checkpointing") or {}
        if isinstance(block, Mapping):
            for key, value in asked.items():
                if value is None:
                    asked[key] = block.get(key)
    on = [key for key, value in asked.items() if value]
    if on:
        raise ConfigError(
            f"deepspeed.checkpointing.configure: {on[0]} is hybrid's ZeRO-R, which wraps "
            f"the transformer blocks of hybrid's GPT (scripts/pretrain_gpt.py "
            f"{_ZERO_R[on[0]]}); deepspeed.checkpointing.checkpoint recomputes without it: "
            f"set {on[0]} false")
    _CONFIGURED[:] = [True]


def is_configured() -> bool:
    return bool(_CONFIGURED)


def reset() -> None:
    """(DeepSpeed frees its partitioned buffers here; the plain recompute keeps none.)"""


def checkpoint(function: Callable[..., _T], *args: object) -> _T:
    """``function(*args)``, keeping only ``args`` for backward, where it runs again
    (module note). Returns what ``function`` returns."""
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), PHASE.recomputing()))


def __getattr__(name: str) -> NoReturn:
    raise AttributeError(f"hybrid.deepspeed.checkpointing has no {name!r} (DeepSpeed's "
                         f"deepspeed.checkpointing.{name}): it holds configure, checkpoint, "
                         f"is_configured and reset; the RNG trackers of Megatron's tensor "
                         f"parallelism are hybrid.tensor_parallel's")
