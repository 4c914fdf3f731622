"""Token sources: documents stored back to back in one flat token array.

Every source the dataset reads -- a Megatron ``.bin/.idx`` pair, an old hybrid
pair, a text file tokenized in memory, the built-in corpus, ``--mock-data`` --
offers the same small interface, so the splits, samples and blends downstream
cannot tell them apart:

* ``tokens``: 1-D integer array (a memmap for files) of every token in order;
* ``num_documents``, ``num_tokens``, ``prefix`` (the name errors use);
* ``doc_start(i)``: token position where document ``i`` starts, vectorized over
  ``i`` in ``[0, num_documents]`` (``doc_start(num_documents) == num_tokens``);
* ``first_doc_at_or_after(pos)``: the first document starting at or after the
  token position ``pos`` (vectorized), ``document_of(pos)``: the document holding
  token ``pos``.

The base class answers them from an ``offsets`` array of ``num_documents + 1``
document starts; formats that store starts differently override the two
methods, each an O(log n) lookup, never a pass over the documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class IOCounter:
    """What a reader did: files opened (data files are memory-mapped, once) and the bytes
    it read on purpose -- headers, the index entries and tokens its checks look at."""

    files_opened: list = field(default_factory=list)
    bytes_read: int = 0


def map_tokens(bin_path: str, dtype, nbytes: int, io: IOCounter) -> np.ndarray:
    """The token file, memory-mapped (numpy cannot map an empty file)."""
    if not nbytes:
        return np.zeros(0, dtype=dtype)
    io.files_opened.append(bin_path)
    return np.memmap(bin_path, dtype=dtype, mode="r")


class DocumentSource:
    """Documents back to back in ``tokens``; ``offsets[i]`` is where document ``i`` starts."""

    tokens: np.ndarray
    offsets: np.ndarray
    num_documents: int
    prefix: str

    def __len__(self) -> int:
        return self.num_documents

    @property
    def num_tokens(self) -> int:
        return int(self.doc_start(self.num_documents))

    def doc_start(self, i):
        return np.asarray(self.offsets[np.asarray(i)], dtype=np.int64)

    def first_doc_at_or_after(self, pos):
        return np.searchsorted(self.offsets, np.asarray(pos), side="left")

    def document_of(self, pos):
        """The document holding token ``pos`` (the last one starting at or before it)."""
        return self.first_doc_at_or_after(np.asarray(pos) + 1) - 1

    def document(self, i: int) -> np.ndarray:
        return self.tokens[int(self.doc_start(i)): int(self.doc_start(i + 1))]

    def span(self, first_doc: int, end_doc: int) -> np.ndarray:
        """All tokens of documents ``[first_doc, end_doc)``, contiguous."""
        return self.tokens[int(self.doc_start(first_doc)): int(self.doc_start(end_doc))]


class InMemoryTokens(DocumentSource):
    """Documents tokenized in memory, each followed by the end-of-document token."""

    def __init__(self, docs, tokenizer, name: str):
        parts = [tokenizer.encode_array(d).astype(np.int64) for d in docs]
        lengths = [len(p) + 1 for p in parts]  # + end of document
        self.tokens = np.empty(sum(lengths), dtype=np.int64)
        self.offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        for p, start in zip(parts, self.offsets[:-1]):
            self.tokens[start: start + len(p)] = p
            self.tokens[start + len(p)] = tokenizer.eod
        self.num_documents = len(parts)
        self.prefix = name


class MockTokens(DocumentSource):
    """``--mock-data``: synthetic documents, a pure function of (seed, vocabulary, size).

    Document lengths are drawn uniformly from ``[1, max_document_length]``; a
    document counts up from a random start modulo ``vocab_size`` and ends with
    ``eod`` (like Megatron's mock dataset, the model can learn it, so a
    benchmark's loss still falls). Built in one vectorized pass, no files.
    """

    def __init__(self, seed: int, vocab_size: int, eod: int, num_tokens: int,
                 max_document_length: int):
        rng = np.random.default_rng([seed, 0x6D6F636B])  # "mock": its own stream
        mean = (max_document_length + 1) / 2
        lengths = rng.integers(1, max_document_length + 1, size=int(1.1 * num_tokens / mean) + 64)
        while lengths.sum() < num_tokens:  # (practically never) draw more
            lengths = np.concatenate([lengths, rng.integers(1, max_document_length + 1,
                                                            size=len(lengths))])
        ends = np.cumsum(lengths)
        n_docs = int(np.searchsorted(ends, num_tokens)) + 1  # enough to cover num_tokens
        lengths, ends = lengths[:n_docs], ends[:n_docs]
        starts = ends - lengths
        first = rng.integers(0, vocab_size, size=n_docs)
        doc = np.repeat(np.arange(n_docs), lengths)
        pos = np.arange(int(ends[-1]), dtype=np.int64) - starts[doc]
        dtype = np.uint16 if vocab_size <= 2**16 else np.int32
        self.tokens = ((first[doc] + pos) % vocab_size).astype(dtype)
        self.tokens[ends - 1] = eod
        self.offsets = np.concatenate([[0], ends]).astype(np.int64)
        self.num_documents = n_docs
        self.prefix = "mock"
