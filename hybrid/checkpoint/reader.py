"""RangeReader: the one place a load reads checkpoint bytes, and counts them.

Every byte a load takes from a checkpoint goes through one RangeReader: small
whole files (``metadata.json``, a rank's header) and explicit positional reads
of row ranges of the raw data files (``os.preadv`` straight into the
destination buffer). No memory mapping: page faults cannot be counted, and
the point of this module is that ``files_opened`` and ``bytes_read`` are the
I/O a rank did (``scripts/bench_checkpoint.py`` and the tests report them and
cross-check them against ``/proc/self/io``).

A data file is opened at most once per reader, and its size is checked
against the size the metadata implies before the first read: a truncated or
overlong file is a :class:`CheckpointError` naming it, never a short read or
garbage values.
"""

from __future__ import annotations

import os

import torch

from hybrid.errors import CheckpointError


class RangeReader:
    """Counted reads of checkpoint files (one instance per load; not thread-safe).

    Attributes:
        files_opened: paths in the order they were opened (each data file once).
        bytes_read: bytes read, whole files included.
    """

    def __init__(self):
        self.files_opened: list[str] = []
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

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
        view = memoryview(out.numpy()).cast("B")
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
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def stats(self) -> dict:
        return {"files_opened": len(self.files_opened), "bytes_read": self.bytes_read}


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
