"""The process layout as plain arithmetic: no torch, no process groups.

Megatron's layout, with tensor-parallel ranks adjacent so a TP group stays
inside one node::

    global rank = dp_rank * tp_size + tp_rank

    world 8, TP 2:  TP groups [0,1] [2,3] [4,5] [6,7]
                    DP groups [0,2,4,6] [1,3,5,7]

:mod:`hybrid.config` checks a command line against it before any worker
starts; :mod:`hybrid.parallel.state` builds the process groups from it.
"""

from __future__ import annotations

from hybrid.errors import ConfigError


def check_layout(world_size: int, tensor_model_parallel_size: int) -> int:
    """The data-parallel size, or a ConfigError naming the flag to change."""
    tp = tensor_model_parallel_size
    if world_size < 1:
        raise ConfigError(f"the world size (nodes x processes per node) must be >= 1, got "
                          f"{world_size}: check NNODES and NPROC_PER_NODE")
    if tp < 1:
        raise ConfigError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if world_size % tp != 0:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} does not divide the world size {world_size} "
            f"(nodes x processes per node): use one of {divisors}")
    return world_size // tp


def tp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """Global ranks of every TP group: consecutive blocks of tp_size."""
    return [list(range(s, s + tp_size)) for s in range(0, world_size, tp_size)]


def dp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """Global ranks of every DP group: ranks with the same tp_rank, strided by tp_size."""
    return [list(range(t, world_size, tp_size)) for t in range(tp_size)]

