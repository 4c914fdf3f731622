"""Checksums of a checkpoint's files: written while the bytes are in memory, checked as read.

Two links, so that no rank reads more checksums than the files it reads:

* a rank's data file (``rank_N.bin``) is cut into blocks of ``block_bytes``
  (64 KiB), each column block on its own (a block never spans two columns, so
  a weights-only load verifies the master bytes without reading a moment);
  the crc32 of every block goes into the rank's header (``rank_N.pt``,
  ``"checksums"``);
* every header's size and crc32 go into ``metadata.json``
  (``"checksums": {"algorithm", "headers": {"rank_N.pt": [bytes, crc32]}}``),
  O(world) entries whatever the model size;
* so do those of the few small whole files rank 0 writes beside it
  (``"files": {"client_state.pt": [bytes, crc32]}``: an API save's client
  state), read whole and checked by :meth:`Integrity.read_file`.

A load that reads a data file first reads (and checks) that file's header,
then checks every block it touches, hashing the bytes the load read anyway; of
a block read only in part (a reshard's ranges) the rest is read at
:meth:`Verifier.finish`, so the extra I/O is at most two blocks per
contiguous range read, and none when a load reads whole files.

crc32 is zlib's (the standard library's; about 6 GiB/s on this machine's
cores, faster than the disk it guards, so no package is needed). It catches
any change of bytes after the save -- a copy gone wrong, a bit flip, another
value written over -- not an adversary.

A checkpoint written before checksums existed has none: it loads unverified,
with one log line saying so.
"""

from __future__ import annotations

import io
import logging
import os
import time
import zlib

import torch

from hybrid.errors import CheckpointError

ALGORITHM = "crc32"
# [Note: the block size]
# A reader of a file reads its header (~6 bytes of checksum per block) and rounds
# each range it reads out to whole blocks (up to two blocks more per range). 64 KiB
# keeps both small: a header grows ~100 KB per GiB of data (0.01%), and a reshard
# whose ranges interleave finely (a ZeRO shard of each layer: a few hundred KB at
# test sizes) rereads at most 128 KiB per range: benchmarks/bench_checkpoint.py's
# reshard at world 2, 4 and 8 (hidden 256) reads 1.03x, 1.09x and 1.30x the bytes it
# needs, where 1 MiB blocks read 1.40x, 2.81x and 5.29x.
BLOCK_BYTES = 64 << 10

log = logging.getLogger("hybrid")


def crc32(data, crc: int = 0) -> int:
    return zlib.crc32(data, crc) & 0xFFFFFFFF


class BlockSums:
    """The crc32 of each ``block_bytes`` block of each column of a data file, fed its
    bytes in file order (:meth:`column`, then :meth:`update` with that column's bytes).

    ``seconds``: time spent hashing (what the checksums add to a save).
    """

    def __init__(self, block_bytes: int = BLOCK_BYTES):
        self.block_bytes = block_bytes
        self.columns: list[list[int]] = []
        self.nbytes = 0
        self.seconds = 0.0
        self._crc, self._fill = 0, 0

    def column(self) -> None:
        """The bytes that follow start a new column (and so a new block)."""
        self._close_block()
        self.columns.append([])

    def update(self, data: memoryview) -> None:
        t0 = time.perf_counter()
        data = data.cast("B") if data.format != "B" else data
        at = 0
        while at < len(data):
            take = min(len(data) - at, self.block_bytes - self._fill)
            self._crc = crc32(data[at: at + take], self._crc)
            self._fill += take
            at += take
            if self._fill == self.block_bytes:
                self._close_block()
        self.nbytes += len(data)
        self.seconds += time.perf_counter() - t0

    def table(self) -> dict:
        """What the rank's header stores as ``"checksums"``."""
        self._close_block()
        return {"algorithm": ALGORITHM, "block_bytes": self.block_bytes, "bytes": self.nbytes,
                "columns": self.columns}

    def _close_block(self) -> None:
        if self._fill:
            self.columns[-1].append(self._crc)
        self._crc, self._fill = 0, 0


