"""Token ids outside the tokenizer's vocabulary are a DataError when the data is opened.

Data tokenized with one tokenizer and trained with another (a 1,000-token BPE
under the 257-id byte tokenizer) would otherwise index past the embedding and
train with an infinite loss. The check must stay cheap at terabyte scale:

* A file whose dtype cannot hold an id >= the vocabulary (uint8 under a
  vocabulary above 255, uint16 above 65535) needs no scan at all.
* Otherwise one chunked, vectorized pass over ``.bin`` per file, ever: it keeps
  the running-maximum *records* (each position where the largest id so far
  rises, with that id) and the first negative id. The first id >= V, for any
  vocabulary V, is the first record >= V, so the result answers every later
  run, whatever its tokenizer. It is cached as a small JSON sidecar
  (``tokens_<hash>.json``) next to the sample-order caches, keyed by the size
  and mtime of both files; Megatron's ``.idx`` has no room for it and is left
  as it is. The same first visit runs the full index validation
  (``validate()``), so a cached file skips that too.
* In a job, file ``i`` is checked by rank ``i mod world`` alone and the
  verdicts reach every rank through one all-reduce over the world group
  (:func:`check_sources`), so every rank raises the same error, naming the file,
  the first bad id and its position.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from hybrid.data.indexed import CHUNK
from hybrid.errors import DataError

log = logging.getLogger("hybrid")

RECORD_LIMIT = 4096  # records kept; past them a bad id is located by a scan (error path only)
OK, TOO_LARGE, NEGATIVE, INVALID = 0, 1, 2, 3
_CACHE_VERSION = 1
_MESSAGE_BYTES = 1024  # of a corrupt-index error, sent from the rank that found it


@dataclass
class TokenScan:
    """What one pass over a token file found (``max_id`` None: not scanned)."""

    num_tokens: int
    max_id: int | None = None
    records: list = field(default_factory=list)  # [(position, id)] where the max rises
    complete: bool = True  # records not cut at RECORD_LIMIT
    first_negative: tuple[int, int] | None = None  # (position, id)


def scan_tokens(tokens: np.ndarray, io, chunk: int = CHUNK) -> TokenScan:
    """One chunked pass: running-maximum records and the first negative id."""
    out = TokenScan(num_tokens=len(tokens))
    signed = tokens.dtype.kind == "i"
    for a in range(0, len(tokens), chunk):
        c = np.asarray(tokens[a: a + chunk])
        io.bytes_read += c.nbytes
        top = int(c.max())
        if out.max_id is None or top > out.max_id:  # records only in chunks that raise it
            acc = np.maximum.accumulate(c)
            before = acc[:-1] if out.max_id is None else np.maximum(acc[:-1], out.max_id)
            first = out.max_id is None or int(c[0]) > out.max_id
            rises = np.flatnonzero(np.concatenate([[first], acc[1:] > before]))
            room = RECORD_LIMIT - len(out.records)
            if len(rises) > room:
                out.complete, rises = False, rises[:room]
            out.records += list(zip((a + rises).tolist(), c[rises].tolist()))
            out.max_id = top
        if signed and out.first_negative is None and int(c.min()) < 0:
            j = int(np.argmax(c < 0))
            out.first_negative = (a + j, int(c[j]))
    return out


def first_at_least(tokens: np.ndarray, scan: TokenScan, vocab_size: int, io,
                   chunk: int = CHUNK) -> tuple[int, int] | None:
    """(position, id) of the first id >= ``vocab_size``, or None."""
    if scan.max_id is None or scan.max_id < vocab_size:
        return None
    for pos, tok in scan.records:
        if tok >= vocab_size:
            return pos, tok
    # Records were cut: the first such id lies after the last one kept.
    for a in range(scan.records[-1][0] + 1, len(tokens), chunk):
        c = np.asarray(tokens[a: a + chunk])
        io.bytes_read += c.nbytes
        hit = np.flatnonzero(c >= vocab_size)
        if hit.size:
            return a + int(hit[0]), int(c[hit[0]])
    raise AssertionError("max_id above the vocabulary but no such id found")


def sidecar_path(src, cache_dir: str) -> str:
    h = hashlib.sha1(os.path.abspath(src.prefix).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"tokens_{h}.json")


def _file_key(src) -> dict:
    st = {p: os.stat(p) for p in (src.idx_path, src.bin_path)}
    return {"prefix": os.path.abspath(src.prefix), "version": _CACHE_VERSION,
            "idx": [st[src.idx_path].st_size, st[src.idx_path].st_mtime_ns],
            "bin": [st[src.bin_path].st_size, st[src.bin_path].st_mtime_ns]}


def _load(path: str, key: dict, io) -> TokenScan | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = json.loads(text)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # damaged entry: rebuilt by the caller
        log.warning("token check cache %s unreadable (%s); rescanning", path, e)
        return None
    io.files_opened.append(path)
    io.bytes_read += len(text)
    if data.get("key") != key:
        return None  # the files changed since (or another pair hashed here)
    neg = data.get("first_negative")
    return TokenScan(num_tokens=data["num_tokens"], max_id=data["max_id"],
                     records=[tuple(r) for r in data["records"]], complete=data["complete"],
                     first_negative=(neg[0], neg[1]) if neg else None)


def _store(path: str, key: dict, scan: TokenScan) -> None:
    try:  # atomic: a reader never sees half a file
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": key, "num_tokens": scan.num_tokens, "max_id": scan.max_id,
                       "records": scan.records, "complete": scan.complete,
                       "first_negative": scan.first_negative}, f)
        os.replace(tmp, path)
    except OSError as e:  # e.g. a read-only data directory: checked again next run
        log.warning("cannot cache the token check in %s (%s); checking again next run "
                    "(--data-cache-path names the directory)", os.path.dirname(path), e)


@dataclass
class FileCheck:
    status: int  # OK, TOO_LARGE or NEGATIVE
    position: int = 0
    token: int = 0
    scanned: bool = False  # .bin was read now (not from the cache, and needed)


def check_file(src, vocab_size: int, cache_dir: str | None, chunk: int = CHUNK) -> FileCheck:
    """Validate ``src`` (a memory-mapped pair) and find its first id outside
    ``[0, vocab_size)``, through the sidecar cache in ``cache_dir`` (None: no cache)."""
    dtype = src.tokens.dtype
    needs_scan = not (dtype.kind == "u" and np.iinfo(dtype).max < vocab_size)
    key = _file_key(src)
    path = sidecar_path(src, cache_dir) if cache_dir else None
    scan = _load(path, key, src.io) if path else None
    scanned = False
    if scan is None or (needs_scan and scan.max_id is None and scan.num_tokens):
        src.validate(chunk)
        scan = scan_tokens(src.tokens, src.io, chunk) if needs_scan else \
            TokenScan(num_tokens=len(src.tokens))
        scanned = needs_scan
        if path:
            _store(path, key, scan)
    if scan.first_negative:
        return FileCheck(NEGATIVE, *scan.first_negative, scanned=scanned)
    hit = first_at_least(src.tokens, scan, vocab_size, src.io, chunk)
    if hit:
        return FileCheck(TOO_LARGE, *hit, scanned=scanned)
    return FileCheck(OK, scanned=scanned)


def check_sources(sources: list, vocab_size: int, tokenizer_name: str, cache_dirs: list,
                  ps=None, chunk: int = CHUNK) -> list[FileCheck | None]:
    """Check memory-mapped sources against the vocabulary: file ``i`` on rank
    ``i mod world`` of ``ps`` (every file here without ``ps``), verdicts shared by
    one all-reduce over the world group. Raises the first problem as a DataError
    on every rank; returns this rank's checks (None for files it did not check)."""
    world, rank = (ps.world_size, ps.rank) if ps is not None else (1, 0)
    verdicts = torch.zeros((len(sources), 3), dtype=torch.int64)
    mine: list[FileCheck | None] = [None] * len(sources)
    errors = {}
    for i, src in enumerate(sources):
        if i % world != rank:
            continue
        try:  # no exception may skip the all-reduce below: the other ranks would wait
            check = mine[i] = check_file(src, vocab_size, cache_dirs[i], chunk)
            verdicts[i] = torch.tensor([check.status, check.position, check.token])
        except DataError as e:
            errors[i], verdicts[i, 0] = e, INVALID
        except OSError as e:
            errors[i] = DataError(f"{src.bin_path}: cannot read ({e})")
            verdicts[i, 0] = INVALID
    if world > 1 and sources:
        shared = verdicts.to(ps.device)
        ps.world_group.all_reduce(shared)  # each row comes from exactly one rank
        verdicts = shared.cpu()
    for i, (status, pos, tok) in enumerate(verdicts.tolist()):
        src = sources[i]
        if status == INVALID:
            raise _shared_error(errors.get(i), i % world, ps)
        if status == TOO_LARGE:
            raise DataError(
                f"{src.bin_path}: token id {tok} at position {pos} (document "
                f"{int(src.document_of(pos))}) is >= the vocabulary size {vocab_size} of "
                f"{tokenizer_name}: was it tokenized with another tokenizer? (match "
                f"--tokenizer-type and its files to the ones preprocess_data.py used)")
        if status == NEGATIVE:
            raise DataError(f"{src.bin_path}: negative token id {tok} at position {pos} "
                            f"(document {int(src.document_of(pos))}): corrupt data")
    return mine


def _shared_error(error: DataError | None, owner: int, ps) -> DataError:
    """The owner rank's DataError, its text sent to every rank (one more all-reduce, on
    this error path only), so each rank raises the same message naming the field."""
    if ps is None or ps.world_size == 1:
        assert error is not None  # this rank checked the file
        return error
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.int32)
    if ps.rank == owner:
        raw = str(error).encode("utf-8")[:_MESSAGE_BYTES]
        text[: len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
    shared = text.to(ps.device)
    ps.world_group.all_reduce(shared)
    raw = bytes(v for v in shared.cpu().tolist() if v)
    return error or DataError(raw.decode("utf-8", errors="replace"))
