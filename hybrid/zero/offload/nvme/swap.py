"""The nvme tier's scratch space: one directory per rank, locked, checked and preallocated.

    space = SwapSpace.open("/nvme/job", rank=3, sizes={"optimizer.swp": nbytes})
    f = space.files["optimizer.swp"]            # a hybrid.kernels.aio.SwapFile
    ...
    space.close()                                # deletes the files, drops the lock

[Note: swap files are scratch]
A swap file holds the live training state between two steps, never a
checkpoint: it is created empty (truncated) when the engine is built, filled
from the model's initial values or from the checkpoint being loaded, and
deleted at a clean exit. A crash leaves the last checkpoint whole and at most
some stale swap files, which the restart truncates and rebuilds. So no swap
file is ever read before this process wrote it, and one that shrinks or
disappears under a running job is an error (:meth:`SwapSpace.check`).

[Note: failing before the first step]
Everything that can be known about the directory is checked when the engine
is built, before any training: it can be created, no other job holds it (an
``flock`` on ``.lock``, released by the kernel if the process dies, so a crash
never leaves it stuck), and the bytes every file needs are free -- then they
are reserved with ``posix_fallocate``, so a disk that another process fills
later cannot fail a write in the middle of a step.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import fcntl
import os

from hybrid.errors import SwapIOError, SwapSpaceError
from hybrid.kernels.aio import SwapFile


def rank_dir(root: str, rank: int) -> str:
    """Where global rank ``rank`` keeps its swap files under ``--offload-nvme-path``."""
    return os.path.join(root, f"rank{rank:05d}")


class SwapSpace:
    """One rank's swap files, each preallocated to its size (see the module notes).

    ``sizes``: file name -> bytes. ``direct``: open the files with O_DIRECT where
    the filesystem allows it (the page cache would otherwise hold a second copy
    of everything swapped, in the host memory the tier exists to save).
    """

    def __init__(self, root: str, rank: int, sizes: dict[str, int], direct: bool = True):
        self.dir = rank_dir(root, rank)
        self.rank = rank
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise SwapSpaceError(f"cannot create the swap directory {self.dir} "
                                 f"(--offload-nvme-path): {e.strerror}") from e
        self._lock: int | None = _lock(self.dir)  # the locked descriptor, until close
        self.files: dict[str, SwapFile] = {}
        try:
            _check_space(self.dir, sizes)
            for name, nbytes in sizes.items():
                path = os.path.join(self.dir, name)
                _preallocate(path, nbytes, self.dir)
                self.files[name] = SwapFile(path, direct=direct)
        except BaseException:
            self.close()
            raise
        self.sizes = dict(sizes)

    def check(self) -> None:
        """Raise :class:`SwapIOError` naming the file and rank if a swap file was
        deleted or truncated since it was made (one ``fstat`` per file)."""
        for name, f in self.files.items():
            st = os.fstat(f.fd)
            if st.st_nlink == 0:
                raise SwapIOError(f"rank {self.rank}: swap file {f.path} was deleted while "
                                  f"training ran", path=f.path)
            if st.st_size < self.sizes[name]:
                raise SwapIOError(f"rank {self.rank}: swap file {f.path} was truncated to "
                                  f"{st.st_size} bytes (it holds {self.sizes[name]})",
                                  path=f.path)

    def nbytes(self) -> int:
        return sum(self.sizes.values()) if self.files else 0

    def close(self) -> None:
        """Close and delete the files (scratch: see the module notes); release the lock."""
        for f in self.files.values():
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.path)
        self.files = {}
        if self._lock is not None:
            os.close(self._lock)  # (closing the descriptor drops the flock)
            self._lock = None


def _lock(directory: str) -> int:
    path = os.path.join(directory, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise SwapSpaceError(f"the swap directory {directory} is in use by another job "
                             f"({holder}): give each job its own --offload-nvme-path") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
    return fd


def _check_space(directory: str, sizes: dict[str, int]) -> None:
    """All files must fit: free space plus what our own stale files already take."""
    reusable = 0
    for name in sizes:
        with contextlib.suppress(FileNotFoundError):
            reusable += os.stat(os.path.join(directory, name)).st_blocks * 512
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    need = sum(sizes.values())
    if need > free + reusable:
        raise SwapSpaceError(_no_space(directory, need, free + reusable))


def _no_space(directory: str, need: int, free: int) -> str:
    return (f"not enough space for the nvme swap files in {directory}: {need} bytes needed, "
            f"{free} free (point --offload-nvme-path at a larger disk, or offload less)")


def _preallocate(path: str, nbytes: int, directory: str) -> None:
    """Create ``path`` empty, then reserve ``nbytes`` of real blocks (they read as zeros)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno == errno_mod.ENOSPC:
            st = os.statvfs(directory)
            raise SwapSpaceError(_no_space(directory, nbytes, st.f_bavail * st.f_frsize)) from e
        raise SwapSpaceError(f"cannot allocate the swap file {path}: {e.strerror}") from e
    os.close(fd)
