"""Megatron's indexed dataset: ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (where they are).

The layout megatron-core's ``IndexedDatasetBuilder`` writes and its
``_IndexReader`` reads (megatron/core/datasets/indexed_dataset.py), little endian::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        dtype code of the tokens in .bin (DTYPES below)
    u64       S, number of sequences
    u64       D, number of document indices (documents + 1)
    i32[S]    sequence_lengths: tokens in each sequence
    i64[S]    sequence_pointers: byte offset of each sequence in .bin
    i64[D]    document_indices: document d is sequences [di[d], di[d + 1]); di[0] = 0,
              di[D - 1] = S
    i8[S]     sequence_modes, in multimodal files only

A sequence is Megatron's "sentence": without ``--split-sentences`` a non-empty
document is one sequence (its end-of-document token included) and an empty
one has none. ``.bin`` is the sequences back to back, so a document is a
contiguous token span and the file reads as a :class:`DocumentSource`.

Reading: :func:`open_indexed` dispatches on the magic (Megatron's, or hybrid's
older ``HYBRIDX``: hybrid/data/hybridx.py). Opening maps the files and checks
what costs O(1) -- header, every size against S and D, the first and last
pointer, the ends of document_indices; :meth:`MegatronIndexed.validate` checks
every entry in vectorized chunks (done once per file and cached, see
hybrid/data/vocab_check.py). Every failure is a DataError naming the file and
the field. ``io`` counts the files opened and the bytes this code reads.

Writing: :class:`IndexedWriter` streams (tokens to .bin, lengths and document
indices to side files; the .idx is assembled at the end in chunks), so memory
stays constant however large the input, and both files appear by rename only
when complete. :func:`write_indexed` copies any source into the format (the
converter from HYBRIDX files).
"""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np

from hybrid.data.sources import DocumentSource, IOCounter, map_tokens
from hybrid.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
          7: "float32", 8: "uint16"}
CODES = {name: code for code, name in DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes
MAX_SEQUENCE_LENGTH = 2**31 - 1  # sequence_lengths are int32
CHUNK = 1 << 22  # entries per vectorized step: bounded temporaries, few Python iterations


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's choice (``DType.optimal_dtype``): uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def open_indexed(prefix: str, io: IOCounter | None = None):
    """The ``.bin/.idx`` pair at ``prefix``, in whichever format its magic says."""
    io = io if io is not None else IOCounter()
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"{path} does not exist (data prefix {prefix})")
    try:
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError as e:
        raise DataError(f"{idx_path}: cannot read ({e})") from e
    io.files_opened.append(idx_path)
    io.bytes_read += len(head)
    if head.startswith(MAGIC):
        return MegatronIndexed(prefix, head, io)
    from hybrid.data.hybridx import MAGIC as OLD_MAGIC, HybridxIndexed
    if head.startswith(OLD_MAGIC):
        return HybridxIndexed(prefix, head, io)
    raise DataError(f"{idx_path}: not a token index (magic {head[:9]!r}; Megatron's is "
                    f"{MAGIC!r}, hybrid's older format {OLD_MAGIC!r})")