def header_bytes(header: dict) -> bytes:
    """A rank's header serialized (as ``torch.save`` writes it), so its checksum is taken
    from the very bytes written."""
    buf = io.BytesIO()
    torch.save(header, buf)
    return buf.getvalue()


class Verifier:
    """Checks the blocks of one data file that a load reads (see the module notes).

    ``table``: the header's ``"checksums"``; ``size``: the file's size. ``describe``:
    ``describe(lo, hi)`` -> the CheckpointError message for a mismatch in bytes
    ``[lo, hi)``.

    [Note: blocks read in any order]
    A load reads a block's bytes in whatever order its pieces come (another ZeRO
    stage orders its units differently), so each read range is hashed on its own
    and kept as a segment ``(lo, hi, crc)`` of its block; once the segments cover
    the block, their crcs are joined (:func:`crc32_combine`) and compared. At
    :meth:`finish` only the gaps of the blocks read in part are read, so a load
    that reads everything reads nothing twice.
    """

    def __init__(self, path: str, table: dict, size: int, describe):
        self.path, self.describe = path, describe
        self.block = int(table["block_bytes"])
        self.sums: list[list[int]] = table["columns"]
        ncols = max(len(self.sums), 1)
        if table.get("bytes") != size or size % ncols or self.block <= 0:
            raise CheckpointError(describe(0, size))
        self.column_bytes = size // ncols
        self.done: set[tuple[int, int]] = set()
        self.partial: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # sorted segments
        self.seconds = 0.0

    def _bounds(self, c: int, k: int) -> tuple[int, int]:
        lo = c * self.column_bytes + k * self.block
        return lo, min(lo + self.block, (c + 1) * self.column_bytes)

    def feed(self, offset: int, data: memoryview) -> None:
        """Bytes ``[offset, offset + len(data))`` of the file, as read."""
        t0 = time.perf_counter()
        pos, end = offset, offset + len(data)
        while pos < end:
            c = pos // self.column_bytes
            k = (pos - c * self.column_bytes) // self.block
            lo, hi = self._bounds(c, k)
            seg_end = min(end, hi)
            key = (c, k)
            if key in self.done:
                pass
            elif pos == lo and seg_end == hi and key not in self.partial:  # whole: the usual
                self._check(key, crc32(data[lo - offset: hi - offset]))
            else:
                self._add(key, lo, hi, pos, seg_end, lambda a, b: data[a - offset: b - offset])
            pos = seg_end
        self.seconds += time.perf_counter() - t0

    def finish(self, read) -> None:
        """Read and hash the gaps of every block read only in part, then check it;
        ``read(offset, n)`` -> those bytes of the file."""
        for key in sorted(self.partial):
            lo, hi = self._bounds(*key)
            for a, b in _gaps(self.partial[key], lo, hi):
                data = read(a, b - a)
                t0 = time.perf_counter()
                self._add(key, lo, hi, a, b, lambda x, y, d=data, a=a: d[x - a: y - a])
                self.seconds += time.perf_counter() - t0
        self.partial.clear()

    def _add(self, key, lo: int, hi: int, a: int, b: int, view) -> None:
        """Hash what of ``[a, b)`` (within block ``key`` = ``[lo, hi)``) is not hashed yet;
        ``view(x, y)`` gives bytes ``[x, y)``. Checks the block once it is covered."""
        segs = self.partial.setdefault(key, [])
        for x, y in _gaps(segs, a, b):
            segs.append((x, y, crc32(view(x, y))))
        segs.sort()
        if sum(y - x for x, y, _ in segs) == hi - lo:
            crc = segs[0][2]
            for x, y, part in segs[1:]:
                crc = crc32_combine(crc, part, y - x)
            self._check(key, crc)

    def _check(self, key: tuple[int, int], crc: int) -> None:
        c, k = key
        self.partial.pop(key, None)
        sums = self.sums[c] if c < len(self.sums) else []
        if k >= len(sums) or sums[k] != crc:
            raise CheckpointError(self.describe(*self._bounds(c, k)))
        self.done.add(key)


