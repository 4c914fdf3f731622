"""Parameter all-gathers over DP, asynchronous whatever the unit size, in bounded memory.

    pipe = GatherPipeline(dp_group, bucket)
    job = pipe.start(unit.full, unit.shard)   # returns at once
    ...                                       # compute runs meanwhile
    job.wait()                                # unit.full holds every rank's shard

A unit whose gather fits in a bucket (``dp * S <= bucket`` elements) is one
collective straight into its flat buffer. A larger one runs in pieces (see
:mod:`hybrid.zero.flat_unit`, [Note: pieces keep the temporaries constant]):
piece ``k`` gathers columns ``[k * c, (k + 1) * c)`` of every rank's shard into
a staging buffer of ``dp * c <= bucket`` elements, and is then copied into its
strided place in the unit. There are exactly two staging buffers, allocated
once and reused by every piece of every unit: while one piece's collective
runs, the other's copy-out does. So the temporary memory is two buckets
whatever the model size, and a prefetched large unit overlaps the compute it
was prefetched for instead of being gathered synchronously on demand.

[Note: where the pieces wait]
On a GPU every piece -- collective, wait, copy-out -- is enqueued on a side
stream at :meth:`GatherPipeline.start`, which made the side stream wait for
the compute stream first (the shard may have just been written by the
optimizer, the unit's storage just allocated). A wait on NCCL work only makes
the side stream wait, so the host never blocks; a piece reusing a staging
buffer is ordered after the previous copy-out from it by the side stream
itself. :meth:`_Job.wait` makes the compute stream wait for the unit's last
copy-out, nothing more. On the CPU (gloo) a wait blocks the caller, so
:meth:`start` launches only as many pieces as there are free buffers and the
rest go out as earlier ones are retired, in order, from the next ``wait``.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from hybrid.parallel.comm import CommGroup
from hybrid.zero.flat_unit import FlatUnit, Pending

STAGING_BUFFERS = 2


class _Direct:
    """A gather that fits in a bucket: one collective into the unit's buffer."""

    def __init__(self, work: Pending | None):
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    @property
    def done(self) -> bool:
        return self.work is None


class _Job:
    """One large unit's gather: ``left`` pieces not yet copied into ``grid``."""

    def __init__(self, pipe: GatherPipeline, grid: torch.Tensor, shard: torch.Tensor):
        self.pipe, self.grid, self.shard = pipe, grid, shard
        self.left = 0
        self.event = None  # CUDA: recorded on the side stream after the last copy-out

    def wait(self) -> None:
        self.pipe._finish(self)

    @property
    def done(self) -> bool:
        return self.left == 0


class GatherPipelines:
    """A :class:`GatherPipeline` per group the units gather over, made on first use: DP x
    CP, and for an MoE model's experts over EP, the expert data-parallel group too
    (hybrid/zero/units.py, [Note: expert units]). Each group's gathers keep their order;
    the two groups' are independent collectives."""

    def __init__(self, bucket: int, device: torch.device):
        self.bucket, self.device = bucket, device
        self._by: dict[int, GatherPipeline] = {}

    def start(self, full: torch.Tensor, shard: torch.Tensor,
              dp: CommGroup) -> _Direct | _Job:
        """:meth:`GatherPipeline.start` on ``dp``'s pipeline."""
        pipe = self._by.get(id(dp))
        if pipe is None:
            pipe = self._by[id(dp)] = GatherPipeline(dp, self.bucket, self.device)
        return pipe.start(full, shard)

    def wait_all(self) -> None:
        for pipe in self._by.values():
            pipe.wait_all()

    def in_flight(self) -> int:
        return sum(pipe.in_flight() for pipe in self._by.values())

    def temp_bytes(self) -> int:
        return sum(pipe.temp_bytes() for pipe in self._by.values())


class ShardPublisher:
    """After an optimizer step: each whole unit's new shard all-gathered into its full
    buffer through ``pipe``, so every rank runs the new parameters (stages 1-2, and the
    small units stage 3 keeps whole). ``sharded``: the optimizer is sharded (stages 1-3;
    else every rank updated the whole unit itself). Partitioned units are left alone:
    stage 3 gathers them when a module uses them."""

    def __init__(self, pipe: GatherPipelines, sharded: bool):
        self.pipe, self.sharded = pipe, sharded

    def publish(self, unit: FlatUnit) -> None:
        """Start re-assembling ``unit`` from the DP shards (asynchronously)."""
        if self.sharded and not unit.partition_params:
            self.pipe.start(unit.full, unit.shard, unit.dp)

    def wait(self) -> None:
        """Every gather started so far has completed."""
        self.pipe.wait_all()


