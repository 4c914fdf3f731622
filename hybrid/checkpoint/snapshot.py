"""What an asynchronous save copies while the step waits: this rank's saved values.

    snap = snapshot_for(engine)        # at start: host memory, or the nvme tier's disk
    values = snap.take(engine, columns, unsaved, rows)   # in the step
    ...                                # a thread writes ``values`` into the checkpoint

Two kinds, decided once from where the optimizer keeps its states
(:func:`snapshot_for`), both a :class:`Snapshot`:

* :class:`HostSnapshot`: the states are in memory (on the device or the host); they
  are copied into one host buffer kept from save to save;
* :class:`DiskSnapshot`: the nvme tier's states are in its swap file; the file is
  copied on disk by the kernel (``os.copy_file_range``: no user-space buffer, and a
  shared-extent clone where the file system makes one), and the writer reads the copy
  one piece at a time. Host memory stays what the tier uses.

A snapshot is taken only with no save in flight (:class:`~hybrid.checkpoint.async_save.
AsyncSaver` waits first), so one buffer or one copy is enough.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterable, Iterator
from typing import Protocol

import torch

from hybrid.errors import CheckpointError
from hybrid.zero import ZeroEngine

SNAPSHOT_FILE = "snapshot.swp"  # beside the nvme tier's swap files, unlinked once open


class Snapshot(Protocol):
    def take(self, engine: ZeroEngine, columns: tuple[str, ...], unsaved: Collection[str],
             rows: int) -> list[Iterable[torch.Tensor]]:
        """Per column, the saved pieces' fp32 CPU values in the data file's order
        (``rows`` in all, the pieces named in ``unsaved`` left out), independent of what
        the step does to the engine from now on; each column iterated once."""
        ...

    def reserve(self, numel: int) -> None:
        """Prepare for snapshots of ``numel`` elements (all columns), before the first."""
        ...


def snapshot_for(engine: ZeroEngine) -> Snapshot:
    """A :class:`DiskSnapshot` when ``engine``'s optimizer keeps its states on NVMe,
    else a :class:`HostSnapshot`."""
    states = getattr(engine.optimizer, "states", None)
    if states is not None and hasattr(states, "spans"):
        return DiskSnapshot()
    return HostSnapshot()


class HostSnapshot:
    """Host memory for one save's snapshot of this rank's values, kept from save to save.

    [Note: a snapshot is a copy into memory already touched]
    A snapshot copies every value this rank saves (12 bytes per parameter it owns, with
    the moments) while the step waits. Into fresh memory that copy runs at the speed the
    kernel maps pages (each first touch faults), several times slower than a copy into
    memory mapped already; so the buffer is allocated once, at the first save, and every
    later save copies into the same pages; :meth:`reserve` maps them on a thread while
    training starts, so the first save copies at that speed too. It holds one flat fp32
    block per column, and the snapshot's pieces are views of it, in the data file's order.
    """

    def __init__(self) -> None:
        self.flat = torch.empty(0)
        self._filling: threading.Thread | None = None

    def reserve(self, numel: int) -> None:
        """Allocate and touch ``numel`` elements on a thread of its own (a save waits for it)."""
        def fill() -> None:
            self.flat = torch.zeros(numel)
        self._filling = threading.Thread(target=fill, daemon=True, name="hybrid-save-buffer")
        self._filling.start()

    def take(self, engine: ZeroEngine, columns: tuple[str, ...], unsaved: Collection[str],
             rows: int) -> list[Iterable[torch.Tensor]]:
        """Per column, each saved piece's values (``rows`` in all), copied into the buffer."""
        if self._filling is not None:
            self._filling.join()
            self._filling = None
        if self.flat.numel() < rows * len(columns):
            self.flat = torch.empty(0)  # (the old block goes before the new one is made)
            self.flat = torch.empty(rows * len(columns))
        engine.wait_optimizer()
        opt = engine.optimizer
        out: list[Iterable[torch.Tensor]] = []
        for c, key in enumerate(columns):
            at, pieces = c * rows, []
            for pc in engine.owned_pieces():
                if pc.name in unsaved:
                    continue
                src = opt.read_piece(key, pc.unit, pc.part)
                dst = self.flat[at: at + src.numel()]
                dst.copy_(src.reshape(-1))
                pieces.append(dst)
                at += src.numel()
            out.append(pieces)
        return out


class DiskSnapshot:
    """The nvme tier's swap file, copied on disk at each save (see the module doc).

    The copy is opened, then unlinked: a crash leaves nothing behind, and the file goes
    when the last column is read. Its space is checked before the copy: too little free
    is a CheckpointError naming ``--offload-nvme-path`` (the save fails; training can go
    on, as with any failed save)."""

    def reserve(self, numel: int) -> None:
        pass  # (nothing in memory; the disk space is checked at each copy)

    def take(self, engine: ZeroEngine, columns: tuple[str, ...], unsaved: Collection[str],
             rows: int) -> list[Iterable[torch.Tensor]]:
        engine.wait_optimizer()
        opt = engine.optimizer
        states = opt.states  # type: ignore[attr-defined]  # (snapshot_for chose this kind)
        states.written()
        src = states.file.path
        path = os.path.join(os.path.dirname(src), SNAPSHOT_FILE)
        size = os.fstat(states.file.fd).st_size
        free = os.statvfs(os.path.dirname(src))
        if free.f_bavail * free.f_frsize < size:
            raise CheckpointError(
                f"--offload-nvme-path {os.path.dirname(os.path.dirname(src))}: "
                f"{free.f_bavail * free.f_frsize} bytes free, the --async-save copy of "
                f"{src} needs {size}: free space there, or save without --async-save")
        fd = _copy(src, path, size)
        pieces = [(pc.unit, pc.part) for pc in engine.owned_pieces() if pc.name not in unsaved]
        left = [len(columns)]

        def column(key: str) -> Iterator[torch.Tensor]:
            try:
                for unit, part in pieces:
                    lo, hi = opt.piece_range(unit, part)  # type: ignore[attr-defined]
                    out = torch.empty(hi - lo, dtype=torch.float32)
                    view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
                    for off, a, b in states.spans(key, lo, hi):
                        _read_exactly(fd, view[a * 4: b * 4], off, path)
                    yield out
            finally:
                left[0] -= 1
                if left[0] == 0:
                    os.close(fd)

        return [column(key) for key in columns]


def _copy(src: str, dst: str, size: int) -> int:
    """``src`` copied to a new ``dst`` in the kernel; a read descriptor of the copy, whose
    name is already gone."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        done = 0
        while done < size:
            n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done, done, done)
            if n == 0:
                raise CheckpointError(f"{src}: ended at {done} of {size} bytes while copied "
                                      f"for --async-save")
            done += n
    fd = os.open(dst, os.O_RDONLY)
    os.unlink(dst)
    return fd


def _read_exactly(fd: int, view: memoryview, offset: int, path: str) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise CheckpointError(f"{path}: short read at byte {offset} of the --async-save "
                                  f"copy")
        view, offset = view[n:], offset + n