def _gaps(segs, a: int, b: int):
    """The parts of ``[a, b)`` not covered by the sorted, disjoint ``segs``."""
    for x, y, _ in segs:
        if y <= a or x >= b:
            continue
        if x > a:
            yield a, x
        a = max(a, y)
    if a < b:
        yield a, b


# [Note: joining two crc32s]
# crc32(A + B) = crc32(A) * x^(8 len(B)) + crc32(B) over GF(2), modulo the CRC-32
# polynomial, in the bit-reflected order zlib uses (bit 31 is x^0). zlib computes
# this (crc32_combine) but Python's zlib module does not expose it; a join here
# costs about 0.2 ms, and a load makes one per segment boundary, not per byte.
_POLY = 0xEDB88320  # the CRC-32 polynomial, reflected


def _mulmod(a: int, b: int) -> int:
    """a * b modulo the polynomial (both reflected)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X_2K = [1 << 30]  # x^(2^k) for k = 0..31 (x^1 is bit 30)
for _ in range(31):
    _X_2K.append(_mulmod(_X_2K[-1], _X_2K[-1]))


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32 of A + B from crc32(A), crc32(B) and len(B) (see the Note above)."""
    shift, k, n = 1 << 31, 3, len_b  # x^0, then times x^(8 n) = x^(n 2^3)
    while n:
        if n & 1:
            shift = _mulmod(_X_2K[k & 31], shift)
        n >>= 1
        k += 1
    return _mulmod(shift, crc_a) ^ crc_b