class GatherPipeline:
    """All-gathers of unit shards over ``dp``; see the module docstring.

    Args:
        dp: the DP group every gather runs over.
        bucket: largest message, in elements (``--allgather-bucket-size``).
        device: where the units live (a GPU gets a side stream).
    """

    def __init__(self, dp: CommGroup, bucket: int, device: torch.device):
        self.dp, self.bucket = dp, bucket
        self.columns = max(1, bucket // dp.size)  # per piece of a unit larger than a bucket
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._free: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._queued: deque = deque()  # (job, k, w) not launched yet
        self._inflight: deque = deque()  # (job, k, w, work, buffer)
        self._open: list = []  # handles not waited for yet, for wait_all

    # -- public -------------------------------------------------------------------
    def start(self, full: torch.Tensor, shard: torch.Tensor,
              dp: CommGroup | None = None) -> _Direct | _Job:
        """Begin gathering every rank's ``shard`` (S,) into ``full`` (dp * S,),
        rank-major. Returns a handle whose ``wait()`` completes it. ``dp``: the unit's
        group, this pipeline's (None: the same)."""
        assert dp is None or dp is self.dp, (dp, self.dp)  # (GatherPipelines routes)
        n, S = self.dp.size, shard.numel()
        handle: _Direct | _Job
        if n * S <= self.bucket:
            handle = _Direct(self.dp.all_gather(full, shard, async_op=True))
        else:
            handle = job = _Job(self, full.view(n, S), shard)
            for k in range(0, S, self.columns):
                self._queued.append((job, k, min(self.columns, S - k)))
                job.left += 1
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._pump(everything=self.stream is not None)
        self._open = [h for h in self._open if not h.done] + [handle]
        return handle

    def wait_all(self) -> None:
        """Complete every gather started so far."""
        for h in self._open:
            h.wait()
        self._open = []

    def in_flight(self) -> int:
        """Gathers started and not yet complete (stage 3's prefetch of a unit whose
        module has not run yet, say)."""
        return sum(not h.done for h in self._open)

    def temp_bytes(self) -> int:
        """Bytes of the staging buffers (0 until a unit larger than a bucket came)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    # -- pieces ---------------------------------------------------------------------
    def _side(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self.stream) if self.stream is not None else \
            contextlib.nullcontext()

    def _buffer(self, like: torch.Tensor) -> torch.Tensor | None:
        if not self._buffers:
            with self._side():  # used on the side stream only, for the life of the run
                self._buffers = [torch.empty(self.dp.size * self.columns, dtype=like.dtype,
                                             device=like.device)
                                 for _ in range(STAGING_BUFFERS)]
            self._free = list(self._buffers)
        return self._free.pop() if self._free else None

    def _pump(self, everything: bool) -> None:
        """Launch queued pieces into free buffers; with ``everything``, retire the
        oldest in flight whenever none is free (GPU: enqueued waits, no host block)."""
        while self._queued:
            job, k, w = self._queued[0]
            buf = self._buffer(job.grid)
            if buf is None:
                if not everything:
                    return
                self._retire_one()
                continue
            self._queued.popleft()
            with self._side():
                work = self.dp.all_gather(buf[: self.dp.size * w], job.shard[k: k + w],
                                          async_op=True)
            self._inflight.append((job, k, w, work, buf))

    def _retire_one(self) -> None:
        job, k, w, work, buf = self._inflight.popleft()
        with self._side():
            work.wait()
            job.grid[:, k: k + w].copy_(buf[: self.dp.size * w].view(self.dp.size, w))
            job.left -= 1
            if job.left == 0 and self.stream is not None:
                job.event = torch.cuda.Event()
                job.event.record(self.stream)
        self._free.append(buf)

    def _finish(self, job: _Job) -> None:
        while job.left:
            self._pump(everything=False)
            self._retire_one()  # the oldest: this job's, or an earlier one's (FIFO)
        self._pump(everything=False)  # later units' pieces go out meanwhile
        if job.event is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(job.event)
            job.event = None
