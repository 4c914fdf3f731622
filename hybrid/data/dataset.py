"""Token sources -> train/valid/test splits -> shuffled fixed-length samples -> DP micro-batches.

Sources (hybrid/data/sources.py, one interface): Megatron ``.bin/.idx`` pairs
and hybrid's older ones (:func:`hybrid.data.indexed.open_indexed`), text files,
the built-in corpus, ``--mock-data``. ``--data-path`` blends sources and cuts
each into train/valid/test by ``--split``; ``--train/valid/test-data-path``
give each split its own sources, used whole. Every file's token ids are
checked against the vocabulary when it is opened (hybrid/data/vocab_check.py).

A sample is ``seq_length + 1`` consecutive tokens (inputs and shifted labels)
cut from a split's token span without regard to document boundaries;
consecutive windows share one token. Sample ``i`` is window ``perm_e[i mod n]``
of epoch ``e = i // n``; each epoch's permutation comes from the seed alone
(never the layout) and is cached as ``.npy`` next to the data (or in
``--data-cache-path``), so ``consumed_samples`` alone says where a run is.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from hybrid.config.sections import DataConfig
from hybrid.data.blending import BlendedSamples
from hybrid.data.builtin import builtin_documents
from hybrid.data.indexed import open_indexed
from hybrid.data.sources import InMemoryTokens, IOCounter, MockTokens
from hybrid.data.vocab_check import check_sources
from hybrid.errors import DataError

log = logging.getLogger("hybrid")


def split_spans(source, split: str) -> list[tuple[int, int]]:
    """Token ranges [lo, hi) of train/valid/test by the --split proportions.

    Cuts fall on document boundaries when the source has enough documents (so
    no document straddles two splits), else on token positions (one big text).
    """
    w = np.asarray([float(x) for x in split.replace("/", ",").split(",")])
    total = source.num_tokens
    cuts = np.round(np.cumsum(np.concatenate([[0.0], w / w.sum()])) * total).astype(np.int64)
    if source.num_documents >= 100:
        idx = source.first_doc_at_or_after(cuts)
        cuts = source.doc_start(np.minimum(idx, source.num_documents))
    cuts[-1] = total
    return [(int(cuts[i]), int(cuts[i + 1])) for i in range(3)]


class GPTSamples:
    """Shuffled fixed-length windows over a token span, repeating in epochs."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int,
                 cache_dir: str | None = None, cache_key: str = ""):
        self.tokens = tokens
        self.seq_length = seq_length
        self.seed = seed
        self.samples_per_epoch = (len(tokens) - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise DataError(f"the data has {len(tokens)} tokens, fewer than one sample of "
                            f"--seq-length {seq_length} + 1")
        self.cache_dir, self.cache_key = cache_dir, cache_key
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)  # (epoch -1: none)

    def __len__(self) -> int:
        return self.samples_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        path = None
        if self.cache_dir:
            h = hashlib.sha1(f"{self.cache_key}|{self.seq_length}|{self.seed}|{epoch}|"
                             f"{self.samples_per_epoch}".encode()).hexdigest()[:16]
            path = os.path.join(self.cache_dir, f"shuffle_{h}.npy")
            if os.path.isfile(path):
                try:
                    perm = np.load(path, mmap_mode="r")
                    if len(perm) == self.samples_per_epoch:
                        return perm
                except (OSError, ValueError) as e:  # damaged entry: rebuilt below
                    log.warning("sample-order cache %s unreadable (%s); rebuilding it", path, e)
        perm = np.random.default_rng(self.seed + epoch).permutation(self.samples_per_epoch)
        if path:
            try:  # atomic: concurrent ranks may build the same entry at once
                os.makedirs(os.path.dirname(path), exist_ok=True)  # the cache directory
                tmp = f"{path}.{os.getpid()}.tmp.npy"
                np.save(tmp, perm)
                os.replace(tmp, path)
            except OSError as e:  # e.g. a read-only data directory: run uncached
                log.warning("cannot cache the sample order in %s (%s); running uncached "
                            "(--data-cache-path names the directory)", self.cache_dir, e)
        return perm

    def __getitem__(self, i: int) -> np.ndarray:
        return self.window(i, slice(None))

    def window(self, i: int, part: slice) -> np.ndarray:
        """``self[i][part]``, reading only those tokens (a pipeline stage's share)."""
        epoch, j = divmod(int(i), self.samples_per_epoch)
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = self._permutation(epoch), epoch
        start = int(self._perm[j]) * self.seq_length
        lo, hi, step = part.indices(self.seq_length + 1)
        assert step == 1  # (a contiguous part)
        return np.asarray(self.tokens[start + lo: start + max(lo, hi)], dtype=np.int64)


