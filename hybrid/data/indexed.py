"""Memory-mapped token files: ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (document offsets).

``.idx`` layout (little endian)::

    8 bytes   magic b"HYBRIDX\\0"
    u64       version (1)
    u64       dtype code (1: uint16, 2: int32)
    u64       number of documents D
    i64[D+1]  token offsets of document starts in .bin, the last one = total tokens

The writer streams: tokens go straight to disk and offsets to a side file, so
memory stays constant however large the input; both files appear (by rename)
only when complete. The reader checks every field against the files and names
the file in a DataError when something does not fit.
"""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np

from hybrid.errors import DataError

MAGIC = b"HYBRIDX\0"
VERSION = 1
DTYPES = {1: np.uint16, 2: np.int32}
_HEADER = struct.Struct("<8sQQQ")


def dtype_for_vocab(vocab_size: int):
    return np.uint16 if vocab_size < 2**16 else np.int32


class IndexedWriter:
    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self.code = {np.dtype(v): k for k, v in DTYPES.items()}[self.dtype]
        self._bin = open(prefix + ".bin.tmp", "wb")
        self._offsets = open(prefix + ".offsets.tmp", "wb")
        self.tokens = 0
        self.documents = 0
        self._offsets.write(np.asarray([0], dtype=np.int64).tobytes())

    def add(self, tokens) -> None:
        """Append tokens to the current document."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self.tokens += arr.size

    def end_document(self) -> None:
        self.documents += 1
        self._offsets.write(np.asarray([self.tokens], dtype=np.int64).tobytes())

    def finalize(self) -> None:
        self._bin.close()
        self._offsets.close()
        with open(self.prefix + ".idx.tmp", "wb") as idx:
            idx.write(_HEADER.pack(MAGIC, VERSION, self.code, self.documents))
            with open(self.prefix + ".offsets.tmp", "rb") as off:
                shutil.copyfileobj(off, idx, 1 << 20)
        os.remove(self.prefix + ".offsets.tmp")
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")


class IndexedTokens:
    """Read-only view of a ``.bin``/``.idx`` pair (memory-mapped)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"--data-path {prefix}: {path} does not exist")
        size = os.path.getsize(idx_path)
        if size < _HEADER.size:
            raise DataError(f"{idx_path}: truncated index ({size} bytes)")
        with open(idx_path, "rb") as f:
            magic, version, code, docs = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC or version != VERSION or code not in DTYPES:
            raise DataError(f"{idx_path}: not a hybrid token index (magic {magic!r}, "
                            f"version {version}, dtype code {code})")
        if size != _HEADER.size + 8 * (docs + 1):
            raise DataError(f"{idx_path}: corrupt or truncated index ({size} bytes for "
                            f"{docs} documents)")
        self.offsets = np.memmap(idx_path, dtype=np.int64, mode="r", offset=_HEADER.size,
                                 shape=(docs + 1,))
        self.dtype = DTYPES[code]
        total = int(self.offsets[-1]) if docs >= 0 else 0
        expect = total * np.dtype(self.dtype).itemsize
        if os.path.getsize(bin_path) != expect or self.offsets[0] != 0 or \
                (docs > 0 and np.any(np.diff(self.offsets) < 0)):
            raise DataError(f"{idx_path}: does not match {bin_path} ({total} tokens indexed, "
                            f"{os.path.getsize(bin_path)} bytes of tokens)")
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if total else
                       np.zeros(0, dtype=self.dtype))
        self.num_documents = docs

    def __len__(self) -> int:
        return self.num_documents

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]: self.offsets[i + 1]]

    def span(self, first_doc: int, end_doc: int) -> np.ndarray:
        """All tokens of documents ``[first_doc, end_doc)``, contiguous."""
        return self.tokens[self.offsets[first_doc]: self.offsets[end_doc]]
