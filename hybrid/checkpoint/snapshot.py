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

    [Note: copied behind the step]
    The step does not wait for the copy. :meth:`take` starts a thread that copies the
    swap file tile by tile, in tile order, and sets itself as the states' write guard
    (:class:`~hybrid.zero.offload.nvme.tiles.TileGuard`): the next step writes tile ``k``
    back only once the copy has passed it, and the checkpoint's writer reads a piece
    only once the copy holds it. A step takes longer than the copy of its tiles only
    when the disk is slower than the step; then the step waits for the tiles it would
    overwrite, never for the whole copy. The copy is opened, then unlinked: a crash leaves
    nothing behind, and its blocks go when the writer is done. Its space is checked
    before it starts: too little free is a CheckpointError naming
    ``--offload-nvme-path`` (the save fails; training can go on, as with any failed save).
    """

    def reserve(self, numel: int) -> None:
        pass  # (nothing in memory; the disk space is checked at each copy)

    def take(self, engine: ZeroEngine, columns: tuple[str, ...], unsaved: Collection[str],
             rows: int) -> list[Iterable[torch.Tensor]]:
        engine.wait_optimizer()
        opt = engine.optimizer
        states = opt.states  # type: ignore[attr-defined]  # (snapshot_for chose this kind)
        if isinstance(states.guard, TileCopy):
            states.guard.wait_for(states.tiles - 1)  # (the last save's copy: done by now)
        states.written()
        src = states.file.path
        size = os.fstat(states.file.fd).st_size
        free = os.statvfs(os.path.dirname(src))
        if free.f_bavail * free.f_frsize < size:
            raise CheckpointError(
                f"--offload-nvme-path {os.path.dirname(os.path.dirname(src))}: "
                f"{free.f_bavail * free.f_frsize} bytes free, the --async-save copy of "
                f"{src} needs {size}: free space there, or save without --async-save")
        copy = TileCopy(src, os.path.join(os.path.dirname(src), SNAPSHOT_FILE),
                        3 * states.tile * 4, states.tiles)
        states.guard = copy
        pieces = [(pc.unit, pc.part) for pc in engine.owned_pieces() if pc.name not in unsaved]
        left = [len(columns)]

        def column(key: str) -> Iterator[torch.Tensor]:
            try:
                for unit, part in pieces:
                    lo, hi = opt.piece_range(unit, part)  # type: ignore[attr-defined]
                    out = torch.empty(hi - lo, dtype=torch.float32)
                    view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
                    for off, a, b in states.spans(key, lo, hi):
                        copy.wait_for((off + (b - a) * 4 - 1) // copy.tile_bytes)
                        if copy.error is not None:
                            raise OSError(copy.error)  # (the save fails, naming it)
                        _read_exactly(copy.fd, view[a * 4: b * 4], off, copy.path)
                    yield out
            finally:
                left[0] -= 1
                if left[0] == 0:
                    copy.close()

        return [column(key) for key in columns]


class TileCopy:
    """``src`` copied to ``path`` tile by tile on a thread, in the kernel
    (``os.copy_file_range``); a :class:`~hybrid.zero.offload.nvme.tiles.TileGuard`.
    ``fd``: the copy, open for reading (its name is gone once it is open)."""

    def __init__(self, src: str, path: str, tile_bytes: int, tiles: int):
        self.path, self.tile_bytes, self.tiles = path, tile_bytes, tiles
        self.done = 0  # tiles copied
        self.error: str | None = None
        self._cond = threading.Condition()
        self._src = os.open(src, os.O_RDONLY)
        try:
            self._dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            self.fd = os.open(path, os.O_RDONLY)
            os.unlink(path)
        except BaseException:
            os.close(self._src)
            raise
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hybrid-save-copy")
        self._thread.start()

    def _run(self) -> None:
        try:
            size = os.fstat(self._src).st_size
            for k in range(self.tiles):
                at, end = k * self.tile_bytes, min(size, (k + 1) * self.tile_bytes)
                while at < end:
                    n = os.copy_file_range(self._src, self._dst, end - at, at, at)
                    if n == 0:
                        raise OSError(f"the swap file ended at byte {at}")
                    at += n
                with self._cond:
                    self.done = k + 1
                    self._cond.notify_all()
        except OSError as e:
            with self._cond:
                self.error = f"copying the nvme tier's states for --async-save failed ({e})"
                self._cond.notify_all()
        finally:
            os.close(self._src)
            os.close(self._dst)

    def wait_for(self, k: int) -> None:
        """Return once tile ``k`` is copied (or the copy failed: the writer reports it)."""
        with self._cond:
            while self.done <= k and self.error is None:
                self._cond.wait()

    def close(self) -> None:
        """After the last read: the copy's blocks go."""
        self._thread.join()
        os.close(self.fd)


def _read_exactly(fd: int, view: memoryview, offset: int, path: str) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise CheckpointError(f"{path}: short read at byte {offset} of the --async-save "
                                  f"copy")
        view, offset = view[n:], offset + n