def _parse_data_path(paths, flag: str = "--data-path") -> list[tuple[float, str]]:
    """``[w1] p1 [w2] p2 ...`` -> [(weight, path)] (weights default to equal)."""
    paths = list(paths)

    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False
    if all(is_number(p) for p in paths[0::2]) and len(paths) % 2 == 0 and len(paths) > 1:
        out = [(float(w), p) for w, p in zip(paths[0::2], paths[1::2])]
    elif any(is_number(p) for p in paths):
        raise DataError(f"{flag} {' '.join(paths)}: give either prefixes, or "
                        f"weight prefix pairs")
    else:
        out = [(1.0, p) for p in paths]
    bad = [w for w, _ in out if not 0 < w < math.inf]  # nan and inf parse as floats
    if bad:
        raise DataError(f"{flag} weights must be finite numbers > 0, got {bad[0]:g}")
    return out


MOCK = "<mock>"  # the source name of --mock-data


def _open_source(path: str | None, flag: str, cfg: DataConfig, tokenizer, io: IOCounter):
    if path is None:
        try:
            return InMemoryTokens(builtin_documents(cfg.corpus_cache), tokenizer, "builtin")
        except DataError as e:  # NullTokenizer: text it cannot read as ids
            raise DataError(f"the built-in corpus (no --data-path): {e}") from e
    if path == MOCK:  # enough for 1024 samples, at least 4M tokens; epochs repeat it
        return MockTokens(cfg.seed, tokenizer.vocab_size, tokenizer.eod,
                          max(1 << 22, 1024 * (cfg.seq_length + 1)), cfg.seq_length)
    if os.path.isfile(path + ".idx") or os.path.isfile(path + ".bin"):
        try:
            return open_indexed(path, io)
        except DataError as e:
            raise DataError(f"{flag} {path}: {e}") from e
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return InMemoryTokens([f.read()], tokenizer, path)
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{flag} {path}: cannot read as UTF-8 text ({e})") from e
        except DataError as e:  # NullTokenizer: text it cannot read as ids
            raise DataError(f"{flag} {path}: {e}") from e
    raise DataError(f"{flag} {path}: no such file (nor {path}.bin/.idx)")


def _cache_dir(cfg: DataConfig, path: str | None, src) -> str | None:
    """Where a source's sample orders and token check are cached (None: not at all)."""
    if path == MOCK:
        return None  # --mock-data touches no files
    if cfg.cache_path:
        return cfg.cache_path
    if path is None or not hasattr(src, "validate"):
        return None  # the built-in corpus, a text file: no data directory of their own
    return os.path.dirname(os.path.abspath(path))


