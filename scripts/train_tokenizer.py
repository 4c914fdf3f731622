#!/usr/bin/env python
"""Train a byte-level BPE (GPT-2 style) on local text files.

    python scripts/train_tokenizer.py --input corpus.txt --vocab-size 1024 --output-dir tok/

Writes ``tok/vocab.json`` and ``tok/merges.txt``, which ``--tokenizer-type
gpt2bpe --vocab-file tok/vocab.json --merge-file tok/merges.txt`` reads. The
vocabulary is the 256 byte symbols, then one token per learned merge, then
``<|endoftext|>``. Pure Python: counts pre-tokenized words once, then merges
the most frequent adjacent pair until the vocabulary is full.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

from hybrid.data.tokenizer import PRETOKENIZE, bytes_to_unicode


def train(texts, vocab_size: int, min_frequency: int = 2):
    byte_enc = bytes_to_unicode()
    words: collections.Counter = collections.Counter()
    for text in texts:
        for piece in PRETOKENIZE.findall(text):
            words["".join(byte_enc[b] for b in piece.encode("utf-8"))] += 1
    splits = {w: list(w) for w in words}
    vocab = [byte_enc[b] for b in range(256)]
    merges = []
    pair_counts: collections.Counter = collections.Counter()
    where = collections.defaultdict(set)
    for w, n in words.items():
        s = splits[w]
        for a, b in zip(s, s[1:]):
            pair_counts[(a, b)] += n
            where[(a, b)].add(w)
    while len(vocab) < vocab_size - 1 and pair_counts:
        (a, b), n = max(pair_counts.items(), key=lambda kv: (kv[1], kv[0]))
        if n < min_frequency:
            break
        merges.append((a, b))
        vocab.append(a + b)
        for w in list(where.pop((a, b), ())):
            s, cnt = splits[w], words[w]
            for x, y in zip(s, s[1:]):  # forget this word's old pairs
                pair_counts[(x, y)] -= cnt
                if pair_counts[(x, y)] <= 0:
                    del pair_counts[(x, y)]
            i, merged = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(s[i])
                    i += 1
            splits[w] = merged
            for x, y in zip(merged, merged[1:]):
                pair_counts[(x, y)] += cnt
                where[(x, y)].add(w)
    vocab.append("<|endoftext|>")
    return {t: i for i, t in enumerate(vocab)}, merges


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="UTF-8 text files")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--output-dir", required=True)
    a = ap.parse_args(argv)
    if a.vocab_size < 258:
        ap.error("--vocab-size must be at least 258 (256 bytes, one merge, end of document)")
    t0 = time.time()
    texts = []
    for path in a.input:
        if not os.path.isfile(path):
            print(f"train_tokenizer.py: error: --input {path}: no such file", file=sys.stderr)
            return 2
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    vocab, merges = train(texts, a.vocab_size, a.min_frequency)
    os.makedirs(a.output_dir, exist_ok=True)
    with open(os.path.join(a.output_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(a.output_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{x} {y}\n" for x, y in merges))
    print(f"trained {len(vocab)} tokens ({len(merges)} merges) on "
          f"{sum(len(t) for t in texts)} characters in {time.time() - t0:.1f}s -> {a.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