class Integrity:
    """The checksums of one checkpoint directory ``ckpt`` (``meta``: its metadata.json),
    for one load. A checkpoint without checksums verifies nothing (``enabled`` False),
    nor does ``check`` False (a benchmark's baseline).

    Headers are read here, through the load's reader (so they are counted), checked,
    parsed and kept: the load's own header read (the RNG states) reuses them.
    ``seconds``: time spent hashing headers.
    """

    def __init__(self, ckpt: str, meta: dict, check: bool = True):
        self.ckpt = ckpt
        table = meta.get("checksums") if check else {}
        self.headers: dict | None = table.get("headers") if isinstance(table, dict) else None
        files = table.get("files") if isinstance(table, dict) else None
        self.files: dict = files if isinstance(files, dict) else {}  # rank 0's small files
        self.iteration = meta.get("iteration")
        if self.headers is None and check:
            log.info("%s: saved before checkpoints carried checksums; loading it unverified",
                     ckpt)
        self._parsed: dict[str, dict] = {}
        self.seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.headers is not None

    def damaged(self, path: str, lo: int, hi: int) -> str:
        """The message of bytes ``[lo, hi)`` of ``path`` not matching their checksum."""
        return damaged_message(self.ckpt, path, f"bytes [{lo}, {hi}) do not match their saved "
                               f"checksum", self.iteration)

    def read_header(self, path: str, reader) -> dict:
        """The header at ``path``, read whole through ``reader``, checked against the
        metadata's checksum and parsed (once per load). CheckpointError naming the file."""
        if path in self._parsed:
            return self._parsed[path]
        data = _read_whole(path, reader, "shard")
        if self.headers is not None:
            t0 = time.perf_counter()
            want = self.headers.get(os.path.basename(path))
            ok = want is not None and [len(data), crc32(data)] == list(want)
            self.seconds += time.perf_counter() - t0
            if want is not None and len(data) != want[0]:
                raise CheckpointError(damaged_message(
                    self.ckpt, path, f"corrupt or truncated checkpoint shard ({len(data)} "
                    f"bytes; {want[0]} when saved)", self.iteration))
            if not ok:
                raise CheckpointError(self.damaged(path, 0, len(data)))
        try:
            header = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - any unreadable header is a corrupt checkpoint
            # (torch's own message goes on to advise weights_only=False: not for a checkpoint
            # that is simply damaged, and unsafe for one of unknown origin)
            raise CheckpointError(f"{path}: corrupt or truncated checkpoint shard (not a "
                                  f"readable header: {type(e).__name__})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt checkpoint shard (not a header)")
        self._parsed[path] = header
        return header

    def read_file(self, path: str, reader) -> bytes:
        """The bytes of ``path``, one of the small whole files listed in the metadata's
        ``checksums["files"]``, read through ``reader`` and checked against its size
        and crc32 (when the checkpoint has checksums). CheckpointError naming the file."""
        data = _read_whole(path, reader, "file")
        if self.headers is None:
            return data
        want = self._file_sum(path)
        t0 = time.perf_counter()
        got = [len(data), crc32(data)]
        self.seconds += time.perf_counter() - t0
        self._compare_file(path, got, want)
        return data

    def check_file(self, path: str) -> None:
        """``path``, one of the whole files listed in ``checksums["files"]``, checked
        against its size and crc32 in 8 MiB reads, so that a large one (a module's
        frozen parameters) is never held in memory to be checked. CheckpointError
        naming the file."""
        if self.headers is None:
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing checkpoint file")
            return
        want = self._file_sum(path)
        crc, size = 0, 0
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    crc, size = crc32(chunk, crc), size + len(chunk)
        except FileNotFoundError as e:
            raise CheckpointError(f"{path}: missing checkpoint file") from e
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read checkpoint file ({e})") from e
        self.seconds += time.perf_counter() - t0
        self._compare_file(path, [size, crc], want)

    def _file_sum(self, path: str) -> list:
        want = self.files.get(os.path.basename(path))
        if not isinstance(want, list) or len(want) != 2:
            meta = os.path.join(self.ckpt, "metadata.json")
            raise CheckpointError(f"{path}: not among the checksums of {meta} (a damaged or "
                                  f"edited metadata.json)")
        return want

    def _compare_file(self, path: str, got: list[int], want: list) -> None:
        if got[0] != want[0]:
            raise CheckpointError(damaged_message(
                self.ckpt, path, f"corrupt or truncated checkpoint file ({got[0]} bytes; "
                f"{want[0]} when saved)", self.iteration))
        if got != list(want):
            raise CheckpointError(self.damaged(path, 0, got[0]))

    def verifier(self, data_path: str, size: int, reader) -> Verifier | None:
        """The Verifier of ``data_path`` (``size`` bytes), from its header (read through
        ``reader``, checked); None when the checkpoint has no checksums."""
        if self.headers is None:
            return None
        head = data_path[: -len(".bin")] + ".pt"
        table = self.read_header(head, reader).get("checksums")
        if not isinstance(table, dict) or table.get("algorithm") != ALGORITHM:
            raise CheckpointError(f"{head}: corrupt checkpoint shard (no {ALGORITHM} "
                                  f"checksums of {os.path.basename(data_path)})")
        if table.get("bytes") != size:
            raise CheckpointError(damaged_message(
                self.ckpt, data_path, f"corrupt or truncated checkpoint shard ({size} bytes; "
                f"{table.get('bytes')} when saved)", self.iteration))
        return Verifier(data_path, table, size, lambda lo, hi: self.damaged(data_path, lo, hi))


def damaged_message(ckpt: str, path: str, what: str, iteration) -> str:
    """``path``: ``what`` is wrong with it, that it changed since the save of ``iteration``,
    and which checkpoint to go back to."""
    prev = previous_complete(ckpt)
    if prev is None:
        back = (f"{os.path.dirname(os.path.abspath(ckpt))} holds no earlier checkpoint to go "
                f"back to")
    else:
        name, it = prev
        back = (f"the previous checkpoint, {name} (iteration {it}), has all its files at "
                f"their saved sizes: resume from it with --ckpt-step {it} (and check its "
                f"bytes first with `python scripts/convert_checkpoint.py verify "
                f"{os.path.join(os.path.dirname(os.path.abspath(ckpt)), name)}`)")
    return (f"{path}: {what} (checkpoint of iteration {iteration}): the file changed after "
            f"it was saved (a bad copy, a disk error, another job writing there); {back}")


