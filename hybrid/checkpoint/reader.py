"""RangeReader: the one place a load reads checkpoint bytes, and counts them.

Every byte a load takes from a checkpoint goes through one RangeReader: small
whole files (``metadata.json``, a rank's header) and explicit positional reads
of row ranges of the raw data files (``os.preadv`` straight into the
destination buffer). No memory mapping: page faults cannot be counted, and
the point of this module is that ``files_opened`` and ``bytes_read`` are the
I/O a rank did (``benchmarks/bench_checkpoint.py`` and the tests report them and
cross-check them against ``/proc/self/io``).

A data file is opened at most once per reader, and its size is checked
against the size the metadata implies before the first read: a truncated or
overlong file is a :class:`CheckpointError` naming it, never a short read or
garbage values. Given the checkpoint's :class:`~hybrid.checkpoint.integrity.Integrity`,
the reader also checks every byte it hands out against the saved checksums
(opening a data file reads its header for them); :meth:`RangeReader.finish`
completes the blocks read only in part.

[Note: hashing while reading]
Checking costs about as much CPU as reading from the page cache does (crc32
runs at ~6 GiB/s a core). Both release the GIL, so a read of several chunks
hashes each chunk on a helper thread while the next one is read: on a rank
with a core to spare the check hides behind the read. One chunk at most is in
flight, and a read returns only once all of it was checked.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from hybrid.errors import CheckpointError

CHUNK_BYTES = 8 << 20  # reads at least twice this long hash as they go (see the Note)


class Checksums(Protocol):
    """What a reader asks of a checkpoint's checksums
    (:class:`hybrid.checkpoint.integrity.Integrity`, which imports this package's
    modules: named here by what it does, so imports stay one way)."""

    seconds: float  # spent on headers

    def verifier(self, data_path: str, size: int, reader: Any) -> Any:
        """The checker of ``data_path``'s bytes as they are read (None: unchecked)."""


class RangeReader:
    """Counted reads of checkpoint files (one instance per load; not thread-safe).

    Attributes:
        files_opened: paths in the order they were opened (each data file once).
        bytes_read: bytes read, whole files included.
        bytes_rechecked: of ``bytes_read``, those read only to complete a checksum block
            the load read in part (:meth:`finish`).
    """

    def __init__(self, verify: bool = True):
        """``verify`` False: take the checkpoint's bytes unchecked (only for measuring what
        checking costs: ``benchmarks/bench_checkpoint.py``)."""
        self.verify = verify
        self.files_opened: list[str] = []
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._hasher: ThreadPoolExecutor | None = None  # made by the first long read
        self.integrity: Checksums | None = None  # set by the load once it read the metadata
        self._verifiers: dict = {}  # data path -> Verifier
        self._hashed_s = 0.0  # hashing time of the verifiers finished
        self.bytes_rechecked = 0  # of bytes_read: read again only to complete a checksum block

    def read_whole(self, path: str) -> bytes:
        """All of a small file (metadata, a header). OSError propagates for the caller to name."""
        with open(path, "rb") as f:
            self.files_opened.append(path)
            data = f.read()
        self.bytes_read += len(data)
        return data

    def read_into(self, path: str, size: int, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` from bytes ``[offset, offset + out.nbytes)``
        of ``path``, a file that must be exactly ``size`` bytes long."""
        if out.numel() == 0:
            return
        fd = self._fds.get(path)
        if fd is None:
            fd = self._open(path, size)
        view = out.numpy().data.cast("B")  # the array's buffer, as bytes
        check = self._verifiers.get(path)
        if check is None or len(view) < 2 * CHUNK_BYTES:
            self._pread_into(fd, path, size, offset, view)
            if check is not None:
                check.feed(offset, view)
            return
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc")
        hashing: list[Future] = []  # the chunk being hashed while the next one is read
        for lo in range(0, len(view), CHUNK_BYTES):
            part = view[lo: lo + CHUNK_BYTES]
            self._pread_into(fd, path, size, offset + lo, part)
            for done in hashing:
                done.result()  # (raises its mismatch)
            hashing = [self._hasher.submit(check.feed, offset + lo, part)]
        for done in hashing:
            done.result()

    def _pread_into(self, fd: int, path: str, size: int, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                raise CheckpointError(f"{path}: reading checkpoint shard failed ({e})") from e
            if n <= 0:  # the file shrank under us
                raise CheckpointError(f"{path}: corrupt or truncated checkpoint shard (read "
                                      f"stopped at byte {offset + done} of {size})")
            done += n
        self.bytes_read += done

    def finish(self) -> None:
        """Check the rest of every block read only in part (CheckpointError on a mismatch);
        call once the load read everything it needs, before :meth:`close`."""
        for path, check in self._verifiers.items():
            check.finish(lambda offset, n, p=path: self._pread(p, offset, n))
            self._hashed_s += check.seconds
        self._verifiers.clear()

    def _pread(self, path: str, offset: int, n: int) -> bytes:
        try:
            data = os.pread(self._fds[path], n, offset)
        except OSError as e:
            raise CheckpointError(f"{path}: reading checkpoint shard failed ({e})") from e
        if len(data) != n:
            raise CheckpointError(f"{path}: corrupt or truncated checkpoint shard (read "
                                  f"stopped at byte {offset + len(data)})")
        self.bytes_read += n
        self.bytes_rechecked += n
        return data

    def checksum_seconds(self) -> float:
        """Seconds spent hashing what was read so far (what verifying adds to a load)."""
        headers = self.integrity.seconds if self.integrity is not None else 0.0
        return headers + self._hashed_s + sum(c.seconds for c in self._verifiers.values())

    def _open(self, path: str, size: int) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise CheckpointError(f"{path}: missing checkpoint shard") from e
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open checkpoint shard ({e})") from e
        self.files_opened.append(path)
        self._fds[path] = fd
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CheckpointError(f"{path}: corrupt or truncated checkpoint shard ({actual} "
                                  f"bytes; its piece table says {size})")
        if self.integrity is not None:
            check = self.integrity.verifier(path, size, self)
            if check is not None:
                self._verifiers[path] = check
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._verifiers.clear()
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def stats(self) -> dict:
        return {"files_opened": len(self.files_opened), "bytes_read": self.bytes_read,
                "bytes_rechecked": self.bytes_rechecked}


def process_rchar() -> int | None:
    """Bytes this process has passed through read-type syscalls (Linux ``/proc/self/io``
    ``rchar``), for cross-checking a reader's count; None where unavailable."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
