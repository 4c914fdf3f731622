"""The nvme tier's gradient store: this step's gradient shard in ``grads.swp``.

The offloaded step (:mod:`hybrid.zero.offload.host_step`) reads each unit's reduced
gradient shard off the device. The host store
(:class:`~hybrid.zero.offload.grads.HostGrads`) keeps the rank's whole shard
in one (pinned) host buffer, ``e_g`` bytes per element -- host memory that
grows with the model. With the optimizer on NVMe that would be the one term
that does, so :class:`SwappedGrads` keeps the shard in ``grads.swp`` instead,
laid out in the optimizer's tiles (tile ``k``'s gradient at ``k`` x an aligned
slot), so the step reads each tile's gradient with its states::

    device unit shard --D2H--> staging (2 x largest unit) --write--> grads.swp
    grads.swp --read, tile by tile with the states--> the Adam kernel

[Note: the gradient writer]
A unit's copy down lands in one of two pinned staging buffers; a writer thread
waits for the copy's CUDA event (the main thread never does), writes the
unit's element range into the tile slots it spans, and gives the buffer back.
``stored[i]`` says unit ``i``'s last write is on disk: an earlier micro-batch's
partial sum is read back only after it, and the step waits for every unit's
before its first tile read. A failed write is raised by whoever waits next,
so no rank hangs on a write that will not come.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from hybrid.kernels.aio import ALIGN, AsyncIO, aligned_empty
from hybrid.zero.offload.grads import stream_copy
from hybrid.zero.offload.nvme.swap import SwapSpace
from hybrid.zero.offload.nvme.tiles import tile_spans

FILE = "grads.swp"


class SwappedGrads:
    """The shard in ``space.files[FILE]``, in the tiles of :class:`SwappedStates`: tile
    ``k``'s ``tile`` elements at byte ``k * slot_bytes`` (see the module notes).

    ``bounds``: where each unit starts in the flat shard (its last entry: ``n``).
    """

    def __init__(self, space: SwapSpace, io: AsyncIO, bounds: list[int], *, tile: int,
                 dtype: torch.dtype, pin: bool):
        self.file, self.io, self.bounds = space.files[FILE], io, bounds
        self.tile, self.dtype = tile, dtype
        self.own = True
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = self.slot_bytes_for(tile, dtype)
        biggest = max(b - a for a, b in zip(bounds, bounds[1:]))
        self._free: queue.Queue = queue.Queue()
        self._bufs = [aligned_empty(biggest, dtype, pin) for _ in range(2)]
        for b in self._bufs:
            self._free.put(b)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hybrid-grad-writer")
        self.stored = [threading.Event() for _ in bounds[:-1]]
        for e in self.stored:
            e.set()
        self._error: BaseException | None = None

    @staticmethod
    def slot_bytes_for(tile: int, dtype: torch.dtype) -> int:
        """Bytes of one tile's gradient slot: aligned for direct I/O."""
        n = tile * torch.empty((), dtype=dtype).element_size()
        return -(-n // ALIGN) * ALIGN

    @classmethod
    def space_for(cls, n: int, tile: int, dtype: torch.dtype) -> int:
        return -(-n // tile) * cls.slot_bytes_for(tile, dtype)

    def _spans(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(file offset, start, stop) of each tile's part of shard elements ``[lo, hi)``,
        start and stop relative to ``lo``."""
        for k, within, a, b in tile_spans(lo, hi, self.tile):
            yield k * self.slot_bytes + within * self.esize, a, b

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    # -- backward: units go down, and partial sums come back up -----------------------
    def store(self, i: int, src: torch.Tensor,
              stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """Unit ``i``'s shard ``src`` to disk, asynchronously (the module note); returns
        the CUDA event of its copy off the device (None: copied)."""
        self._raise()
        buf = self._free.get()  # (both in flight: the disk is behind; wait for it)
        stage = buf[: src.numel()]
        event = stream_copy(stage, src, stream)
        self.stored[i].clear()
        self._writer.submit(self._write, i, stage, buf, event)
        return event

    def _write(self, i: int, stage: torch.Tensor, buf: torch.Tensor,
               event: torch.cuda.Event | None) -> None:
        try:
            if event is not None:
                event.synchronize()
            lo = self.bounds[i]
            reqs = [self.io.write(self.file, off, stage[a:b])
                    for off, a, b in self._spans(lo, self.bounds[i + 1])]
            for r in reqs:
                r.wait()
        except BaseException as e:  # noqa: BLE001 -- raised by the next waiter
            self._error = self._error or e
        finally:
            self._free.put(buf)
            self.stored[i].set()

    def load(self, i: int, dst: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """``dst`` <- unit ``i``'s shard as last stored (a partial sum of this step),
        ordered before the current stream's next work."""
        self.stored[i].wait()
        self._raise()
        buf = self._free.get()
        stage = self.read_into(i, buf)
        event = stream_copy(dst, stage, stream, back=True)
        if event is None:
            self._free.put(buf)
        else:  # the buffer is free once the copy up has read it
            self._writer.submit(self._release, buf, event)

    def _release(self, buf: torch.Tensor, event: torch.cuda.Event) -> None:
        event.synchronize()
        self._free.put(buf)

    def read_into(self, i: int, buf: torch.Tensor) -> torch.Tensor:
        """Unit ``i``'s shard from disk into ``buf``'s front (waits for the reads)."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        stage = buf[: hi - lo]
        reqs = [self.io.read(self.file, off, stage[a:b]) for off, a, b in self._spans(lo, hi)]
        for r in reqs:
            r.wait()
        return stage

    def values(self, i: int) -> torch.Tensor:
        """Unit ``i``'s shard in a fresh host tensor (for reading: diagnostics)."""
        self.stored[i].wait()
        self._raise()
        return self.read_into(i, torch.empty(self.bounds[i + 1] - self.bounds[i],
                                             dtype=self.dtype))

    # -- the step -----------------------------------------------------------------------
    def wait_all(self) -> None:
        """Every unit's last write is on disk (before the step reads tiles)."""
        self.wait_units(range(len(self.stored)))

    def wait_units(self, units: Iterable[int]) -> None:
        """The last write of each unit of ``units`` is on disk (a final gradient's, once
        its ``store`` was the step's last for the unit): ``stored[i]`` is set only after
        every write request of it has ended; a failed write is raised."""
        for i in units:
            self.stored[i].wait()
        self._raise()

    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self._bufs)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
