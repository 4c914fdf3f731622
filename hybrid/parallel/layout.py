"""The process layout as plain arithmetic: no torch, no process groups.

Megatron's order, tensor-parallel ranks adjacent (a TP group stays inside one
node), then context-parallel, then data-parallel::

    global rank = (dp_rank * cp_size + cp_rank) * tp_size + tp_rank

    world 8, TP 2, CP 2:  TP groups     [0,1] [2,3] [4,5] [6,7]
                          CP groups     [0,2] [1,3] [4,6] [5,7]
                          DP groups     [0,4] [1,5] [2,6] [3,7]
                          DP x CP       [0,2,4,6] [1,3,5,7]   (same tp_rank)

A CP group holds the ranks that split one sequence; a DP group the ranks that
see different samples at the same TP and CP position; DP x CP every rank with
the same TP slice of the parameters (ZeRO shards and reduces over it: see
:class:`hybrid.parallel.state.ParallelState`). With CP 1 the DP x CP groups
are the DP groups.

:mod:`hybrid.config` checks a command line against it before any worker
starts; :mod:`hybrid.parallel.state` builds the process groups from it.
"""

from __future__ import annotations

from hybrid.errors import ConfigError


def check_layout(world_size: int, tensor_model_parallel_size: int,
                 context_parallel_size: int = 1) -> int:
    """The data-parallel size, or a ConfigError naming the flag to change."""
    tp, cp = tensor_model_parallel_size, context_parallel_size
    if world_size < 1:
        raise ConfigError(f"the world size (nodes x processes per node) must be >= 1, got "
                          f"{world_size}: check NNODES and NPROC_PER_NODE")
    for flag, size in (("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp)):
        if size < 1:
            raise ConfigError(f"{flag} must be >= 1, got {size}")
    if world_size % (tp * cp) != 0:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        what = (f"--tensor-model-parallel-size {tp}" if cp == 1 else
                f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} = {tp * cp}")
        raise ConfigError(f"{what} does not divide the world size {world_size} (nodes x "
                          f"processes per node): use one of {divisors}")
    return world_size // (tp * cp)


def rank_of(tp_rank: int, cp_rank: int, dp_rank: int, tp_size: int, cp_size: int) -> int:
    """The global rank at (tp, cp, dp) (the module's formula)."""
    return (dp_rank * cp_size + cp_rank) * tp_size + tp_rank


def coords_of(rank: int, tp_size: int, cp_size: int) -> tuple[int, int, int]:
    """(tp_rank, cp_rank, dp_rank) of a global rank."""
    return rank % tp_size, rank // tp_size % cp_size, rank // (tp_size * cp_size)


def _groups(world_size: int, tp: int, cp: int, vary: str) -> list[list[int]]:
    """Every group whose members differ only in the coordinates named in ``vary``."""
    dp = world_size // (tp * cp)
    sizes = {"t": tp, "c": cp, "d": dp}
    groups: dict[tuple, list[int]] = {}
    for r in range(world_size):
        t, c, d = coords_of(r, tp, cp)
        key = tuple(v for name, v in (("t", t), ("c", c), ("d", d)) if name not in vary)
        groups.setdefault(key, []).append(r)
    assert all(len(g) == _prod(sizes[v] for v in vary) for g in groups.values())
    return list(groups.values())


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def tp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1) -> list[list[int]]:
    """Global ranks of every TP group: consecutive blocks of tp_size."""
    return _groups(world_size, tp_size, cp_size, "t")


def cp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1) -> list[list[int]]:
    """Global ranks of every CP group: the same TP and DP position, strided by tp_size."""
    return _groups(world_size, tp_size, cp_size, "c")


def dp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1) -> list[list[int]]:
    """Global ranks of every DP group: the same TP and CP position, strided by tp x cp."""
    return _groups(world_size, tp_size, cp_size, "d")


def dp_cp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1) -> list[list[int]]:
    """Global ranks of every DP x CP group: the same tp_rank, strided by tp_size."""
    return _groups(world_size, tp_size, cp_size, "cd")
