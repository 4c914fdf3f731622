"""Asynchronous reads and writes between CPU tensors and files: NVMe offload's swap I/O.

    buf = aligned_empty(n, torch.float32)            # 4096-byte aligned (O_DIRECT)
    with SwapFile(path, create=True, direct=True) as f, AsyncIO(threads=4) as aio:
        req = aio.write(f, 0, buf)                   # returns at once
        ...                                          # compute while the disk works
        req.wait()                                   # None, or raises SwapIOError

Contract:
    ``read(file, offset, dst)`` fills all ``dst.numel() * dst.element_size()``
    bytes of ``dst`` from the file's bytes ``[offset, offset + nbytes)``;
    ``write(file, offset, src)`` stores ``src``'s bytes there. ``dst``/``src``:
    contiguous CPU tensors of any dtype. Until ``wait()`` returns the caller must
    not touch ``dst`` nor change ``src``; the request keeps the tensor alive, so
    dropping the caller's reference is safe.
    ``Request.wait()`` returns None once every byte moved, else raises
    :class:`hybrid.errors.SwapIOError` naming the file, the operation, the offset
    and byte count, and the OS error -- or, for a read that met the end of the
    file, "file ends at byte N (truncated?)". After an error the bytes of ``dst``
    (or of the file range) are unspecified. ``wait()`` may be called again and
    gives the same answer. Wait for every request: with the "csrc" backend an
    unwaited one holds its tensor until the AsyncIO object is freed.
    Requests in flight together are not ordered among themselves: wait for a
    write before reading its range, and do not overlap concurrent writes.

Direct I/O: ``SwapFile(direct=True)`` opens an ``O_DIRECT`` descriptor when the
file system allows it (``file.direct``; where it refuses, EINVAL, the file works
buffered). Direct I/O needs the file offset, the length and the buffer address
aligned to 4096 bytes, so each request is split: its aligned body goes through
the direct descriptor (bypassing the page cache) and whatever is not aligned --
an odd tail, a buffer not from :func:`aligned_empty` -- through the buffered one.
No request fails for its alignment; use aligned buffers and offsets, and lengths
that are multiples of 4096, to keep every byte out of the page cache.

Backends (``AsyncIO.backend``): "csrc", the thread pool of ``csrc/aio.cpp``
(pread/pwrite, GIL released while waiting); "python", a ThreadPoolExecutor
doing ``os.preadv``/``os.pwritev``. Both cut requests into the same chunks (at
most 8 MiB, spread over the threads) and move the same bytes. ``backend="auto"``
takes "csrc" when it builds and kernels are on (``KernelConfig.no_kernels``).
"""

from __future__ import annotations

import ctypes
import errno as errno_codes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from hybrid.errors import SwapIOError
from hybrid.kernels.cpu_ops import cpu_ops

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers
MAX_CHUNK = 8 << 20  # the largest piece one thread moves at a time
MIN_CHUNK = 256 << 10  # smaller pieces cost more in calls than they gain in overlap


def aio_ext():
    """The compiled thread pool (in ``hybrid_cpu_ops``, :mod:`hybrid.kernels.cpu_ops`) or None."""
    return cpu_ops()


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor whose data starts at a 4096-byte boundary.

    ``pin=True`` gives page-locked memory (fast, asynchronous copies to the GPU)
    when CUDA is available, and ordinary memory otherwise: it never requires CUDA.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    pin = pin and torch.cuda.is_available()
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if raw.data_ptr() % ALIGN:  # (pinned blocks start on a page: only pageable ones retry)
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes].view(dtype)


