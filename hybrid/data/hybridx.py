"""hybrid's older token index (``HYBRIDX``), read-only: files written before the switch
to Megatron's layout still train, and ``scripts/convert_indexed.py`` rewrites them.

``.idx`` layout (little endian)::

    8 bytes   magic b"HYBRIDX\\0"
    u64       version (1)
    u64       dtype code (1: uint16, 2: int32)
    u64       number of documents D
    i64[D+1]  token offsets of document starts in .bin, the last one = total tokens

Same contract as :class:`hybrid.data.indexed.MegatronIndexed`: O(1) checks at
open, every entry in :meth:`HybridxIndexed.validate`, DataErrors naming the file.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from hybrid.data.sources import DocumentSource, map_tokens
from hybrid.errors import DataError

MAGIC = b"HYBRIDX\0"
VERSION = 1
DTYPES = {1: "<u2", 2: "<i4"}
_HEADER = struct.Struct("<8sQQQ")


class HybridxIndexed(DocumentSource):
    """A HYBRIDX ``.bin/.idx`` pair, memory-mapped (``head``: the .idx's first bytes)."""

    def __init__(self, prefix: str, head: bytes, io):
        self.prefix, self.io = prefix, io
        self.idx_path = idx = prefix + ".idx"
        self.bin_path = prefix + ".bin"
        size = os.path.getsize(idx)
        if len(head) < _HEADER.size:
            raise DataError(f"{idx}: truncated header ({size} bytes)")
        _, version, code, docs = _HEADER.unpack(head[: _HEADER.size])
        if version != VERSION or code not in DTYPES:
            raise DataError(f"{idx}: unknown HYBRIDX version {version} or dtype code {code}")
        if size != _HEADER.size + 8 * (docs + 1):
            raise DataError(f"{idx}: corrupt or truncated index ({size} bytes for {docs} "
                            f"documents)")
        self.offsets = np.memmap(idx, dtype="<i8", mode="r", offset=_HEADER.size,
                                 shape=(docs + 1,))
        self.dtype = np.dtype(DTYPES[code])
        self.num_documents = docs
        io.bytes_read += 16
        first, total = int(self.offsets[0]), int(self.offsets[-1])
        bin_size = os.path.getsize(self.bin_path)
        if first != 0 or bin_size != total * self.dtype.itemsize:
            raise DataError(f"{idx}: does not match {self.bin_path} ({total} tokens indexed, "
                            f"{bin_size} bytes of tokens)")
        self.tokens = map_tokens(self.bin_path, self.dtype, bin_size, io)

    def validate(self, chunk: int = 1 << 22) -> None:
        """Document offsets never decrease (O(D), chunked)."""
        prev = 0
        for a in range(0, self.num_documents + 1, chunk):
            off = self.offsets[a: a + chunk]
            self.io.bytes_read += 8 * len(off)
            bad = np.flatnonzero(np.diff(off, prepend=prev) < 0)
            if bad.size:
                raise DataError(f"{self.idx_path}: document offset {a + int(bad[0])} decreases")
            prev = int(off[-1])
