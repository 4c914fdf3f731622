"""The nvme tier's optimizer states: one rank's fp32 master and Adam moments in tiles on disk.

The rank's flat shard (every unit's owned part, back to back, as the host
tier lays it out) is cut into tiles of ``T`` elements (``--offload-buffer-size``).
Tile ``k`` covers shard elements ``[k T, (k + 1) T)`` and is one record of the
swap file ``optimizer.swp``::

    offset k * 12T bytes:  master[T] | exp_avg[T] | exp_avg_sq[T]   (fp32)

so a tile moves with one read and one write of ``12 T`` bytes at an aligned
offset (direct I/O, no page cache). The last tile is padded to full size.

[Note: the tile pipeline]
A step visits the tiles in order through ``--offload-buffer-count`` staging
buffers of one tile each, used as a ring: while tile ``k`` is being updated,
the reads of tiles ``k + 1 .. k + C - 2`` are in flight and the write of tile
``k - 1`` drains. Before tile ``k + C - 1`` is read into the buffer tile ``k - 1``
used, that buffer's write must have finished. The optimizer drives the ring:
:meth:`SwappedStates.each` yields tile after tile and writes a tile back when asked
for the next one. Host memory is the C
buffers, whatever the model size; the disk sees one sequential read and one
sequential write of the swap file per step. When the gradients are swapped too
(:class:`~hybrid.zero.offload.nvme.grads.SwappedGrads`, attached), each tile's
gradient slot is read with its states into a ring of its own, and not written
back.

[Note: reading ahead of the step]
Between two steps the file holds the states the next step reads, and the staging
buffers are idle (the update is not delayed: nothing is in flight after an
:meth:`SwappedStates.each`). :meth:`SwappedStates.prefetch` starts the reads of the
first ``C - 1`` tiles' states into the buffers the next :meth:`each` reads them into,
before the step is known -- under a pipeline, as soon as the stage's last backward has
ended, while it waits for the other stages and the global norm. :meth:`each` then
issues only the reads it has not got (the gradients' always: they are on disk only
once the step waits for them). The same bytes reach the same buffers, so the update
is unchanged; a step that updates nothing (skipped) leaves them for the next (unless
they were held and updated: then it lets them go, below), and whatever writes the
file outside a step (:meth:`fill`, :meth:`write_range`) first lets them go.

[Note: holding read-ahead tiles]
The offloaded step may go further with the tiles read ahead: :meth:`SwappedStates.ahead`
holds them and reads their gradients (the caller has made sure those are final on
disk), and :meth:`held` hands each out once it has arrived. The caller updates them in
their staging buffers (a speculative update: [Note: what starts before the step] in
hybrid/zero/offload/host_step.py); the file keeps the old states. The next
:meth:`each` of the read-ahead's order then yields a held tile without reading it again
(the caller knows it is done) and writes it back as its turn comes, as any tile.
Otherwise the caller releases them: ``release(dirty=j)`` when the step comes next and
only the first ``j`` were updated -- their states are read again from the file, which
still holds them as before the update, while the other held tiles' states and every
held gradient (the kernel does not write it) stay for that :meth:`each`; ``release()``
when no step of these gradients follows (a skipped one): everything goes, and the next
read-ahead starts afresh. Held or not, a tile is written only by :meth:`each`, so the
file never holds a state that the step did not decide on.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from typing import NamedTuple, Protocol

import torch

from hybrid.kernels.aio import AsyncIO, Request, SwapFile, aligned_empty
from hybrid.zero.offload.nvme.swap import SwapSpace
from hybrid.zero.optimizer import STATE_KEYS
from hybrid.zero.units import FlatFill

FILE = "optimizer.swp"


class Tile(NamedTuple):
    """Tile ``k``'s states (views of a staging buffer) and, swapped with them, its
    gradient (None when the gradient comes from a flat shard in memory)."""

    k: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor | None


def tile_spans(lo: int, hi: int, tile: int) -> Iterator[tuple[int, int, int, int]]:
    """(tile k, start within it, start, stop) of each tile's part of shard elements
    ``[lo, hi)``; start and stop relative to ``lo``."""
    pos = lo
    while pos < hi:
        k = pos // tile
        end = min(hi, (k + 1) * tile)
        yield k, pos - k * tile, pos - lo, end - lo
        pos = end


class TileGrads(Protocol):
    """What the states ask of the gradients swapped in their tiles
    (:class:`~hybrid.zero.offload.nvme.grads.SwappedGrads`, which imports this module):
    the file, each tile's slot in it, and the element size and dtype."""

    @property
    def file(self) -> SwapFile: ...

    @property
    def slot_bytes(self) -> int: ...

    @property
    def esize(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...


class TileGuard(Protocol):
    """Something reading the swap file that a tile's write must not overtake (an
    asynchronous save's copy of it, hybrid/checkpoint/snapshot.py)."""

    def wait_for(self, k: int) -> None:
        """Return once tile ``k``'s old bytes are no longer needed."""


class SwappedStates:
    """``n`` elements of master and both moments, in tiles of ``tile`` elements.

    ``space_for(n, tile)`` gives the bytes to reserve for :class:`SwapSpace`;
    ``space`` must hold :data:`FILE` of that size. ``buffers``: staging buffers
    (>= 2). ``pin``: page-locked staging (GPU hosts).
    """

    def __init__(self, n: int, tile: int, space: SwapSpace, io: AsyncIO, *, buffers: int,
                 pin: bool = False):
        self.n, self.tile = n, tile
        self.tiles = -(-n // tile)
        self.space, self.io = space, io
        self.file = space.files[FILE]
        self.staging = [aligned_empty(3 * tile, torch.float32, pin) for _ in range(buffers)]
        self._reads: dict[int, Request] = {}  # tile -> read request in flight
        self._writes: dict[int, Request] = {}  # buffer -> write request in flight
        self.grads: TileGrads | None = None  # SwappedGrads, when attached
        self._grad_reads: dict[int, Request] = {}  # tile -> its gradient's read
        # the tiles whose states :meth:`prefetch` read into buffers 0, 1, ... (in flight or
        # done), for the next :meth:`each` ([Note: reading ahead of the step])
        self._prefetched: list[int] = []
        # the first ``_held`` of them: handed out by :meth:`ahead` (gradients read, states
        # perhaps updated by the caller), not written back ([Note: holding read-ahead tiles])
        self._held = 0
        # a reader of the file's current bytes, ahead of whose progress no tile is written
        self.guard: TileGuard | None = None

    def attach_grads(self, grads: TileGrads, pin: bool = False) -> None:
        """Read each tile's gradient from ``grads`` (a SwappedGrads in the same tiles)
        with its states; ``update`` then gets it as a fifth argument."""
        self.grads = grads
        per = grads.slot_bytes // grads.esize
        self.grad_staging = [aligned_empty(per, grads.dtype, pin) for _ in self.staging]

    @staticmethod
    def space_for(n: int, tile: int) -> int:
        return -(-n // tile) * tile * 12

    def bounds(self, k: int) -> tuple[int, int]:
        """Shard elements ``[lo, hi)`` of tile ``k``."""
        return k * self.tile, min(self.n, (k + 1) * self.tile)

    def planes(self, buf: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """(master, exp_avg, exp_avg_sq) views of a staging buffer's first ``length``."""
        t = self.tile
        return tuple(buf[i * t: i * t + length] for i in range(3))

    def _offset(self, k: int, plane: int = 0, element: int = 0) -> int:
        return (k * 3 * self.tile + plane * self.tile + element) * 4

    # -- the pipeline --------------------------------------------------------------
    def each(self, order: Iterable[int] | None = None) -> Generator[Tile, None, None]:
        """Every tile ``k`` of ``order`` (default: ascending) as a :class:`Tile` of views of
        the staging buffers (``grad`` when gradients are attached): what the caller writes
        to its states before asking for the next tile goes back to disk. When the
        iteration ends (or the generator is closed) every write has finished, and the
        file holds this step's states. The caller drives the loop: nothing is called
        back."""
        self.space.check()
        order = list(range(self.tiles)) if order is None else list(order)
        c = len(self.staging)
        ahead = max(1, c - 1)  # tiles read ahead, leaving one buffer to drain a write
        first = order[: min(ahead, len(order))]
        if self._prefetched and self._prefetched != first[: len(self._prefetched)]:
            # (held tiles are for the read-ahead's order: the caller releases them first)
            assert not self._held, "held tiles, another order: release() them first"
            self.drain()  # (read ahead for another order: not this run's buffers)
        pre = len(self._prefetched)  # [Note: reading ahead of the step]
        held = self._held  # [Note: holding read-ahead tiles]: their gradients are here
        self._prefetched, self._held = [], 0
        for j, k in enumerate(first):
            self._read(j, k, states=j >= pre, grad=j >= held)
        try:
            for j, k in enumerate(order):  # the j-th tile uses buffer j % c
                buf = self.staging[j % c]
                # (a held tile has no read in flight, unless released: then its states')
                if k in self._reads:
                    self._reads.pop(k).wait()
                lo, hi = self.bounds(k)
                grad = None
                if self.grads is not None:
                    if k in self._grad_reads:
                        self._grad_reads.pop(k).wait()
                    grad = self.grad_staging[j % c][: hi - lo]
                master, exp_avg, exp_avg_sq = self.planes(buf, hi - lo)
                yield Tile(k, master, exp_avg, exp_avg_sq, grad)
                if self.guard is not None:
                    self.guard.wait_for(k)
                self._writes[j % c] = self.io.write(self.file, self._offset(k), buf)
                if j + ahead < len(order):
                    self._read(j + ahead, order[j + ahead])
        finally:
            self.drain()

    def prefetch(self, order: Iterable[int] | None = None) -> int:
        """Start reading the states of the first ``C - 1`` tiles of ``order`` (default:
        ascending) into the buffers the next :meth:`each` of that order reads them into
        ([Note: reading ahead of the step]); nothing when they are already on their way.
        Only between steps: no :meth:`each` may be running. Returns the tiles it started
        reading."""
        order = list(range(self.tiles)) if order is None else list(order)
        first = order[: min(max(1, len(self.staging) - 1), len(order))]
        if self._prefetched == first and not self._held:
            return 0
        self.drain()  # (held tiles too: their buffers no longer hold the file's states)
        self.space.check()
        for j, k in enumerate(first):
            self._read(j, k, grad=False)
        self._prefetched = first
        return len(first)

    @property
    def read_ahead(self) -> list[int]:
        """The tiles :meth:`prefetch` read ahead (in flight, arrived or held), in order."""
        return list(self._prefetched)

    def ahead(self, count: int) -> int:
        """Hold the first ``count`` tiles :meth:`prefetch` read ahead ([Note: holding
        read-ahead tiles]): their gradients start coming (the caller has made sure every
        write of them to the gradient file has ended); :meth:`held` gives each once it
        is here. What the caller writes to them stays in the buffers until the next
        :meth:`each` (of the read-ahead's order) writes them back, yielding them unread,
        or :meth:`release` lets them go. Needs attached gradients; only between steps, at
        most once per read-ahead. Returns how many are held."""
        assert self.grads is not None, "ahead() needs the gradients attached"
        assert not self._held, "the read-ahead tiles are already held"
        tiles = self._prefetched[: max(0, count)]
        for j, k in enumerate(tiles):  # (the read-ahead's buffers: none is being written)
            self._read(j, k, states=False)
        self._held = len(tiles)
        return self._held

    def held(self, j: int) -> Tile:
        """The ``j``-th held tile, as :class:`Tile` views of its staging buffers, once its
        states and gradient have arrived (what it has not waited for, :meth:`each` will)."""
        assert j < self._held
        k = self._prefetched[j]
        try:
            if k in self._reads:
                self._reads.pop(k).wait()
            if k in self._grad_reads:
                self._grad_reads.pop(k).wait()
        except BaseException:
            self.drain()  # (nothing held: the next each() reads every tile itself)
            raise
        lo, hi = self.bounds(k)
        master, exp_avg, exp_avg_sq = self.planes(self.staging[j], hi - lo)
        return Tile(k, master, exp_avg, exp_avg_sq, self.grad_staging[j][: hi - lo])

    def release(self, dirty: int | None = None) -> None:
        """Let held tiles go. ``dirty``: the caller changed the states of the first
        ``dirty`` held tiles only, and this step's :meth:`each` comes next: their states
        are read again from the file (which holds them as they were; the caller has had
        them from :meth:`held`), the rest of the read-ahead and the gradients read stay
        for it. None: let the whole read-ahead go (the next :meth:`each` reads every tile
        itself)."""
        if dirty is None or not self._held:
            self.drain()
            return
        for j, k in enumerate(self._prefetched[: min(dirty, self._held)]):
            self._reads[k] = self.io.read(self.file, self._offset(k), self.staging[j])

    @property
    def holding(self) -> bool:
        """Some read-ahead tiles are held (:meth:`ahead`), their gradients read."""
        return self._held > 0

    def _read(self, j: int, k: int, states: bool = True, grad: bool = True) -> None:
        """Read tile ``k``, the ``j``-th of the run, into buffer ``j % C``: its states
        unless ``states`` is False (:meth:`prefetch` did), its gradient when attached and
        ``grad``."""
        b = j % len(self.staging)
        if b in self._writes:  # the buffer's previous tile must be on disk first
            self._writes.pop(b).wait()
        if states:
            self._reads[k] = self.io.read(self.file, self._offset(k), self.staging[b])
        if self.grads is not None and grad:  # (its buffer's previous tile was read: never written)
            self._grad_reads[k] = self.io.read(self.grads.file, k * self.grads.slot_bytes,
                                               self.grad_staging[b])

    def drain(self) -> None:
        """Wait for every request in flight (the first error is raised after all ended)."""
        pending = [*self._reads.values(), *self._writes.values(), *self._grad_reads.values()]
        self._reads, self._writes, self._grad_reads = {}, {}, {}
        self._prefetched, self._held = [], 0
        error = None
        for r in pending:
            try:
                r.wait()
            except Exception as e:  # noqa: BLE001 -- all must end before we raise
                error = error or e
        if error is not None:
            raise error

    def written(self) -> None:
        """Wait for the tiles being written back (reads ahead stay as they are): the file
        then holds every state written so far (an asynchronous save copies it)."""
        for r in list(self._writes.values()):
            r.wait()

    # -- element ranges, outside the step (initialization, checkpoints) -------------
    def fill(self, master_values: FlatFill) -> None:
        """Initialize every tile: master from ``master_values(lo, hi, dst)`` (fills the
        fp32 ``dst`` with shard elements ``[lo, hi)``), moments zero. One pass."""
        self.drain()  # (a read ahead would hold the old states)
        buf = self.staging[0]
        for k in range(self.tiles):
            if self.guard is not None:
                self.guard.wait_for(k)
            lo, hi = self.bounds(k)
            buf.zero_()
            master_values(lo, hi, buf[: hi - lo])
            self.io.write(self.file, self._offset(k), buf).wait()

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """fp32 ``(hi - lo,)`` copy of plane ``key`` over shard elements ``[lo, hi)``."""
        out = torch.empty(hi - lo, dtype=torch.float32)
        reqs = [self.io.read(self.file, off, out[a: b]) for off, a, b in self.spans(key, lo, hi)]
        for r in reqs:
            r.wait()
        return out

    def write_range(self, key: str, lo: int, hi: int, values: torch.Tensor) -> None:
        """Plane ``key`` over shard elements ``[lo, hi)`` <- ``values`` (``(hi - lo,)``)."""
        self.drain()  # (a read ahead would hold the old states)
        if self.guard is not None:
            self.guard.wait_for(self.tiles - 1)
        src = values.detach().to(torch.float32).contiguous()
        reqs = [self.io.write(self.file, off, src[a: b]) for off, a, b in self.spans(key, lo, hi)]
        for r in reqs:
            r.wait()

    def spans(self, key: str, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(file offset, start, stop) of each tile's part of ``[lo, hi)``, relative to lo."""
        plane = STATE_KEYS.index(key)  # the planes of a tile, in file order
        for k, within, a, b in tile_spans(lo, hi, self.tile):
            yield self._offset(k, plane, within), a, b

    def nbytes(self) -> int:
        """Host bytes of the staging buffers."""
        grads = 0 if self.grads is None else sum(
            b.untyped_storage().nbytes() for b in self.grad_staging)
        return sum(b.numel() * 4 for b in self.staging) + grads

    def close(self) -> None:
        """Wait for what is in flight (the engine then closes the space and the I/O)."""
        self.drain()
