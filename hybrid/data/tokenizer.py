"""Tokenizers: byte-level (the default: no files), GPT-2 BPE from local files, tokenizer.json.

Every tokenizer has ``vocab_size``, ``eod`` (the end-of-document id), ``encode``
(str -> list[int]) and ``decode``. ``build_tokenizer(cfg)`` picks one from the
``--tokenizer-type`` flags; a missing or unreadable file is a DataError naming it.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache

import numpy as np

from hybrid.errors import DataError


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token 256."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Same ids as :meth:`encode`, as a uint16 array, without a Python list."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (no spaces/controls)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, spaces.
PRETOKENIZE = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")


class GPT2BPETokenizer:
    """Byte-level BPE from a GPT-2 style ``vocab.json`` + ``merges.txt`` (pure Python)."""

    def __init__(self, vocab_file: str, merge_file: str, eod_token: str = "<|endoftext|>"):
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: dict[str, int] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"--vocab-file {vocab_file}: cannot read ({e})") from e
        try:
            with open(merge_file, encoding="utf-8") as f:
                lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
        except OSError as e:
            raise DataError(f"--merge-file {merge_file}: cannot read ({e})") from e
        merges = []
        for ln in lines:
            parts = ln.split(" ")
            if len(parts) != 2:
                raise DataError(f"--merge-file {merge_file}: bad line {ln!r}")
            merges.append(tuple(parts))
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        if eod_token not in self.encoder:
            raise DataError(f"--vocab-file {vocab_file}: has no {eod_token} token")
        self.eod = self.encoder[eod_token]
        self.vocab_size = max(self.encoder.values()) + 1
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 62), i)
                     for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 62:
                break
            parts[i: i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in PRETOKENIZE.findall(text):
            cached = self._cache.get(piece)
            if cached is None:
                word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
                cached = [self.encoder[t] for t in self._bpe(word)]
                if len(self._cache) < 100_000:
                    self._cache[piece] = cached
            ids.extend(cached)
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        text = "".join(self.decoder.get(int(i), "") for i in ids)
        return bytes(self.byte_decoder[c] for c in text if c in self.byte_decoder).decode(
            "utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library (optional dependency)."""

    def __init__(self, path: str, eod_token: str = "<|endoftext|>"):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise DataError("--tokenizer-type hf needs the tokenizers package "
                            "(pip install tokenizers)") from e
        if not os.path.isfile(path):
            raise DataError(f"--tokenizer-file {path}: no such file")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library raises bare Exceptions
            raise DataError(f"--tokenizer-file {path}: cannot load ({e})") from e
        self.vocab_size = self.tok.get_vocab_size()
        eod = self.tok.token_to_id(eod_token)
        self.eod = eod if eod is not None else self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def build_tokenizer(cfg):
    """The tokenizer the flags ask for (``--tokenizer-type byte|gpt2bpe|hf``)."""
    kind = cfg.tokenizer_type
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2bpe":
        for flag, path in (("--vocab-file", cfg.vocab_file), ("--merge-file", cfg.merge_file)):
            if not path or not os.path.isfile(path):
                raise DataError(f"{flag} {path}: no such file")
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind == "hf":
        return HFTokenizer(cfg.tokenizer_file)
    raise DataError(f"--tokenizer-type {kind!r}: unknown")