def _check_vocabulary(opened: dict, cfg: DataConfig, tokenizer, ps) -> None:
    """Every token id in ``[0, vocab)``: files through the cached, rank-shared check
    (hybrid/data/vocab_check.py), in-memory sources directly."""
    files = [(p, s) for p, s in opened.items() if hasattr(s, "validate")]
    for _, src in files:
        if src.tokens.dtype.kind not in "iu":
            raise DataError(f"{src.idx_path}: holds {src.tokens.dtype.name} values, not token "
                            f"ids (dtype code {getattr(src, 'dtype_code', '?')})")
    t0 = time.perf_counter()
    done = check_sources([s for _, s in files], tokenizer.vocab_size, type(tokenizer).__name__,
                         [_cache_dir(cfg, p, s) for p, s in files], ps)
    scanned = [c for c in done if c is not None and c.scanned]
    if scanned:
        log.info("token ids checked against the vocabulary (%d): %d file(s) scanned in %.1fs, "
                 "cached for later runs", tokenizer.vocab_size, len(scanned),
                 time.perf_counter() - t0)
    for path, src in opened.items():
        if not hasattr(src, "validate") and path not in (None, MOCK) and len(src.tokens):
            top = int(src.tokens.max())
            if top >= tokenizer.vocab_size:
                raise DataError(f"{path}: token id {top} >= vocabulary size "
                                f"{tokenizer.vocab_size} (another tokenizer?)")


def build_datasets(cfg: DataConfig, tokenizer, ps=None) -> dict:
    """{"train", "valid", "test"}: samples objects (``len``, ``[i]``) or None if empty.

    With ``ps`` (a ParallelState; None for one process) every rank opens the
    same files, and the vocabulary check of each file runs on one rank, shared
    over the world group.
    """
    lists: dict[str, Sequence[tuple[float, str | None]]]
    if cfg.train_data_path:
        lists = {name: _parse_data_path(paths, f"--{name}-data-path") if paths else []
                 for name, paths in (("train", cfg.train_data_path),
                                     ("valid", cfg.valid_data_path),
                                     ("test", cfg.test_data_path))}
    else:
        one: Sequence[tuple[float, str | None]] = (
            [(1.0, MOCK)] if cfg.mock_data else [(1.0, None)] if not cfg.data_path
            else _parse_data_path(cfg.data_path))
        lists = {"train": one, "valid": one, "test": one}
    io = IOCounter()
    opened = {}
    for name, entries in lists.items():
        flag = f"--{name}-data-path" if cfg.train_data_path else "--data-path"
        for _, path in entries:
            if path not in opened:
                opened[path] = _open_source(path, flag, cfg, tokenizer, io)
    _check_vocabulary(opened, cfg, tokenizer, ps)
    per_split: dict[str, list] = {"train": [], "valid": [], "test": []}
    for k, (name, entries) in enumerate(lists.items()):
        for weight, path in entries:
            src = opened[path]
            if cfg.train_data_path:  # each split's own files, whole
                lo, hi = 0, src.num_tokens
                if hi - lo < cfg.seq_length + 1:
                    raise DataError(f"--{name}-data-path {path}: {hi} tokens, fewer than one "
                                    f"sample of --seq-length {cfg.seq_length} + 1")
            else:
                lo, hi = split_spans(src, cfg.split)[k]
                if hi - lo < cfg.seq_length + 1:
                    continue
            key = f"{os.path.abspath(path) if path not in (None, MOCK) else path}|{lo}|{hi}"
            per_split[name].append((weight, GPTSamples(src.tokens[lo:hi], cfg.seq_length,
                                                       cfg.seed + k, _cache_dir(cfg, path, src),
                                                       key)))
    log.info("data: %d source(s), %d file(s) opened, %d bytes read to open and check them",
             len(opened), len(io.files_opened), io.bytes_read)
    out: dict[str, GPTSamples | BlendedSamples | None] = {}
    for name, parts in per_split.items():
        if not parts:
            out[name] = None
        elif len(parts) == 1:
            out[name] = parts[0][1]
        else:
            out[name] = BlendedSamples([p for _, p in parts], [w for w, _ in parts])
    if out["train"] is None:
        raise DataError(f"--data-path: the train split has fewer than --seq-length "
                        f"{cfg.seq_length} + 1 tokens (check --split {cfg.split})")
    return out


