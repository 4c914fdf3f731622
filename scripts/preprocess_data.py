#!/usr/bin/env python
"""Tokenize JSONL or text into Megatron's indexed dataset (.bin/.idx), for --data-path.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 8 --json-keys text
    # -> data/corpus_text_document.bin/.idx: --data-path data/corpus_text_document

Megatron's command line (tools/preprocess_data.py) and output: one
``<output-prefix>_<key>_document`` pair per ``--json-keys`` key, in
megatron-core's layout (hybrid/data/indexed.py), uint16 tokens below 65500 ids
and int32 above. Each non-empty document is one sequence; ``--append-eod``
ends it with the end-of-document token (Megatron's default is none, and an
empty document gets none). ``--tokenizer-type`` takes Megatron's names
(GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer) and hybrid's (byte,
and gpt2bpe / hf / --tokenizer-file, the older spellings).

hybrid's additions: several ``--input`` files, and text files (one document a
file, a line with ``--line-documents``). Input is streamed in chunks and
tokenized by a pool of ``--workers`` processes, so memory stays constant on
multi-GB files, and the outputs appear (by rename) only when complete. A
progress bar goes to stderr; a summary line to stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.pool import Pool

from hybrid.config.sections import TOKENIZER_TYPES, TokenizerConfig
from hybrid.data.indexed import IndexedWriter, dtype_for_vocab
from hybrid.data.tokenizer import build_tokenizer
from hybrid.errors import DataError

CHUNK_BYTES = 1 << 20  # text per task: small enough to bound memory, big enough to amortize

_TOKENIZER = None


def _init_worker(tok_args):
    global _TOKENIZER  # noqa: PLW0603 - one tokenizer per worker process, built once
    _TOKENIZER = build_tokenizer(TokenizerConfig.from_flags(tok_args))


def _tokenize(task):
    """task: [(key, text, ends_document)] -> [(key, token array, ends_document)]."""
    tok = _TOKENIZER
    assert tok is not None  # (_init_worker ran in this process)
    return [(k, tok.encode_array(t), end) for k, t, end in task]


def _tasks(paths, keys, line_documents, progress):
    """Chunks of (key, text, ends_document), read lazily; DataError naming the file that
    is not UTF-8."""
    for path in paths:
        try:
            yield from _file_tasks(path, keys, line_documents, progress)
        except UnicodeDecodeError as e:
            raise DataError(f"--input {path}: cannot read as UTF-8 text ({e})") from e


def _file_tasks(path, keys, line_documents, progress):
    """One --input file of :func:`_tasks`."""
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
                    if not isinstance(obj.get(k), str):
                        raise DataError(f"--input {path}: line {n} has no text under key "
                                        f"{k!r} (--json-keys)")
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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help=".jsonl/.json (one document a "
                   "line) or text files (one document a file)")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON line, one output pair each")
    g.add_argument("--line-documents", action="store_true", help="text: one document a line")
    g = ap.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="byte", choices=list(TOKENIZER_TYPES))
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a tokenizer directory or "
                   "tokenizer.json")
    g.add_argument("--tokenizer-file", help="older name of --tokenizer-model")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0..N-1, eod N")
    g = ap.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true",
                   help="end each non-empty document with the end-of-document token")
    g.add_argument("--no-append-eod", action="store_true",
                   help="older flag: no end-of-document token (now the default)")
    g = ap.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes <prefix>_<json-key>_document.bin/.idx")
    g = ap.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--no-progress", action="store_true")
    return ap


def _open_writers(prefix: str, keys, vocab_size: int) -> tuple[dict, dict]:
    """(output prefix by JSON key, IndexedWriter by JSON key); DataError if the
    directory of ``prefix`` cannot be written."""
    prefixes = {k: output_prefix(prefix, k) for k in keys}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        writers = {k: IndexedWriter(p, dtype_for_vocab(vocab_size)) for k, p in prefixes.items()}
    except OSError as e:
        raise DataError(f"--output-prefix {prefix}: cannot write there ({e})") from e
    return prefixes, writers


def _write(results, writers: dict, eod: int, append_eod: bool) -> None:
    """Tokenized chunks, in input order, into each key's writer, closing documents."""
    for chunk in results:
        for k, ids, end in chunk:
            w = writers[k]
            w.add(ids)
            if end:
                if append_eod and w.document_tokens:  # Megatron: none after an empty one
                    w.add([eod])
                w.end_document()


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    bad = ("--append-eod and --no-append-eod contradict each other"
           if a.append_eod and a.no_append_eod else
           f"--workers must be >= 1, got {a.workers}" if a.workers < 1 else None)
    if bad:  # one line, like every other error here (ap.error adds the whole usage)
        print(f"preprocess_data.py: error: {bad}", file=sys.stderr)
        return 2
    tok_args = {"tokenizer_type": a.tokenizer_type, "vocab_file": a.vocab_file,
                "merge_file": a.merge_file, "tokenizer_model": a.tokenizer_model,
                "tokenizer_file": a.tokenizer_file, "vocab_size": a.vocab_size}
    writers: dict[str, IndexedWriter] = {}  # json key -> its output
    pool: Pool | None = None
    try:
        for path in a.input:
            if not os.path.isfile(path):
                raise DataError(f"--input {path}: no such file")
        tok = build_tokenizer(TokenizerConfig.from_flags(tok_args))
        prefixes, writers = _open_writers(a.output_prefix, a.json_keys, tok.vocab_size)
        total = sum(os.path.getsize(p) for p in a.input)
        progress = _Progress(total, not a.no_progress and sys.stderr.isatty() or
                             os.environ.get("HYBRID_PROGRESS") == "1")
        t0 = time.time()
        tasks = _tasks(a.input, a.json_keys, a.line_documents, progress)
        if a.workers > 1:
            pool = mp.get_context("spawn").Pool(a.workers, _init_worker, (tok_args,))
            results = _bounded_imap(pool, _tokenize, tasks, window=2 * a.workers)
        else:
            _init_worker(tok_args)
            results = map(_tokenize, tasks)
        _write(results, writers, tok.eod, a.append_eod)
        for w in writers.values():
            w.finalize()
    except DataError as e:
        for w in writers.values():
            w.abort()
        print(f"\npreprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    dt = max(time.time() - t0, 1e-9)
    if progress.enabled:
        sys.stderr.write("\n")
    docs = sum(w.documents for w in writers.values())
    toks = sum(w.tokens for w in writers.values())
    print(f"{docs} documents, {toks} tokens -> {', '.join(prefixes.values())}.bin/.idx in "
          f"{dt:.1f}s ({total / 2**20 / dt:.1f} MB/s, {toks / dt:.0f} tokens/s)")
    return 0


def _bounded_imap(pool, fn, tasks, window: int):
    """``pool.imap(fn, tasks)`` in order, with at most ``window`` chunks in flight.

    Pool.imap keeps every finished result until the caller takes it, so when
    the writer falls behind the workers (a slow disk, a loaded machine) memory
    grows with the input. Here a chunk is read only when one is taken.
    """
    pending: collections.deque = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(fn, (task,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's name for a key's output pair (document level)."""
    return f"{prefix}_{key}_document"


if __name__ == "__main__":
    sys.exit(main())
