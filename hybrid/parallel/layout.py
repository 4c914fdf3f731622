"""The process layout as plain arithmetic: no torch, no process groups.

Megatron's order: tensor-parallel ranks adjacent (a TP group stays inside one node),
then context-parallel, then data-parallel, and pipeline-parallel outermost (a pipeline
stage spans whole nodes)::

    global rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

    world 8, TP 2, CP 2:  TP groups     [0,1] [2,3] [4,5] [6,7]
                          CP groups     [0,2] [1,3] [4,6] [5,7]
                          DP groups     [0,4] [1,5] [2,6] [3,7]
                          DP x CP       [0,2,4,6] [1,3,5,7]   (same tp_rank)

    world 8, TP 2, PP 2:  TP groups     [0,1] [2,3] [4,5] [6,7]
                          DP groups     [0,2] [1,3] [4,6] [5,7]
                          PP groups     [0,4] [1,5] [2,6] [3,7]
                          embedding     [0,4] [1,5] [2,6] [3,7]   (first and last stage)

A CP group holds the ranks that split one sequence; a DP group the ranks that see
different samples at the same TP, CP and PP position; DP x CP every rank with the same TP
slice of the same stage's parameters (ZeRO shards and reduces over it: see
:class:`hybrid.parallel.state.ParallelState`). A PP group holds the stages one sample
flows through, in stage order; its first and last rank form the embedding group (the
tied word embedding lives on both). With CP 1 the DP x CP groups are the DP groups; with
PP 1 every rank is a whole pipeline and the ranks and groups are those of TP x CP x DP.

[Note: the expert layout]
The MoE layers lay the same ranks out again (Megatron's parallel folding,
:class:`ExpertLayout`): within each pipeline stage, expert-tensor-parallel ranks
adjacent, then expert-parallel, then expert-data-parallel (what is left); PP outermost
as above, so a stage holds the same ranks in both layouts::

    global rank = ((pp_rank * edp_size + edp_rank) * ep_size + ep_rank) * etp_size + etp_rank

    world 8, ETP 1, EP 4:  EP groups   [0,1,2,3] [4,5,6,7]   (each holds every expert once)
                           EDP groups  [0,4] [1,5] [2,6] [3,7]  (the same experts)

An EP group holds the ranks the experts are split over (tokens go to their expert's rank
by all-to-all within it); an EDP group the ranks holding the same experts (their
gradients are reduced, and ZeRO shards them, over it); ETP x EP the ranks one MoE
layer's tokens move between. It is megatron-core's ``RankGenerator(tp=ETP, ep=EP,
dp=EDP, pp=PP, cp=1, order="tp-cp-ep-dp-pp")`` (tests/parallel/test_expert_layout.py
holds the two equal on many settings).

Group listings cost O(world) and one rank's own group O(its size), whatever the kind
(:meth:`Layout.groups`, :meth:`Layout.group_of`). :mod:`hybrid.config` checks a command
line against the layout before any worker starts; :mod:`hybrid.parallel.state` builds the
process groups from it.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from hybrid.errors import ConfigError

# Group kinds by the coordinates their members differ in (t: TP, c: CP, d: DP, p: PP).
KINDS = {"tp": "t", "cp": "c", "dp": "d", "dp_cp": "cd", "pp": "p"}
# The expert layout's kinds (t: ETP, e: EP, d: EDP, p: PP; the note above).
EXPERT_KINDS = {"etp": "t", "ep": "e", "edp": "d", "etp_ep": "te", "pp": "p"}


def check_layout(world_size: int, tensor_model_parallel_size: int,
                 context_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> int:
    """The data-parallel size, or a ConfigError naming the flag to change."""
    tp, cp, pp = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
    if world_size < 1:
        raise ConfigError(f"the world size (nodes x processes per node) must be >= 1, got "
                          f"{world_size}: check NNODES and NPROC_PER_NODE")
    for flag, size in (("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
                       ("--pipeline-model-parallel-size", pp)):
        if size < 1:
            raise ConfigError(f"{flag} must be >= 1, got {size}")
    if world_size % (tp * cp * pp) != 0:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        parts = [("--tensor-model-parallel-size", tp)]
        parts += [("--context-parallel-size", cp)] if cp > 1 else []
        if pp > 1:  # (PP 1: the message is the TP x CP one it always was)
            parts = [p for p in parts if p[1] > 1] + [("--pipeline-model-parallel-size", pp)]
        what = " x ".join(f"{flag} {size}" for flag, size in parts)
        if len(parts) > 1:
            what += f" = {tp * cp * pp}"
        raise ConfigError(f"{what} does not divide the world size {world_size} (nodes x "
                          f"processes per node): use one of {divisors}")
    return world_size // (tp * cp * pp)


class Coords(NamedTuple):
    """Where a rank sits: its rank in its TP, CP, DP and PP groups."""

    tp: int
    cp: int
    dp: int
    pp: int


class _Grid(abc.ABC):
    """Ranks as a grid of coordinates, the first of ``DIMS`` innermost (adjacent ranks):
    the group arithmetic both layouts share. A subclass gives ``DIMS`` (one letter per
    coordinate, inner to outer), ``KINDS`` (kind: the letters its members differ in) and
    :meth:`_sizes` (letter: size)."""

    DIMS: str
    KINDS: dict[str, str]

    @property
    @abc.abstractmethod
    def _sizes(self) -> dict[str, int]:
        """Each coordinate's size, by its letter."""

    @property
    def _strides(self) -> dict[str, int]:
        out, stride = {}, 1
        for d in self.DIMS:
            out[d] = stride
            stride *= self._sizes[d]
        return out

    def _coords(self, rank: int) -> dict[str, int]:
        sizes, strides = self._sizes, self._strides
        return {d: rank // strides[d] % sizes[d] for d in self.DIMS}

    def _offsets(self, vary: str) -> list[int]:
        """Rank offsets of a group's members from its first, in ascending order."""
        sizes, strides = self._sizes, self._strides
        dims = sorted(vary, key=lambda d: strides[d], reverse=True)  # outermost first
        return [sum(k * strides[d] for k, d in zip(ks, dims))
                for ks in itertools.product(*(range(sizes[d]) for d in dims))]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group of ``kind`` (the class's ``KINDS``) in
        group-rank order: O(group size)."""
        vary = self.KINDS[kind]
        c = self._coords(rank)
        first = rank - sum(c[d] * self._strides[d] for d in vary)
        return [first + o for o in self._offsets(vary)]

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (the class's ``KINDS``), ordered by their first rank;
        together they hold every rank once. O(world)."""
        vary = self.KINDS[kind]
        fixed = "".join(d for d in self.DIMS if d not in vary)
        offsets = self._offsets(vary)
        firsts = sorted(sum(k * self._strides[d] for k, d in zip(ks, fixed))
                        for ks in itertools.product(*(range(self._sizes[d]) for d in fixed)))
        return [[f + o for o in offsets] for f in firsts]


@dataclass(frozen=True)
class Layout(_Grid):
    """The layout of ``world_size`` ranks at TP x CP x PP (DP is what is left), checked.

    ``Layout(8, tp=2, pp=2).group_of("pp", 1) == [1, 5]``.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1

    DIMS = "tcdp"
    KINDS = KINDS

    def __post_init__(self):
        check_layout(self.world_size, self.tp, self.cp, self.pp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def _sizes(self) -> dict[str, int]:
        return {"t": self.tp, "c": self.cp, "d": self.dp, "p": self.pp}

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates (the module's formula)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords_of(self, rank: int) -> Coords:
        """(tp, cp, dp, pp) of a global rank."""
        c = self._coords(rank)
        return Coords(c["t"], c["c"], c["d"], c["p"])

    def embedding_group_of(self, rank: int) -> list[int]:
        """The first and last stage ranks of ``rank``'s PP group (one rank at PP 1). A rank
        of a middle stage is in none: its own list is this rank alone."""
        pp = self.group_of("pp", rank)
        ends = sorted({pp[0], pp[-1]})
        return ends if rank in ends else [rank]

    def embedding_groups(self) -> list[list[int]]:
        """Every embedding group (first and last stage of each PP group), by first rank."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    def stage_neighbours(self, rank: int) -> tuple[int, int]:
        """(previous, next) stage's rank in ``rank``'s PP group, around the ring: the first
        stage's previous is the last stage, whose next is the first (where an interleaved
        schedule's chunk v hands over to chunk v + 1). This rank itself at PP 1."""
        g = self.group_of("pp", rank)
        i = g.index(rank)
        return g[(i - 1) % len(g)], g[(i + 1) % len(g)]


class ExpertCoords(NamedTuple):
    """Where a rank sits in the expert layout: its rank in its ETP, EP, EDP and PP
    groups."""

    etp: int
    ep: int
    edp: int
    pp: int


def check_expert_layout(world_size: int, etp: int, ep: int, pp: int = 1) -> int:
    """The expert-data-parallel size, or a ConfigError naming the flags to change."""
    for flag, size in (("--expert-tensor-parallel-size", etp),
                       ("--expert-model-parallel-size", ep)):
        if size < 1:
            raise ConfigError(f"{flag} must be >= 1, got {size}")
    stage = world_size // pp
    if stage % (etp * ep):
        divisors = ", ".join(str(d) for d in range(1, stage + 1) if stage % d == 0)
        raise ConfigError(f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size "
                          f"{ep} = {etp * ep} does not divide a pipeline stage's {stage} ranks "
                          f"(the world size {world_size} / --pipeline-model-parallel-size "
                          f"{pp}): use one of {divisors}")
    return stage // (etp * ep)


@dataclass(frozen=True)
class ExpertLayout(_Grid):
    """The MoE layers' layout of ``world_size`` ranks at ETP x EP x PP (EDP is what is
    left), checked ([Note: the expert layout]).

    ``ExpertLayout(8, ep=4).group_of("edp", 1) == [1, 5]``.
    """

    world_size: int
    etp: int = 1
    ep: int = 1
    pp: int = 1

    DIMS = "tedp"
    KINDS = EXPERT_KINDS

    def __post_init__(self):
        check_expert_layout(self.world_size, self.etp, self.ep, self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def _sizes(self) -> dict[str, int]:
        return {"t": self.etp, "e": self.ep, "d": self.edp, "p": self.pp}

    def coords_of(self, rank: int) -> ExpertCoords:
        """(etp, ep, edp, pp) of a global rank."""
        c = self._coords(rank)
        return ExpertCoords(c["t"], c["e"], c["d"], c["p"])


def rank_of(tp_rank: int, cp_rank: int, dp_rank: int, tp_size: int, cp_size: int,
            pp_rank: int = 0, dp_size: int = 1) -> int:
    """The global rank at (tp, cp, dp, pp) (the module's formula; ``dp_size`` is needed
    only past the first stage)."""
    return ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank


def coords_of(rank: int, tp_size: int, cp_size: int) -> tuple[int, int, int]:
    """(tp_rank, cp_rank, dp_rank) of a global rank at PP 1 (with PP: :meth:`Layout.coords_of`)."""
    return rank % tp_size, rank // tp_size % cp_size, rank // (tp_size * cp_size)


def tp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1,
                   pp_size: int = 1) -> list[list[int]]:
    """Global ranks of every TP group: consecutive blocks of tp_size."""
    return Layout(world_size, tp_size, cp_size, pp_size).groups("tp")


def cp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1,
                   pp_size: int = 1) -> list[list[int]]:
    """Global ranks of every CP group: the same TP, DP and PP position, strided by tp_size."""
    return Layout(world_size, tp_size, cp_size, pp_size).groups("cp")


def dp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1,
                   pp_size: int = 1) -> list[list[int]]:
    """Global ranks of every DP group: the same TP, CP and PP position, strided by tp x cp."""
    return Layout(world_size, tp_size, cp_size, pp_size).groups("dp")


def dp_cp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1,
                      pp_size: int = 1) -> list[list[int]]:
    """Global ranks of every DP x CP group: the same tp_rank and stage, strided by tp_size."""
    return Layout(world_size, tp_size, cp_size, pp_size).groups("dp_cp")


def pp_group_ranks(world_size: int, tp_size: int, cp_size: int = 1,
                   pp_size: int = 1) -> list[list[int]]:
    """Global ranks of every PP group, in stage order: strided by world / pp."""
    return Layout(world_size, tp_size, cp_size, pp_size).groups("pp")