# What a pipeline stage reads of each sample (``dp_micro_batches``' ``reads``): the
# first stage the inputs, the last the labels (with the loss mask, the input before them
# too: the mask is made of the inputs), a middle stage nothing.
READS = ("all", "tokens", "labels", "none")


def _window(samples, i: int, part: slice) -> np.ndarray:
    """Sample ``i``'s ``part``, read alone where the samples can (``window``)."""
    window = getattr(samples, "window", None)
    return window(i, part) if window is not None else np.asarray(samples[i])[part]


def dp_micro_batches(samples, consumed_samples: int, global_batch_size: int,
                     micro_batch_size: int, dp_rank: int, dp_size: int,
                     device: torch.device, eod: int | None = None,
                     keep: torch.Tensor | None = None, reads: str = "all") -> list[tuple]:
    """This DP rank's micro-batches for the iteration starting at ``consumed_samples``.

    The global batch is samples ``[consumed, consumed + global_batch_size)``;
    DP rank ``r`` takes the ``r``-th contiguous share and cuts it into
    micro-batches of ``(tokens, labels)``, each ``(micro_batch_size, seq_length)``
    int64. TP ranks of one DP rank get identical batches. ``eod`` (``--eod-mask-loss``):
    each micro-batch also carries a float loss mask, 0 where the input token is
    ``eod`` (the prediction across a document boundary does not count), as Megatron.
    ``keep`` (context parallelism): the sequence positions this rank holds, a
    ``(seq_length / cp,)`` int64 tensor on ``device``; tokens, labels and mask are cut to
    them (every CP rank of a DP rank reads the same samples and keeps its share).
    ``reads`` (a pipeline stage's share, :data:`READS`): ``"tokens"`` reads only the
    inputs and leaves labels and mask None, ``"labels"`` leaves the tokens None,
    ``"none"`` reads nothing and gives as many micro-batches of Nones; the samples are
    the same whichever it is.
    """
    if reads not in READS:
        raise ValueError(f"reads={reads!r}: one of {READS}")
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    if reads == "none":  # a middle pipeline stage: no data at all
        return [(None,) * (2 if eod is None else 3)] * (per_rank // micro_batch_size)
    part = {"all": slice(None), "tokens": slice(0, -1),
            "labels": slice(None) if eod is not None else slice(1, None)}[reads]
    if isinstance(samples, BlendedSamples):  # where each row lives: one vectorized lookup
        which, index = samples.locate(first, first + per_rank)
        rows = [_window(samples.datasets[d], k, part)
                for d, k in zip(which.tolist(), index.tolist())]
    elif reads == "all":
        rows = [samples[i] for i in range(first, first + per_rank)]
    else:
        rows = [_window(samples, i, part) for i in range(first, first + per_rank)]
    batch = torch.from_numpy(np.stack(rows))
    if torch.device(device).type == "cuda":  # pinned, non_blocking: the host does not wait
        batch = batch.pin_memory().to(device, non_blocking=True)
    else:
        batch = batch.to(device)
    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    if reads == "tokens":
        tokens, labels = batch, None
    elif reads == "labels" and eod is None:
        tokens, labels = None, batch
    else:
        tokens, labels = batch[:, :-1], batch[:, 1:]
    if keep is not None:
        tokens = None if tokens is None else tokens.index_select(1, keep)
        labels = None if labels is None else labels.index_select(1, keep)
    cut = [(None if tokens is None else tokens[m: m + micro_batch_size],
            None if labels is None else labels[m: m + micro_batch_size])
           for m in range(0, per_rank, micro_batch_size)]
    if eod is None:
        return cut
    out = [(x, y, None if x is None or y is None else (x != eod).float()) for x, y in cut]
    if reads == "labels":  # the inputs were read for the mask only
        return [(None, y, mask) for _, y, mask in out]
    return out
