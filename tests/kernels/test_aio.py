"""Swap-file I/O (hybrid/kernels/aio.py): the compiled pool (csrc/aio.cpp) and the
Python executor move the same bytes; errors name the file; O_DIRECT is optional.

Sizes are not multiples of 4096 and span several chunks per thread, so every
request has an aligned body (O_DIRECT where the file system allows it) and an
odd tail (buffered), and chunks finish out of order.
"""

from __future__ import annotations

import errno
import os
from dataclasses import replace

import pytest
import torch

from hybrid import kernels
from hybrid.errors import SwapIOError
from hybrid.kernels import aio
from hybrid.kernels.aio import AsyncIO, SwapFile, aligned_empty

NBYTES = 1_234_567  # ~5 chunks over 4 threads, and a tail of 1_234_567 % 4096 bytes


@pytest.fixture(scope="module")
def ext():
    """The compiled pool, built once for the module (cached across runs)."""
    mod = aio.aio_ext()
    if mod is None:
        pytest.skip("hybrid_aio did not load (no compiler, kernels off, or a build error: "
                    "see the logged warning); the Python backend is tested alone")
    return mod


@pytest.fixture(scope="module")
def backends():
    """Every backend that runs here: always "python", "csrc" where it loads."""
    return ["python"] + (["csrc"] if aio.aio_ext() is not None else [])


def _random(nbytes: int, seed: int = 0, aligned: bool = False) -> torch.Tensor:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    if not aligned:
        return data
    buf = aligned_empty(nbytes, torch.uint8)
    return buf.copy_(data)


def _write_file(path, backend, offset, src, direct):
    with SwapFile(path, create=True, direct=direct) as f, AsyncIO(4, backend) as io:
        assert io.backend == backend
        io.write(f, offset, src).wait()
    return path.read_bytes()


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_backends_write_the_same_bytes_and_read_them_back(tmp_path, ext, aligned):
    offset = 8192 if aligned else 4096 + 13
    src = _random(NBYTES, aligned=aligned)
    files = {b: _write_file(tmp_path / b, b, offset, src, direct=True)
             for b in ("csrc", "python")}
    assert files["csrc"] == files["python"]
    assert files["csrc"][offset:] == src.numpy().tobytes()
    assert files["csrc"][:offset] == bytes(offset)  # the hole before the data reads as zeros
    for writer in files:  # each backend reads what the other wrote
        for reader in files:
            dst = aligned_empty(NBYTES, torch.uint8) if aligned else torch.empty(NBYTES,
                                                                               dtype=torch.uint8)
            with SwapFile(tmp_path / writer, direct=True) as f, AsyncIO(4, reader) as io:
                io.read(f, offset, dst).wait()
            assert torch.equal(dst, src), (writer, reader)


def test_any_dtype_round_trips(tmp_path, backends):
    x = torch.randn(3, 1001).to(torch.bfloat16)
    for b in backends:
        y = torch.empty_like(x)
        with SwapFile(tmp_path / b, create=True) as f, AsyncIO(2, b) as io:
            io.write(f, 100, x).wait()
            io.read(f, 100, y).wait()
            empty = io.read(f, 0, torch.empty(0))
            empty.wait()
            empty.wait()  # waiting again gives the same answer
        assert torch.equal(x, y), b


@pytest.mark.parametrize("direct", [False, True])
def test_truncated_file_is_a_short_read_naming_the_file(tmp_path, backends, direct):
    for b in backends:
        path = tmp_path / f"{b}.swap"
        with SwapFile(path, create=True, direct=direct) as f, AsyncIO(4, b) as io:
            io.write(f, 0, _random(NBYTES, aligned=True)).wait()
            os.truncate(path, 600_000)
            req = io.read(f, 4096, aligned_empty(NBYTES, torch.uint8))
            with pytest.raises(SwapIOError) as e:
                req.wait()
        msg = str(e.value)
        assert str(path) in msg and "truncated" in msg and "file ends at byte 600000" in msg
        assert f"read of {NBYTES} bytes at offset 4096" in msg, b