def previous_complete(ckpt: str) -> tuple[str, int] | None:
    """(name, iteration) of the newest checkpoint before ``ckpt`` in its directory whose
    metadata reads and whose files are all there at their saved sizes (O(world) stats,
    no byte read); None if there is none. For the message of a damaged file only."""
    from hybrid.checkpoint.files import complete_checkpoints, read_metadata
    from hybrid.checkpoint.layout import SavedLayout
    parent, mine = os.path.split(os.path.abspath(ckpt))
    for name in reversed([n for n in complete_checkpoints(parent) if n < mine]):
        d = os.path.join(parent, name)
        try:
            meta = read_metadata(d)
            layout = SavedLayout(meta, d)
            sums = meta.get("checksums") or {}
            sizes = {**(sums.get("headers") or {}), **(sums.get("files") or {})}
            ok = all(os.path.getsize(os.path.join(d, f)) == want[0]
                     for f, want in sizes.items())
            for rank in range(meta["world_size"]) if ok else ():
                stage, z, t = layout.coords(rank)  # (rank = (stage * dp + z) * tp + t)
                if (os.path.getsize(layout.data_path(t, z, stage))
                        != layout.data_bytes(z, stage, t)):
                    ok = False
                    break
        except (CheckpointError, OSError, KeyError, TypeError, ValueError):
            ok = False
        if ok:
            return name, meta["iteration"]
    return None


def verify_checkpoint(ckpt: str) -> dict:
    """Read every file of checkpoint directory ``ckpt`` whole and check it against its
    checksums (offline: ``scripts/convert_checkpoint.py verify``; one process, one
    file and one 1 MiB chunk at a time). Returns ``{"checkpoint", "iteration",
    "files", "bytes", "seconds", "damaged": [one message per bad file]}``;
    CheckpointError when the metadata itself is unreadable or has no checksums."""
    from hybrid.checkpoint.files import read_metadata
    from hybrid.checkpoint.reader import RangeReader
    t0 = time.perf_counter()
    meta = read_metadata(ckpt)
    checks = Integrity(ckpt, meta)
    if not checks.enabled:
        raise CheckpointError(f"{ckpt}: saved before checkpoints carried checksums; "
                              f"nothing to verify it against")
    files, nbytes = 1, os.path.getsize(os.path.join(ckpt, "metadata.json"))
    damaged: list[str] = []
    for name in sorted(checks.files):  # rank 0's small files (an API save's client state)
        reader = RangeReader()
        try:
            checks.read_file(os.path.join(ckpt, name), reader)
            files += 1
            nbytes += reader.bytes_read
        except CheckpointError as e:
            damaged.append(str(e))
    for head_name in sorted(checks.headers or {}):
        head = os.path.join(ckpt, head_name)
        data_path = head[: -len(".pt")] + ".bin"
        reader = RangeReader()
        try:
            size = os.path.getsize(data_path)
            check = checks.verifier(data_path, size, reader)  # reads and checks the header
            assert check is not None  # (the checkpoint has checksums: checked above)
            with open(data_path, "rb") as f:
                at = 0
                while at < size:
                    chunk = f.read(min(1 << 20, size - at))
                    if not chunk:
                        raise CheckpointError(f"{data_path}: shrank while being verified")
                    check.feed(at, memoryview(chunk))
                    at += len(chunk)
            check.finish(lambda offset, n: b"")  # nothing left: every byte was fed
            files += 2
            nbytes += reader.bytes_read + size
        except FileNotFoundError as e:
            damaged.append(f"{e.filename}: missing checkpoint shard")
        except (CheckpointError, OSError) as e:
            damaged.append(str(e))
    return {"checkpoint": ckpt, "iteration": meta.get("iteration"), "files": files,
            "bytes": nbytes, "seconds": round(time.perf_counter() - t0, 3),
            "damaged": damaged}


def _read_whole(path: str, reader, what: str) -> bytes:
    """``path``'s bytes through ``reader``; a CheckpointError naming the checkpoint
    ``what`` ("shard", "file") when it is missing or unreadable."""
    try:
        return reader.read_whole(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing checkpoint {what}") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint {what} ({e})") from e