class SwapFile:
    """A file open for reading and writing, through the page cache and, when asked
    and the file system allows it, also with ``O_DIRECT`` (``self.direct``).

    ``path`` is kept for error messages. Opening fails with SwapIOError (missing
    directory, no permission, ...). ``close()`` is idempotent; a SwapFile is its
    own context manager.
    """

    def __init__(self, path: str | os.PathLike, *, create: bool = False, direct: bool = False):
        self.path = os.fspath(path)
        self.fd = self.direct_fd = -1
        self.fd = self._open(os.O_RDWR | (os.O_CREAT if create else 0))
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno_codes.EINVAL:  # EINVAL: this file system has no O_DIRECT
                    self.close()
                    raise SwapIOError(f"cannot open swap file {self.path} with O_DIRECT: "
                                      f"{e.strerror} (errno {e.errno})", e.errno,
                                      self.path) from e
        self.direct = self.direct_fd >= 0

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags, 0o600)
        except OSError as e:
            raise SwapIOError(f"cannot open swap file {self.path}: {e.strerror} "
                              f"(errno {e.errno})", e.errno, self.path) from e

    def size(self) -> int:
        """The file's length in bytes now."""
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapFile({self.path!r}, direct={self.direct})"


def _chunk_bytes(nbytes: int, threads: int) -> int:
    """The piece size for a request of ``nbytes`` (csrc/aio.cpp's rule): a share for
    every thread, at most MAX_CHUNK, at least MIN_CHUNK, a multiple of ALIGN."""
    share = -(-nbytes // threads)
    share = -(-share // ALIGN) * ALIGN
    return max(ALIGN, min(MAX_CHUNK, max(share, MIN_CHUNK)))


def _gather(outcomes) -> tuple[int, int]:
    """``[(start, length, (errno, done))]`` of consecutive pieces -> ``(errno, done)``
    of the whole: the first error, and the prefix that completed."""
    err, done, total = 0, None, 0
    for start, length, (e, got) in outcomes:
        err = err or e
        if got < length and done is None:
            done = start + got
        total = max(total, start + length)
    return err, total if done is None else done


def _py_transfer(write: bool, fd: int, buf: torch.Tensor, lo: int, hi: int,
                 offset: int) -> tuple[int, int]:
    """Move ``buf``'s bytes ``[lo, hi)`` at file ``offset + lo``: ``(errno, done)``.

    ``buf`` (uint8) is an argument so that the executor's work item keeps it alive.
    Short transfers go on; a read of 0 is the end of the file; a write of 0 makes
    no progress and is reported as EIO. (EINTR is retried by Python itself.)
    """
    view = memoryview((ctypes.c_ubyte * (hi - lo)).from_address(buf.data_ptr() + lo)).cast("B")
    done = 0
    while done < hi - lo:
        try:
            if write:
                n = os.pwritev(fd, [view[done:]], offset + lo + done)
            else:
                n = os.preadv(fd, [view[done:]], offset + lo + done)
        except OSError as e:
            return e.errno or errno_codes.EIO, done
        if n == 0:
            return (errno_codes.EIO if write else 0), done
        done += n
    return 0, done


class WaitClock:
    """Seconds spent blocked in :meth:`Request.wait`, summed over the waiting threads."""

    def __init__(self):
        self.s = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.s += seconds


class Request:
    """One read or write in flight; :meth:`wait` for it (module docstring)."""

    def __init__(self, op: str, file: SwapFile, offset: int, nbytes: int, buf: torch.Tensor,
                 parts: list, clock: WaitClock | None = None):
        self.op, self.file, self.offset, self.nbytes = op, file, offset, nbytes
        self._clock = clock
        self._buf: torch.Tensor | None = buf  # alive until waited, whatever the backend holds
        self._parts = parts  # [(start, length, waiter() -> (errno, done))]
        self._outcome: tuple[int, int] | None = None
        # two threads may wait for one request (the host step's worker and the main
        # thread, zero/offload/nvme/homes.py): the first collects the outcome, the other
        # reads it
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Block until every byte moved; raise SwapIOError if some did not. Safe to
        call from several threads, and again."""
        start = time.perf_counter()
        with self._lock:
            if self._outcome is None:
                self._outcome = _gather([(s, n, w()) for s, n, w in self._parts])
                self._parts, self._buf = [], None
        if self._clock is not None:
            self._clock.add(time.perf_counter() - start)
        err, done = self._outcome
        what = f"{self.op} of {self.nbytes} bytes at offset {self.offset} of {self.file.path}"
        if err:
            raise SwapIOError(f"{what} failed after {done} bytes: {os.strerror(err)} "
                              f"(errno {err})", err, self.file.path)
        if done < self.nbytes:
            raise SwapIOError(f"{what} came up short: file ends at byte {self.offset + done} "
                              f"(truncated?)", None, self.file.path)


class AsyncIO:
    """Reads and writes on ``threads`` worker threads (see the module docstring).

    ``backend``: "auto" (the compiled pool when it loads, else Python), "csrc"
    (RuntimeError when it cannot load) or "python"; ``self.backend`` says which
    runs. ``close()`` finishes the queued requests and stops the threads; their
    ``wait()`` still answers afterwards.
    """

    def __init__(self, threads: int = 4, backend: str = "auto"):
        if backend not in ("auto", "csrc", "python"):
            raise ValueError(f"AsyncIO backend must be auto, csrc or python, got {backend!r}")
        if threads < 1:
            raise ValueError(f"AsyncIO needs at least one thread, got {threads}")
        self.threads = threads
        ext = aio_ext() if backend != "python" else None
        if backend == "csrc" and ext is None:
            raise RuntimeError("AsyncIO(backend='csrc'): the hybrid_cpu_ops extension did not load "
                               "(kernels off, or the build failed: see the logged warning)")
        self._pool = ext.Pool(threads, MAX_CHUNK) if ext is not None else None
        self._executor = None if ext is not None else ThreadPoolExecutor(
            threads, thread_name_prefix="hybrid-aio")
        self.backend = "csrc" if ext is not None else "python"
        self._closed = False
        self.waited = WaitClock()  # seconds callers spent blocked in Request.wait

    def read(self, file: SwapFile, offset: int, dst: torch.Tensor) -> Request:
        """Start filling ``dst`` from ``file`` at ``offset``."""
        return self._submit(False, file, offset, dst)

    def write(self, file: SwapFile, offset: int, src: torch.Tensor) -> Request:
        """Start storing ``src`` into ``file`` at ``offset``."""
        return self._submit(True, file, offset, src)

    def _submit(self, write: bool, file: SwapFile, offset: int, t: torch.Tensor) -> Request:
        op = "write" if write else "read"
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"AsyncIO.{op}: the tensor must be contiguous on the CPU, got "
                             f"{t.device} contiguous={t.is_contiguous()}")
        if offset < 0 or file.fd < 0:
            raise ValueError(f"AsyncIO.{op}: offset {offset} of {file!r} (closed or negative)")
        if self._closed:
            raise ValueError(f"AsyncIO.{op} after close()")
        buf = t.detach().reshape(-1).view(torch.uint8)
        nbytes = buf.numel()
        # The aligned body through O_DIRECT, the rest buffered (module docstring).
        body = 0
        if file.direct and offset % ALIGN == 0 and buf.data_ptr() % ALIGN == 0:
            body = nbytes - nbytes % ALIGN
        pieces = [(file.direct_fd, 0, body), (file.fd, body, nbytes - body)]
        parts = [(start, n, self._start(write, fd, buf[start:start + n], offset + start))
                 for fd, start, n in pieces if n > 0]
        return Request(op, file, offset, nbytes, buf, parts, self.waited)

    def _start(self, write: bool, fd: int, buf: torch.Tensor, offset: int):
        """Queue one piece; returns its waiter, ``() -> (errno, done)``."""
        n = buf.numel()
        if self._pool is not None:
            return partial(self._pool.wait,
                           self._pool.submit(write, fd, buf, buf.data_ptr(), n, offset))
        assert self._executor is not None  # the Python backend's threads
        step = _chunk_bytes(n, self.threads)
        futures = [(lo, min(step, n - lo),
                    self._executor.submit(_py_transfer, write, fd, buf, lo, min(n, lo + step),
                                          offset)) for lo in range(0, n, step)]
        return lambda: _gather([(lo, m, f.result()) for lo, m, f in futures])

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
