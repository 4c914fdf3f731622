"""What the offload tiers' families share, written down: ``typing.Protocol`` classes.

Each family has a member per tier, and the code that holds one never asks which:

=====================  ==========================================  ======================
contract               members                                     held by
=====================  ==========================================  ======================
:class:`ShardOptimizer` ``ShardedAdamW`` (device or host memory),  the engine, the host
                        ``SwappedAdamW`` (tiles on disk)           step, the landing
:class:`GradStore`      ``HostGrads`` (host memory),               the host step
                        ``SwappedGrads`` (grads.swp)
:class:`ParamHome`      ``HostHome`` (host memory), ``DiskHome``   a unit, the tiers, the
                        (params.swp), ``GdsHome`` (GPUDirect)      home writer
:class:`ParamPublisher` ``ShardPublisher`` (the engine's gathers)  the host step
=====================  ==========================================  ======================

The members match by shape, not by inheritance (a type checker holds them to
these signatures; ``tests/zero/test_contracts.py`` checks the names and
parameters at test time). What the core of :mod:`hybrid.zero` itself calls on
a home is the narrower :class:`~hybrid.zero.flat_unit.ShardHome`, which
:class:`ParamHome` extends: the core never imports this package.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from hybrid.zero.flat_unit import FlatUnit, ShardHome


class Waitable(Protocol):
    """A copy or a write in flight, as an event: a CUDA event, or a disk write wrapped
    as one (the host worker waits for it before it rewrites what it reads)."""

    def synchronize(self) -> None: ...


class Request(Protocol):
    """An asynchronous disk read or write (:class:`hybrid.kernels.aio.AsyncIO`'s)."""

    def wait(self) -> None: ...


class ShardOptimizer(Protocol):
    """AdamW over one rank's flat shard (every unit's owned part, back to back), wherever
    its fp32 master and moments live. Parts are units, in shard order; a chunk is a
    range of the flat shard that one host step updates at a time."""

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-element values it keeps, ``"master"`` first (a checkpoint's columns):
        hybrid's AdamW's ``master, exp_avg, exp_avg_sq``, a client optimizer's own."""

    @property
    def unsaved(self) -> tuple[str, ...]:
        """State a checkpoint cannot hold (a client optimizer's per-parameter scalars
        other than the step count): a save refuses."""

    @property
    def master(self) -> list[torch.Tensor] | None:
        """The master per part, in memory (None: on disk, read through
        :meth:`read_piece`)."""

    @property
    def flat_master(self) -> torch.Tensor | None:
        """The flat master ``master`` are views of (None: none in memory)."""

    @property
    def step_count(self) -> int:
        """Steps applied so far (a host read)."""

    @step_count.setter
    def step_count(self, value: int) -> None: ...

    def begin_step(self, grad_scale: float | torch.Tensor,
                   skip: torch.Tensor | None = None) -> torch.Tensor:
        """Count a step (unless ``skip``); fp64 ``[grad_scale, step, skip]`` for the kernels."""

    def state_bytes(self) -> int:
        """Bytes of the optimizer's own buffers in memory (moments, or staging)."""

    def squared_norms(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """fp64 ``[TP-split, replicated]`` squared norms of per-part gradients."""

    def part_terms(self, i: int, g: torch.Tensor) -> tuple[list, list]:
        """Part ``i``'s squared-norm terms from its gradient ``g``."""

    def sum_terms(self, terms: list, device: torch.device) -> torch.Tensor:
        """:meth:`squared_norms` from every part's :meth:`part_terms`, in part order."""

    def chunks(self) -> list[tuple[int, int]]:
        """The flat shard ranges ``[lo, hi)`` a host step updates one at a time."""

    def prefetch(self) -> int:
        """Start moving the states the next :meth:`chunk_steps` in ascending order reads
        first, before its step is known (only between steps); returns how many chunks'
        reads it started (0 where the states are in memory, or already on their way)."""

    def chunk_steps(self, grad: torch.Tensor | None, lr: float, scalars: torch.Tensor,
                    found: torch.Tensor, order: Iterable[int] | None = None
                    ) -> Generator[ChunkStep, None, None]:
        """One step, chunk by chunk: each chunk ``k`` of ``order`` (default: ascending) in
        turn, ready to step (:class:`ChunkStep`), its gradient from the flat ``grad``
        (None: it comes with the chunk's states). The caller drives the loop -- it
        prepares each chunk's output, steps it, hands the result on -- and the
        optimizer calls nothing back. The step is done when the iteration ends."""

    def master_into(self, out: torch.Tensor) -> None:
        """The flat master, rounded to ``out``'s dtype, into the flat ``out``."""

    def master_range(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 master over flat shard elements ``[lo, hi)``."""

    def read_piece(self, key: str, part: int, where: slice) -> torch.Tensor:
        """Elements ``where`` of part ``part`` of ``key`` (one of :attr:`columns`)."""

    def write_piece(self, key: str, part: int, where: slice,
                    values: torch.Tensor | None) -> None:
        """Elements ``where`` of part ``part`` of ``key`` <- ``values`` (None: zeros)."""


class ChunkStep(Protocol):
    """One chunk of an optimizer step, its states and gradient at hand."""

    @property
    def k(self) -> int:
        """The chunk's index in :meth:`ShardOptimizer.chunks`."""

    def apply(self, out: torch.Tensor | None) -> None:
        """AdamW over the chunk; its new parameters also into ``out`` when not None."""


class GradStore(Protocol):
    """Where this step's reduced gradient shard waits for the host step, unit ``i`` at
    its place in the flat shard. ``stream``: the CUDA copy stream, or None (a CPU)."""

    @property
    def own(self) -> bool:
        """Whether storing moves bytes (False: the store is the device's own flat
        shard, on a CPU, and a unit is stored by being reduced)."""

    def store(self, i: int, src: torch.Tensor,
              stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """Unit ``i``'s shard ``src`` (a partial sum, or final) into the store; returns
        the event of its copy off the device (None: done)."""

    def load(self, i: int, dst: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """``dst`` <- unit ``i``'s shard as last stored, ordered before the current
        stream's next work."""

    def values(self, i: int) -> torch.Tensor:
        """Unit ``i``'s shard as last stored, in host memory (for reading)."""

    def wait_all(self) -> None:
        """Every unit's last store has landed (before the step reads the store)."""

    def nbytes(self) -> int:
        """Host bytes the store holds."""


class ParamHome(ShardHome, Protocol):
    """Where a partitioned unit's parameter shard lives between its gathers (stage 3
    ``--offload-param``): the unit loads it for a gather, the host step writes the new
    shard after the update."""

    def target(self) -> torch.Tensor | None:
        """Host memory the host step may write the new shard into in place (after
        :meth:`wait_loaded`), or None: it writes through :meth:`write_at`."""

    def wait_loaded(self) -> None:
        """The last load has read the home out: it may be rewritten."""

    def write_at(self, start: int, values: torch.Tensor) -> Request | None:
        """Shard elements ``[start, start + len)`` <- ``values``; returns the write in
        flight (``values`` must stay unchanged until it ends), or None: done."""

    def store(self, values: torch.Tensor) -> Waitable | None:
        """The whole new shard; returns what ends with its write (None: done)."""

    def store_done(self) -> None:
        """Every write has ended (before the home's file goes)."""

    def host_bytes(self) -> int:
        """Host bytes held now (the shard, or reads in flight)."""

    def device_bytes(self) -> int:
        """Device bytes held now (GPUDirect reads in flight)."""


class Speculation(Protocol):
    """The nvme tier's update of the read-ahead tiles before the step is known
    (:class:`~hybrid.zero.offload.nvme.speculative.SpeculativeUpdate`; [Note: what starts
    before the step] in hybrid/zero/offload/host_step.py). The host step holds one or
    none and never asks which tier made it."""

    seconds: float  # the worker in it, summed over steps

    def start(self, lr: float, grad_scale: float, final: list[bool]) -> None: ...

    def post(self, scalars: torch.Tensor, ready: Waitable | None, lr: float) -> None: ...

    def abandon(self) -> None: ...

    def end(self, keep: bool) -> None: ...

    def counts(self) -> dict: ...

    def nbytes(self) -> int: ...


# (what the engine hands the host step: given its worker and, per tile, the units the tile
# overlaps, the speculation)
SpeculationOf = Callable[[ThreadPoolExecutor, list[list[int]]], Speculation]


class ParamPublisher(Protocol):
    """Makes a unit's new parameter shard every rank's: the host step tells it each
    unit once the shard is on the device (or home), as the update goes."""

    def publish(self, unit: FlatUnit) -> None:
        """Start whatever makes ``unit``'s new shard visible: an all-gather of a whole
        unit when the optimizer is sharded; nothing for a partitioned unit (stage 3
        gathers it when a module uses it)."""
