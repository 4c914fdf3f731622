"""Tokenizers: byte-level (the default: no files), GPT-2 BPE, Hugging Face, Megatron's null.

Every tokenizer has ``vocab_size``, ``eod`` (the end-of-document id), ``encode``
(str -> list[int]), ``encode_array`` and ``decode``. ``build_tokenizer(cfg)``
builds the one a :class:`~hybrid.config.sections.TokenizerConfig` names (from the
``--tokenizer-type`` flags), for training and preprocessing alike; a missing or
unreadable file is a DataError naming its flag.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache

import numpy as np

from hybrid.config.sections import TokenizerConfig
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
    """Megatron's HuggingFaceTokenizer: a tokenizer directory or ``tokenizer.json``.

    Read through the ``tokenizers`` library (no transformers needed); a
    directory without a tokenizer.json (a slow, sentencepiece-only tokenizer)
    goes through ``transformers.AutoTokenizer``. As in Megatron: special tokens
    are added as the tokenizer's post-processor says (e.g. a BOS), the
    vocabulary counts added tokens, and ``eod`` is the EOS token named in
    ``tokenizer_config.json`` (else ``<|endoftext|>``, else the last id).
    """

    def __init__(self, path: str, flag: str = "--tokenizer-model",
                 eod_token: str = "<|endoftext|>"):
        json_path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(path):
            raise DataError(f"{flag} {path}: no such file or directory")
        if path.endswith(".model"):  # (Megatron's Llama2Tokenizer takes the .model file)
            raise DataError(f"{flag} {path}: a SentencePiece model file; hybrid reads the "
                            f"model's Hugging Face tokenizer instead: give its tokenizer.json "
                            f"or the model's directory")
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        eos = _eos_token(folder, flag) or eod_token
        self._auto = None
        if not os.path.isfile(json_path):
            self._auto = _auto_tokenizer(path, flag)
            self.vocab_size = len(self._auto)
            self.eod = self._auto.eos_token_id if self._auto.eos_token_id is not None \
                else self.vocab_size - 1
            return
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise DataError("--tokenizer-type HuggingFaceTokenizer needs the tokenizers "
                            "package (pip install tokenizers)") from e
        try:
            self.tok = Tokenizer.from_file(json_path)
        except Exception as e:  # noqa: BLE001 - the library raises bare Exceptions
            raise DataError(f"{flag} {json_path}: cannot load ({e})") from e
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        eod = self.tok.token_to_id(eos)
        self.eod = eod if eod is not None else self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        if self._auto is not None:
            return list(self._auto(text).input_ids)
        return self.tok.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        return self._auto.decode(ids) if self._auto is not None else self.tok.decode(ids)


def _eos_token(folder: str, flag: str) -> str | None:
    """The EOS token a tokenizer directory names (tokenizer_config.json, special_tokens_map)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{flag} {path}: cannot read ({e})") from e
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def _auto_tokenizer(path: str, flag: str):
    try:
        import transformers
    except ImportError as e:
        raise DataError(f"{flag} {path}: has no tokenizer.json; reading it needs the "
                        f"transformers package") from e
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loader failure, named
        raise DataError(f"{flag} {path}: cannot load ({e})") from e


class NullTokenizer:
    """Megatron's NullTokenizer: text is whitespace-separated integer ids ``0..N-1``
    (``--vocab-size N``); the end-of-document id is ``N``, so the vocabulary is N + 1."""

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise DataError(f"--vocab-size must be >= 1 for NullTokenizer, got {vocab_size}")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        parts = text.split()
        try:
            ids = np.array(parts, dtype=np.int64)
        except (ValueError, OverflowError) as e:
            raise DataError(f"NullTokenizer: the text must be integer token ids ({e})") from e
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise DataError(f"NullTokenizer: token id {ids[bad[0]]} is outside [0, "
                            f"{self.vocab_size}) (--vocab-size {self.eod}, eod {self.eod})")
        return ids

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(cfg: TokenizerConfig):
    """The tokenizer ``cfg`` names, its files read (a missing one is a DataError naming
    its flag)."""
    kind = cfg.type
    if kind == "byte":
        return ByteTokenizer()
    if kind == "GPT2BPETokenizer":
        vocab = _file_of(kind, "--vocab-file", cfg.vocab_file)
        return GPT2BPETokenizer(vocab, _file_of(kind, "--merge-file", cfg.merge_file))
    if kind == "HuggingFaceTokenizer":
        if not cfg.model:
            raise DataError(f"--tokenizer-type {kind} needs --tokenizer-model (a tokenizer "
                            f"directory or tokenizer.json)")
        return HFTokenizer(cfg.model, cfg.model_flag)
    if cfg.vocab_size is None:  # NullTokenizer: TokenizerConfig admits no other type
        raise DataError(f"--tokenizer-type {kind} needs --vocab-size")
    return NullTokenizer(cfg.vocab_size)


def _file_of(kind: str, flag: str, path: str | None) -> str:
    """``path``, the file ``flag`` names for tokenizer ``kind``: given, and a file."""
    if not path:
        raise DataError(f"--tokenizer-type {kind} needs {flag}")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: no such file")
    return path