def test_open_errors_name_the_file(tmp_path):
    missing = tmp_path / "no-such-dir" / "x.swap"
    with pytest.raises(SwapIOError, match="No such file") as e:
        SwapFile(missing, create=True)
    assert str(missing) in str(e.value) and e.value.errno == errno.ENOENT
    locked = tmp_path / "read-only"
    locked.mkdir(mode=0o500)
    # root ignores the directory's mode; sysfs refuses new files to everyone
    for target in (str(locked / "x.swap"), "/sys/hybrid-aio-test.swap"):
        try:
            SwapFile(target, create=True).close()
        except SwapIOError as e:
            assert target in str(e) and "cannot open" in str(e) and isinstance(e, OSError)
            break
        os.unlink(target)
    else:
        pytest.skip("no directory here refuses this user's new files")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_write_error_names_path_offset_and_os_error(backends):
    for b in backends:
        with SwapFile("/dev/full") as f, AsyncIO(2, b) as io:
            req = io.write(f, 0, torch.zeros(5000, dtype=torch.uint8))
            with pytest.raises(SwapIOError) as e:
                req.wait()
        assert e.value.errno == errno.ENOSPC
        msg = str(e.value)
        assert "write of 5000 bytes at offset 0 of /dev/full" in msg and "No space left" in msg


def _fs_allows_direct(directory) -> bool:
    probe = os.path.join(directory, f".hybrid-aio-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError as e:
        assert e.errno == errno.EINVAL, e
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs_direct_request_works_either_way(backends):
    """tmpfs refuses O_DIRECT before Linux 6.6 and takes it after: either way the
    file works, and ``direct`` says which."""
    allows = _fs_allows_direct("/dev/shm")
    src = _random(NBYTES, aligned=True)
    for b in backends:
        path = f"/dev/shm/hybrid-aio-test-{os.getpid()}-{b}"
        try:
            with SwapFile(path, create=True, direct=True) as f, AsyncIO(4, b) as io:
                assert f.direct == allows
                io.write(f, 0, src).wait()
                dst = aligned_empty(NBYTES, torch.uint8)
                io.read(f, 0, dst).wait()
            assert torch.equal(src, dst)
        finally:
            os.unlink(path)


def test_einval_on_o_direct_falls_back_to_buffered(tmp_path, backends, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(aio.os, "open", no_direct)
    src = _random(NBYTES, aligned=True)
    for b in backends:
        with SwapFile(tmp_path / b, create=True, direct=True) as f, AsyncIO(4, b) as io:
            assert not f.direct and f.direct_fd == -1
            io.write(f, 4096, src).wait()
            dst = aligned_empty(NBYTES, torch.uint8)
            io.read(f, 4096, dst).wait()
        assert torch.equal(src, dst)


def test_many_concurrent_requests_complete(tmp_path, backends):
    sizes = [1 + 7919 * i % 300_000 for i in range(48)]
    offsets = [sum(sizes[:i]) + 4096 * i for i in range(len(sizes))]
    chunks = [_random(n, seed=i) for i, n in enumerate(sizes)]
    for b in backends:
        with SwapFile(tmp_path / b, create=True, direct=True) as f, AsyncIO(4, b) as io:
            writes = [io.write(f, o, c) for o, c in zip(offsets, chunks)]
            for r in reversed(writes):
                r.wait()
            out = [torch.empty_like(c) for c in chunks]
            reads = [io.read(f, o, d) for o, d in zip(offsets, out)]
            for r in reads:
                r.wait()
        assert all(torch.equal(c, d) for c, d in zip(chunks, out)), b


def test_bad_arguments_and_closed_pool(tmp_path, backends):
    for b in backends:
        with SwapFile(tmp_path / b, create=True) as f:
            io = AsyncIO(2, b)
            with pytest.raises(ValueError, match="contiguous"):
                io.write(f, 0, torch.zeros(4, 4).t())
            with pytest.raises(ValueError, match="offset"):
                io.read(f, -1, torch.zeros(4))
            req = io.write(f, 0, torch.ones(10))
            io.close()
            req.wait()  # queued work finishes on close and still answers
            with pytest.raises(ValueError, match="close"):
                io.write(f, 0, torch.ones(10))
    with pytest.raises(ValueError, match="backend"):
        AsyncIO(backend="uring")


def test_no_kernels_setting_selects_python():
    before = kernels.current()
    kernels.configure(replace(before, no_kernels=True))
    try:
        io = AsyncIO(2)
        assert io.backend == "python"
        io.close()
        with pytest.raises(RuntimeError, match="did not load"):
            AsyncIO(2, backend="csrc")
    finally:
        kernels.configure(before)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float64])
def test_aligned_empty(dtype):
    for numel in (0, 1, 4095, 100_003):
        t = aligned_empty(numel, dtype, pin=True)  # pin without CUDA: ordinary memory
        assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
        assert t.data_ptr() % 4096 == 0 or numel == 0
        if torch.cuda.is_available() and numel:
            assert t.is_pinned()