class MegatronIndexed(DocumentSource):
    """A Megatron ``.bin/.idx`` pair, memory-mapped, read as it is."""

    def __init__(self, prefix: str, head: bytes, io: IOCounter):
        self.prefix, self.io = prefix, io
        self.idx_path = idx = prefix + ".idx"
        self.bin_path = prefix + ".bin"
        if len(head) < _HEADER.size:
            raise DataError(f"{idx}: truncated header ({len(head)} of {_HEADER.size} bytes)")
        _, version, code, n_seq, n_di = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{idx}: version {version}, expected {VERSION}")
        if code not in DTYPES:
            raise DataError(f"{idx}: dtype code {code} is not one of Megatron's "
                            f"(1..8: {', '.join(DTYPES.values())})")
        self.dtype = np.dtype(DTYPES[code]).newbyteorder("<")
        self.dtype_code, item = code, self.dtype.itemsize
        size = os.path.getsize(idx)
        base = _HEADER.size + 12 * n_seq + 8 * n_di
        if size < base:
            raise DataError(f"{idx}: truncated index: {n_seq} sequences and {n_di} document "
                            f"indices need {base} bytes, the file has {size}")
        if size not in (base, base + n_seq):
            raise DataError(f"{idx}: {size - base} trailing bytes after document_indices "
                            f"(a multimodal index has exactly S = {n_seq} bytes of modes)")
        if n_di < 1:
            raise DataError(f"{idx}: document count 0 (document_indices starts with 0)")
        whole = np.memmap(idx, dtype=np.uint8, mode="r")
        at = _HEADER.size
        self.sequence_lengths = np.frombuffer(whole, "<i4", n_seq, at)
        self.sequence_pointers = np.frombuffer(whole, "<i8", n_seq, at + 4 * n_seq)
        self.document_indices = np.frombuffer(whole, "<i8", n_di, at + 12 * n_seq)
        self.sequence_modes = (np.frombuffer(whole, np.int8, n_seq, base)
                               if size == base + n_seq and n_seq else None)
        self.num_sequences, self.num_documents = n_seq, n_di - 1
        bin_size = os.path.getsize(self.bin_path)
        if bin_size % item:
            raise DataError(f"{self.bin_path}: {bin_size} bytes, not a whole number of "
                            f"{self.dtype.name} tokens (dtype code {code})")
        self._total = bin_size // item
        first, last = self._peek(self.document_indices, 0), self._peek(self.document_indices, -1)
        if first != 0 or last != n_seq:
            raise DataError(f"{idx}: document_indices run from {first} to {last}, expected "
                            f"0 to the sequence count {n_seq}")
        end = 0
        if n_seq:
            if self._peek(self.sequence_pointers, 0) != 0:
                raise DataError(f"{idx}: sequence_pointers[0] = "
                                f"{int(self.sequence_pointers[0])}, expected 0")
            end = (self._peek(self.sequence_pointers, -1)
                   + self._peek(self.sequence_lengths, -1) * item)
        if end != bin_size:
            raise DataError(f"{idx}: does not match {self.bin_path}: the last sequence ends at "
                            f"byte {end}, the file has {bin_size} (truncated or another pair?)")
        self.tokens = map_tokens(self.bin_path, self.dtype, bin_size, io)

    def _peek(self, arr: np.ndarray, i: int) -> int:
        self.io.bytes_read += arr.itemsize
        return int(arr[i])

    def validate(self, chunk: int = CHUNK) -> None:
        """Check every index entry against the spec and the .bin (O(S + D), chunked)."""
        idx, item, expect = self.idx_path, self.dtype.itemsize, 0
        for a in range(0, self.num_sequences, chunk):
            lengths = self.sequence_lengths[a: a + chunk].astype(np.int64)
            pointers = self.sequence_pointers[a: a + chunk]
            self.io.bytes_read += 12 * len(lengths)
            neg = np.flatnonzero(lengths < 0)
            if neg.size:
                i = int(neg[0])
                raise DataError(f"{idx}: sequence_lengths[{a + i}] = {lengths[i]} is negative")
            starts = expect + np.concatenate([[0], np.cumsum(lengths[:-1] * item)])
            bad = np.flatnonzero(pointers != starts)
            if bad.size:
                i, j = int(bad[0]), a + int(bad[0])
                how = ("decreases" if j and pointers[i] < self.sequence_pointers[j - 1] else
                       "does not follow the previous sequence")
                raise DataError(f"{idx}: sequence_pointers[{j}] = {pointers[i]} {how} (expected "
                                f"{starts[i]} = sequence_pointers[{j - 1}] + "
                                f"sequence_lengths[{j - 1}] x {item} bytes)")
            expect = int(starts[-1] + lengths[-1] * item)
        if expect != self._total * item:
            raise DataError(f"{idx}: sequence_lengths sum to {expect // item} tokens, "
                            f"{self.bin_path} holds {self._total}")
        prev = 0
        for a in range(0, self.num_documents + 1, chunk):
            di = self.document_indices[a: a + chunk]
            self.io.bytes_read += 8 * len(di)
            steps = np.diff(di, prepend=prev)
            bad = np.flatnonzero((steps < 0) | (di > self.num_sequences))
            if bad.size:
                i = int(bad[0])
                raise DataError(f"{idx}: document_indices[{a + i}] = {di[i]} is out of order "
                                f"(must not decrease and stay within [0, {self.num_sequences}])")
            prev = int(di[-1])

    def doc_start(self, i):
        s = np.asarray(self.document_indices[np.asarray(i)], dtype=np.int64)
        if self.num_sequences == 0:
            return np.zeros_like(s)
        ptr = self.sequence_pointers[np.minimum(s, self.num_sequences - 1)]
        return np.where(s < self.num_sequences, ptr // self.dtype.itemsize, self._total)

    def first_doc_at_or_after(self, pos):
        # Sequence starts never decrease, so the documents starting at or after pos are
        # those whose first sequence is at or after the first sequence starting there.
        s = np.searchsorted(self.sequence_pointers,
                            np.asarray(pos, dtype=np.int64) * self.dtype.itemsize, side="left")
        return np.searchsorted(self.document_indices, s, side="left")


def sequences_of(doc_lengths: np.ndarray, max_length: int = MAX_SEQUENCE_LENGTH):
    """(sequence lengths, sequences per document) for documents of ``doc_lengths`` tokens:
    one sequence each, none for an empty one, a document longer than ``max_length``
    (the int32 limit) cut into full sequences and a remainder. Vectorized."""
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    per_doc = -(-doc_lengths // max_length)
    seq = np.full(int(per_doc.sum()), max_length, dtype=np.int64)
    has = per_doc > 0
    seq[np.cumsum(per_doc)[has] - 1] = doc_lengths[has] - (per_doc[has] - 1) * max_length
    return seq, per_doc


def write_index(idx_path: str, dtype, n_seq: int, n_docs: int, lengths_chunks,
                doc_index_chunks) -> None:
    """Write a Megatron .idx. ``lengths_chunks()`` iterates the sequence lengths in
    chunks (called twice: lengths, then pointers); ``doc_index_chunks()`` the
    document indices after the leading 0. Memory: one chunk."""
    dtype = np.dtype(dtype)
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODES[dtype.name], n_seq, n_docs + 1))
        for c in lengths_chunks():
            f.write(np.asarray(c, dtype="<i4").tobytes())
        at = 0  # byte offset of the next sequence
        for c in lengths_chunks():
            nbytes = np.asarray(c, dtype=np.int64) * dtype.itemsize
            ends = at + np.cumsum(nbytes)
            f.write((ends - nbytes).astype("<i8").tobytes())
            at = int(ends[-1]) if len(ends) else at
        f.write(np.zeros(1, dtype="<i8").tobytes())
        for c in doc_index_chunks():
            f.write(np.asarray(c, dtype="<i8").tobytes())


