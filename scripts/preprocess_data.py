#!/usr/bin/env python
"""Tokenize text or JSONL into a memory-mapped token file pair for --data-path.

    python scripts/preprocess_data.py --input corpus.jsonl --json-keys text \
        --output-prefix data/corpus --workers 2
    python scripts/preprocess_data.py --input book.txt --output-prefix data/book

Writes ``PREFIX.bin`` and ``PREFIX.idx`` (see hybrid/data/indexed.py). Input is
streamed in chunks and tokenized by a pool of ``--workers`` processes, so
memory stays constant on multi-GB files. Documents: one per JSON line (per
``--json-keys`` key, each key to its own ``PREFIX_KEY`` output when there are
several), or one per ``.txt`` file (one per line with ``--line-documents``).
Each document ends with the end-of-document token unless ``--no-append-eod``.
A progress bar goes to stderr; a summary line to stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.data.indexed import IndexedWriter, dtype_for_vocab  # noqa: E402
from hybrid.data.tokenizer import build_tokenizer  # noqa: E402
from hybrid.errors import DataError  # noqa: E402

CHUNK_BYTES = 1 << 20  # text per task: small enough to bound memory, big enough to amortize

_TOKENIZER = None


def _init_worker(tok_args):
    global _TOKENIZER  # one tokenizer per worker process, built once
    _TOKENIZER = build_tokenizer(SimpleNamespace(**tok_args))


def _tokenize(task):
    """task: [(key, text, ends_document)] -> [(key, token array, ends_document)]."""
    return [(k, _TOKENIZER.encode_array(t), end) for k, t, end in task]


def _tasks(paths, keys, line_documents, progress):
    """Chunks of (key, text, ends_document), read lazily."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            task, size = [], 0
            if path.endswith((".jsonl", ".json")):
                for n, line in enumerate(f, 1):
                    progress(len(line.encode("utf-8")))
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"--input {path}: line {n} is not JSON ({e})") from e
                    for k in keys:
                        if k not in obj:
                            raise DataError(f"--input {path}: line {n} has no key {k!r} "
                                            f"(--json-keys)")
                        task.append((k, obj[k], True))
                        size += len(obj[k])
                    if size >= CHUNK_BYTES:
                        yield task
                        task, size = [], 0
            else:
                for line in f:
                    progress(len(line.encode("utf-8")))
                    task.append((keys[0], line, line_documents))
                    size += len(line)
                    if size >= CHUNK_BYTES:
                        yield task
                        task, size = [], 0
                if not line_documents:
                    task.append((keys[0], "", True))  # the file is one document
            if task:
                yield task


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.t0, self.last = time.time(), 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.time()
        if self.enabled and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            frac = min(1.0, self.done / self.total)
            mb_s = self.done / 2**20 / max(now - self.t0, 1e-9)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r[{bar:<30}] {100 * frac:5.1f}%  {mb_s:6.1f} MB/s")
            sys.stderr.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True)
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--json-keys", nargs="+", default=["text"])
    ap.add_argument("--line-documents", action="store_true", help=".txt: one document a line")
    ap.add_argument("--tokenizer-type", default="byte", choices=["byte", "gpt2bpe", "hf"])
    ap.add_argument("--vocab-file")
    ap.add_argument("--merge-file")
    ap.add_argument("--tokenizer-file")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--no-append-eod", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    tok_args = {"tokenizer_type": a.tokenizer_type, "vocab_file": a.vocab_file,
                "merge_file": a.merge_file, "tokenizer_file": a.tokenizer_file}
    try:
        for path in a.input:
            if not os.path.isfile(path):
                raise DataError(f"--input {path}: no such file")
        tok = build_tokenizer(SimpleNamespace(**tok_args))
        keys = a.json_keys
        prefixes = {k: (a.output_prefix if len(keys) == 1 else f"{a.output_prefix}_{k}")
                    for k in keys}
        os.makedirs(os.path.dirname(os.path.abspath(a.output_prefix)), exist_ok=True)
        writers = {k: IndexedWriter(p, dtype_for_vocab(tok.vocab_size))
                   for k, p in prefixes.items()}
        total = sum(os.path.getsize(p) for p in a.input)
        progress = _Progress(total, not a.no_progress and sys.stderr.isatty() or
                             os.environ.get("HYBRID_PROGRESS") == "1")
        t0 = time.time()
        tasks = _tasks(a.input, keys, a.line_documents, progress)
        if a.workers > 1:
            pool = mp.get_context("spawn").Pool(a.workers, _init_worker, (tok_args,))
            results = pool.imap(_tokenize, tasks, chunksize=1)
        else:
            _init_worker(tok_args)
            pool, results = None, map(_tokenize, tasks)
        for chunk in results:
            for k, ids, end in chunk:
                writers[k].add(ids)
                if end:
                    if not a.no_append_eod:
                        writers[k].add([tok.eod])
                    writers[k].end_document()
        if pool is not None:
            pool.close()
            pool.join()
        for w in writers.values():
            w.finalize()
    except DataError as e:
        print(f"\npreprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    dt = max(time.time() - t0, 1e-9)
    if progress.enabled:
        sys.stderr.write("\n")
    docs = sum(w.documents for w in writers.values())
    toks = sum(w.tokens for w in writers.values())
    print(f"{docs} documents, {toks} tokens -> {', '.join(prefixes.values())}.bin/.idx in "
          f"{dt:.1f}s ({total / 2**20 / dt:.1f} MB/s, {toks / dt:.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
