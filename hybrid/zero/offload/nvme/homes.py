"""The nvme tier's parameter homes: a partitioned unit's shard in a slot of the rank's
params.swp (:mod:`hybrid.zero.offload.homes` has the overview and the host home).

    tier  home                         load                          store (after the step)
    nvme  its slot in params.swp       read (prefetched), copy       asynchronous write
    (with --offload-gds where GPUDirect Storage works: read straight into device memory)

[Note: prefetching from disk]
The gatherer prefetches one unit ahead (its all-gather overlaps the current
unit's compute); a disk home is asked one unit further, so the read of unit
``i + 2`` runs while unit ``i`` computes and unit ``i + 1`` gathers -- the
ZeRO-Infinity schedule. A prefetched read lands in a host buffer of the
shard's size, so host memory holds at most the shards of the units in
flight, whatever the model size.

[Note: writes and reads of one slot]
The host step writes a unit's new shard while the next step may already want
to read it (a fast forward), and the host step of the step after may rewrite
the buffer the write reads from (the delayed update). So :meth:`DiskHome.store`
returns its request as the unit's upload event -- the host worker waits for
it before it writes that unit's parameters again -- and every read of a slot
first waits for the write to it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hybrid.kernels.aio import ALIGN, AsyncIO, Request, aligned_empty
from hybrid.zero.offload.nvme.gds import GdsReader
from hybrid.zero.offload.nvme.swap import SwapSpace

FILE = "params.swp"


class _Reading(Protocol):
    """A read in flight: an AsyncIO request, or a GDS read (:class:`GdsHome`)."""

    def wait(self) -> None: ...


class _Done:
    """A finished request, as an upload event (``synchronize``)."""

    def __init__(self, request: Request):
        self.request = request

    def synchronize(self) -> None:
        self.request.wait()


class DiskHome:
    """The nvme tier: the shard's values at ``offset`` of the rank's params.swp."""

    def __init__(self, space: SwapSpace, io: AsyncIO, *, offset: int, numel: int,
                 dtype: torch.dtype, pin: bool):
        self.file, self.io, self.offset = space.files[FILE], io, offset
        self.numel, self.dtype, self.pin = numel, dtype, pin
        self._buf: torch.Tensor | None = None  # a prefetched read's destination
        self._read: _Reading | None = None
        self._writes: list = []  # requests writing the slot
        # (buffer, CUDA event): the last load's host buffer, alive until its
        # asynchronous copy to the device has run -- no host sync in the gather
        self._copying: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def _wait_write(self) -> None:
        writes, self._writes = self._writes, []
        for w in writes:
            w.wait()

    def prefetch(self) -> None:
        """Start reading the shard into a host buffer (no-op if one is under way)."""
        if self._read is None:
            self._wait_write()
            if self._copying is not None:  # a unit later: the copy has long run
                self._copying[1].synchronize()
                self._copying = None
            self._buf = aligned_empty(self.numel, self.dtype, self.pin)
            self._read = self.io.read(self.file, self.offset, self._buf)

    def load_into(self, shard: torch.Tensor) -> None:
        self.prefetch()
        read, buf = self._read, self._buf
        assert read is not None and buf is not None  # (the prefetch's)
        read.wait()
        shard.copy_(buf, non_blocking=shard.is_cuda)
        if shard.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(shard.device))
            self._copying = (buf, event)
        self._buf = self._read = None

    def target(self) -> None:
        """No host tensor to write in place: the step writes through :meth:`write_at`."""

    def wait_loaded(self) -> None:
        """(A load reads the file, not a buffer the step writes.)"""

    def write_at(self, start: int, values: torch.Tensor) -> Request:
        """Write ``values`` over shard elements ``[start, start + len)``, asynchronously;
        returns the request (``values`` must stay unchanged until it ends)."""
        if self._read is not None:  # a stale prefetch: let it land, then drop it
            self._read.wait()
            self._buf = self._read = None
        src = values.detach().contiguous()
        if src.device.type != "cpu":  # the shard as first materialized, on the device
            src = aligned_empty(src.numel(), src.dtype).copy_(src)
        req = self.io.write(self.file, self.offset + start * src.element_size(), src)
        self._writes.append(req)
        return req

    def store(self, values: torch.Tensor) -> _Done:
        """Write the new shard (asynchronously); the returned event ends with the write."""
        self._wait_write()
        return _Done(self.write_at(0, values))

    def store_done(self) -> None:
        """Wait for the last write (before the file goes)."""
        self._wait_write()

    def values(self) -> torch.Tensor:
        """The shard as it is now, read into a fresh host buffer after the writes to
        its slot (for reading: diagnostics; a prefetch under way is left alone)."""
        self._wait_write()
        buf = aligned_empty(self.numel, self.dtype, self.pin)
        self.io.read(self.file, self.offset, buf).wait()
        return buf

    def host_bytes(self) -> int:
        bufs = [self._buf, None if self._copying is None else self._copying[0]]
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)

    def device_bytes(self) -> int:
        return 0  # (its reads land in host buffers)


class GdsHome(DiskHome):
    """The nvme tier read with GPUDirect Storage (``--offload-gds``): a prefetch reads
    the slot straight into a device buffer of the shard's size (no host buffer, no
    host-to-device copy); the load copies it into the shard on the device. Writes
    come from the host step, as for :class:`DiskHome`."""

    def __init__(self, space: SwapSpace, io: AsyncIO, reader: GdsReader, *, offset: int,
                 numel: int, dtype: torch.dtype, device: torch.device):
        super().__init__(space, io, offset=offset, numel=numel, dtype=dtype, pin=False)
        self.reader, self.device = reader, device

    def prefetch(self) -> None:
        """Start reading the shard into a device buffer (no-op if one is under way)."""
        if self._read is None:
            self._wait_write()
            self._buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            after = None
            if self._buf.is_cuda:  # the buffer is free once the stream gets here
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.device))
            self._read = self.reader.read(self.offset, self._buf, after)

    def load_into(self, shard: torch.Tensor) -> None:
        self.prefetch()
        read, buf = self._read, self._buf
        assert read is not None and buf is not None  # (the prefetch's)
        read.wait()
        # on the compute stream, where the buffer was allocated: the allocator reuses
        # it only after this copy
        shard.copy_(buf)
        self._buf = self._read = None

    def host_bytes(self) -> int:
        return 0

    def device_bytes(self) -> int:
        """Bytes of the read in flight's device buffer."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()


def disk_slots(numels: list[int], element_size: int) -> tuple[list[int], int]:
    """(byte offset of each shard in params.swp, the file's size): slots aligned to
    4096 bytes, so each read and write is direct I/O."""
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += -(-n * element_size // ALIGN) * ALIGN
    return offsets, pos