def _file_chunks(path: str, dtype, chunk: int = CHUNK):
    def chunks():
        with open(path, "rb") as f:
            while True:
                data = f.read(chunk * np.dtype(dtype).itemsize)
                if not data:
                    return
                yield np.frombuffer(data, dtype=dtype)
    return chunks


class IndexedWriter:
    """Streams documents into ``PREFIX.bin/.idx`` in Megatron's layout, constant memory.

    ``add(tokens)`` appends to the open document, ``end_document()`` closes it:
    its tokens become one sequence (none if it is empty; a document past the
    int32 limit becomes several). ``finalize()`` writes the index and renames
    both files into place; until then only ``*.tmp`` files exist.
    """

    def __init__(self, prefix: str, dtype, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
        self.prefix, self.dtype = prefix, np.dtype(dtype).newbyteorder("<")
        if self.dtype.name not in CODES:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        self.max_sequence_length = max_sequence_length
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._range = (info.min, info.max) if info else None
        self._bin = open(prefix + ".bin.tmp", "wb")  # noqa: SIM115 - held to finalize()
        self._lengths = open(prefix + ".lengths.tmp", "wb")  # noqa: SIM115 - held to finalize()
        self._docs = open(prefix + ".docs.tmp", "wb")  # noqa: SIM115 - held to finalize()
        self.tokens = self.sequences = self.documents = 0
        self.document_tokens = 0  # tokens of the open document
        self._open = 0  # tokens of the open sequence

    def add(self, tokens) -> None:
        """Append tokens to the open document (ids that do not fit the dtype: DataError)."""
        arr = np.asarray(tokens)
        if arr.size and self._range and (arr.min() < self._range[0] or
                                         arr.max() > self._range[1]):
            raise DataError(f"{self.prefix}.bin: token id {int(arr.max())} or "
                            f"{int(arr.min())} does not fit {self.dtype.name}")
        self._bin.write(arr.astype(self.dtype).tobytes())
        n = int(arr.size)
        self.tokens += n
        self.document_tokens += n
        while n:
            room = self.max_sequence_length - self._open
            step = min(n, room)
            self._open += step
            n -= step
            if n:
                self._end_sequence()

    def _end_sequence(self) -> None:
        if self._open:
            self._lengths.write(np.asarray([self._open], dtype="<i4").tobytes())
            self.sequences += 1
            self._open = 0

    def end_document(self) -> None:
        self._end_sequence()
        self.documents += 1
        self.document_tokens = 0
        self._docs.write(np.asarray([self.sequences], dtype="<i8").tobytes())

    def finalize(self) -> None:
        if self.document_tokens:
            raise ValueError("finalize() with an open document: call end_document() first")
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        p = self.prefix
        write_index(p + ".idx.tmp", self.dtype, self.sequences, self.documents,
                    _file_chunks(p + ".lengths.tmp", "<i4"), _file_chunks(p + ".docs.tmp", "<i8"))
        os.remove(p + ".lengths.tmp")
        os.remove(p + ".docs.tmp")
        os.replace(p + ".bin.tmp", p + ".bin")
        os.replace(p + ".idx.tmp", p + ".idx")

    def abort(self) -> None:
        """Close and remove the temporary files (an error stopped the input)."""
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        for suffix in (".bin.tmp", ".lengths.tmp", ".docs.tmp", ".idx.tmp"):
            if os.path.exists(self.prefix + suffix):
                os.remove(self.prefix + suffix)


def write_indexed(source: DocumentSource, prefix: str, dtype=None, chunk: int = CHUNK,
                  max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> None:
    """Copy ``source`` (e.g. an old HYBRIDX pair) into a Megatron pair at ``prefix``:
    the same tokens, one sequence per non-empty document. Streams in chunks of
    ``chunk`` documents / tokens; the files appear by rename when complete."""
    dtype = np.dtype(dtype or source.tokens.dtype).newbyteorder("<")
    n_docs, total = source.num_documents, source.num_tokens
    if dtype == source.tokens.dtype and isinstance(source.tokens, np.memmap) and \
            os.path.isfile(source.prefix + ".bin"):
        shutil.copyfile(source.prefix + ".bin", prefix + ".bin.tmp")  # same bytes: copy whole
    else:
        with open(prefix + ".bin.tmp", "wb") as f:
            for a in range(0, total, chunk):
                f.write(np.asarray(source.tokens[a: a + chunk]).astype(dtype).tobytes())

    def per_doc():  # (sequence lengths, sequences per document) chunk by chunk
        for a in range(0, n_docs, chunk):
            starts = source.doc_start(np.arange(a, min(a + chunk, n_docs) + 1))
            yield sequences_of(np.diff(starts), max_sequence_length)

    n_seq = sum(len(s) for s, _ in per_doc())

    def doc_indices():
        done = 0
        for _, k in per_doc():
            ends = done + np.cumsum(k)
            yield ends
            done = int(ends[-1]) if len(ends) else done

    write_index(prefix + ".idx.tmp", dtype, n_seq, n_docs, lambda: (s for s, _ in per_doc()),
                doc_indices)
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
