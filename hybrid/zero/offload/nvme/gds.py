"""GPUDirect Storage reads: a file's bytes straight into device memory, no host bounce.

    reason = probe(directory, device)        # None: cuFile works here; else why not
    reader = GdsReader(path, rank, threads=2)
    req = reader.read(offset, dst, after)    # dst: a device tensor; returns at once
    ...
    req.wait()                               # None, or raises SwapIOError
    reader.close()

The stage 3 parameter offload's nvme tier (``--offload-gds``) reads each unit's
shard from ``params.swp`` with it (:class:`hybrid.zero.offload.nvme.homes.GdsHome`);
everything else keeps :mod:`hybrid.kernels.aio`. The cuFile binding is
``torch.cuda.gds.GdsFile``: it needs a CUDA build of torch with cuFile, and
runs in cuFile's compatibility mode (POSIX reads through cuFile's own bounce
buffers) where the nvidia-fs driver is absent.

[Note: never required]
Whether GDS works is decided once, by :func:`probe`: it writes one aligned
block of a known pattern from device memory into a scratch file in the swap
directory and reads it back through cuFile. Any exception, or other bytes, is
the reason returned -- a CPU-only torch, no GPU, no libcufile, a file system
cuFile refuses -- and the caller reads through pinned host buffers instead.
Asking for GDS never fails a run that could train without it.

[Note: reads are not stream-ordered]
``cuFileRead`` moves bytes into device memory when it is called, outside any
CUDA stream. A destination from the caching allocator may be a block just
freed by a tensor whose last kernels are still queued on the compute stream,
so :meth:`GdsReader.read` takes ``after``, a CUDA event recorded on that stream
once the destination was allocated: the reader thread waits for it before it
reads. The main thread never waits on the device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from hybrid.errors import SwapIOError

PROBE_BYTES = 4096
PROBE_FILE = ".gds_probe"


class CuFile(Protocol):
    """An open cuFile handle (``torch.cuda.gds.GdsFile``'s; a test's stand-in). The
    storage is an ``UntypedStorage``; GdsFile annotates it as ``torch.types.Storage``,
    which that does not derive from, hence ``Any``."""

    def save_storage(self, storage: Any, offset: int) -> None: ...

    def load_storage(self, storage: Any, offset: int) -> None: ...


# the binding: ``file_cls(path, flags)`` opens ``path`` (``torch.cuda.gds.GdsFile``)
FileClass = Callable[[str, int], CuFile]


def gds_file_class() -> FileClass | None:
    """``torch.cuda.gds.GdsFile``, or None where this torch has no such module."""
    try:
        from torch.cuda.gds import GdsFile
    except ImportError:
        return None
    return GdsFile


def probe(directory: str, device: torch.device,
          file_cls: FileClass | None = None) -> str | None:
    """Round-trip one block through cuFile in ``directory`` on ``device``: None if the
    bytes come back, else the reason GDS cannot be used (see [Note: never required])."""
    file_cls = file_cls or gds_file_class()
    if file_cls is None:
        return "this torch has no torch.cuda.gds"
    path = os.path.join(directory, PROBE_FILE)
    try:
        pattern = torch.arange(PROBE_BYTES, dtype=torch.int32).remainder(251).to(torch.uint8)
        src, dst = pattern.to(device), torch.zeros(PROBE_BYTES, dtype=torch.uint8,
                                                     device=device)
        if device.type == "cuda":  # cuFile reads src outside the stream its copy is on
            torch.cuda.synchronize(device)
        f = file_cls(path, os.O_CREAT | os.O_RDWR)
        try:
            f.save_storage(src.untyped_storage(), 0)
            f.load_storage(dst.untyped_storage(), 0)
        finally:
            del f  # (GdsFile deregisters and closes in __del__)
        if not torch.equal(dst.cpu(), pattern):
            return "a probe block read back through cuFile differed from what was written"
        return None
    except Exception as e:  # noqa: BLE001 -- any failure means: not here
        return f"{type(e).__name__}: {e}".strip()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


class _Read:
    """One read in flight; ``wait()`` returns None or raises :class:`SwapIOError`."""

    def __init__(self, future: Future[None]):
        self._future = future

    def wait(self) -> None:
        self._future.result()


class GdsReader:
    """Reads of one file into device tensors on ``threads`` threads (see the notes).

    ``rank`` is named in every error, with the file, the offset and the byte count.
    """

    def __init__(self, path: str, rank: int, threads: int = 2,
                 file_cls: FileClass | None = None):
        self.path, self.rank = path, rank
        file_cls = file_cls or gds_file_class()
        self._file: CuFile | None
        try:
            assert file_cls is not None  # (a reader is made where the probe found the binding)
            self._file = file_cls(path, os.O_RDWR)
        except Exception as e:  # noqa: BLE001 -- the binding raises RuntimeError or OSError
            raise SwapIOError(f"rank {rank}: cannot open {path} for GPUDirect Storage: {e}",
                              getattr(e, "errno", None), path) from e
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="hybrid-gds")

    def read(self, offset: int, dst: torch.Tensor,
             after: torch.cuda.Event | None = None) -> _Read:
        """Start filling ``dst`` (contiguous, its whole storage) from ``offset``; ``after``:
        a CUDA event the read must follow (see [Note: reads are not stream-ordered])."""
        storage = dst.untyped_storage()
        nbytes = dst.numel() * dst.element_size()
        assert storage.nbytes() == nbytes and dst.storage_offset() == 0, \
            "a GDS read fills a whole storage"
        return _Read(self._executor.submit(self._load, offset, dst, storage, after))

    def _load(self, offset: int, dst: torch.Tensor, storage: torch.UntypedStorage,
              after: torch.cuda.Event | None) -> None:
        nbytes = storage.nbytes()
        try:
            if after is not None:
                after.synchronize()
            with torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext():
                assert self._file is not None  # (open until close())
                self._file.load_storage(storage, offset)
        except Exception as e:  # noqa: BLE001
            raise SwapIOError(f"rank {self.rank}: GPUDirect read of {nbytes} bytes at offset "
                              f"{offset} of {self.path} failed: {e}",
                              getattr(e, "errno", None), self.path) from e

    def close(self) -> None:
        """Finish the reads in flight, then drop the cuFile handle."""
        self._executor.shutdown(wait=True)
        self._file = None
