"""``--async-save``: a checkpoint written while training goes on.

    saver = AsyncSaver(ps)
    saver.wait()                                    # (the buffer is free: no save in flight)
    saver.start(prepare_save(..., snapshot=saver.buffer))  # the step's values copied to host
    ...                                             # training goes on
    saver.poll()                                    # each iteration: published once all wrote
    saver.wait()                                    # the next save, the end of the run

A save has three phases (:mod:`hybrid.checkpoint.save`). The first runs in the step, as
a synchronous save's does: the collectives that agree on the layout, this rank's header
(its RNG states, step, piece table) and a snapshot of every value it saves, copied into
host memory (the step then changes the engine's freely). The second, the files, runs on
a thread of its own (:meth:`~hybrid.checkpoint.save.PendingSave.write`: no collective,
only the snapshot and the file system). The third is collective again, so it runs in
the training loop's thread, never beside the step's collectives: :meth:`AsyncSaver.poll`
asks the world once an iteration (one all-reduce of one integer, only while a save is in
flight) whether every rank's files are written, and when they are, agrees on any error,
writes metadata.json on rank 0 and publishes ``latest`` -- the same last phase as a
synchronous save's, so a checkpoint is published only whole, with its checksums.

At most one save is in flight: :meth:`AsyncSaver.start` waits for the one before. The
next save, the end of the run (SIGTERM's included) wait for it (:meth:`AsyncSaver.wait`).
An error in the loop stops the thread from being abandoned mid-file
(:meth:`AsyncSaver.abandon` joins it) but publishes nothing: the other ranks may be gone,
and the previous checkpoint stays ``latest``. A rank killed mid-write leaves only the
temporary ``.tmp_iter_...`` directory, which no load takes for a checkpoint.

What a step pays is the snapshot: one copy of this rank's saved fp32 values (master and
moments) from wherever the optimizer keeps them, on the host (``benchmarks/bench_async_save.py``
measures it against the synchronous write).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybrid.checkpoint.save import PendingSave, finish_save
from hybrid.checkpoint.snapshot import HostSnapshot, Snapshot
from hybrid.parallel.state import ParallelState


class AsyncSaver:
    """This rank's save in flight, if any (module doc); every method but :meth:`abandon`
    is collective over the world, called by every rank at the same point of the loop."""

    def __init__(self, ps: ParallelState, buffer: Snapshot | None = None):
        self.ps = ps
        # prepare_save's ``snapshot`` (hybrid/checkpoint/snapshot.py: snapshot_for(engine))
        self.buffer: Snapshot = buffer if buffer is not None else HostSnapshot()
        self._pending: PendingSave | None = None
        self._after: Callable[[str], None] | None = None
        self._thread: threading.Thread | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def start(self, pending: PendingSave, after: Callable[[str], None] | None = None) -> None:
        """Write ``pending`` (prepared with a snapshot, :attr:`buffer`) on a thread; the
        save before it, if still in flight, is waited for first. ``after``: called with
        the checkpoint's directory once it is published (collective, as the publishing
        is: a tag's ``latest``)."""
        self.wait()
        self._pending, self._after = pending, after
        self._thread = threading.Thread(target=pending.write, daemon=True,
                                        name=f"hybrid-save-{pending.name}")
        self._thread.start()

    def poll(self) -> str | None:
        """The checkpoint directory once every rank has written its files and it is
        published (this call publishes it), else None; nothing in flight: None, no
        collective."""
        if self._thread is None:
            return None
        done = torch.tensor([0 if self._thread.is_alive() else 1], dtype=torch.int32,
                            device=self.ps.device)
        self.ps.world_group.all_reduce(done, op=dist.ReduceOp.MIN)
        return self._finish() if int(done.item()) else None

    def wait(self) -> str | None:
        """Wait for the save in flight and publish it (its directory), or None."""
        if self._thread is None:
            return None
        self._thread.join()
        return self._finish()

    def abandon(self) -> None:
        """After an error: let this rank's thread end its files, publish nothing (no
        collective: other ranks may be gone)."""
        if self._thread is not None:
            self._thread.join()
        self._pending = self._thread = self._after = None

    def _finish(self) -> str:
        pending = self._pending
        assert pending is not None and self._thread is not None  # (a save was in flight)
        self._thread.join()
        after, self._after = self._after, None
        self._pending = self._thread = self._after = None
        path = finish_save(pending, self.ps)
        if after is not None:
            after(path)
        return path
