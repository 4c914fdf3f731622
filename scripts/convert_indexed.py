#!/usr/bin/env python
"""Rewrite a token file pair in Megatron's indexed format (hybrid/data/indexed.py).

    python scripts/convert_indexed.py OLD_PREFIX NEW_PREFIX

Reads ``OLD_PREFIX.bin/.idx`` -- hybrid's older HYBRIDX pair (or a Megatron one)
-- and writes ``NEW_PREFIX.bin/.idx`` with the same tokens and documents, one
sequence per non-empty document, the same dtype. Streams in chunks (constant
memory); the new files appear by rename only when complete. Training reads
either format as it is, so converting is for tools that read only Megatron's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from hybrid.data.indexed import open_indexed, write_indexed
from hybrid.errors import DataError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_prefix", help="reads OLD_PREFIX.bin and OLD_PREFIX.idx")
    ap.add_argument("new_prefix", help="writes NEW_PREFIX.bin and NEW_PREFIX.idx")
    a = ap.parse_args(argv)
    if os.path.abspath(a.old_prefix) == os.path.abspath(a.new_prefix):
        ap.error("OLD_PREFIX and NEW_PREFIX are the same: write the new pair elsewhere")
    t0 = time.time()
    try:
        src = open_indexed(a.old_prefix)
        src.validate()
        os.makedirs(os.path.dirname(os.path.abspath(a.new_prefix)), exist_ok=True)
        write_indexed(src, a.new_prefix)
    except (DataError, OSError) as e:
        print(f"convert_indexed.py: error: {e}", file=sys.stderr)
        return 2
    print(f"{src.num_documents} documents, {src.num_tokens} {src.tokens.dtype.name} tokens -> "
          f"{a.new_prefix}.bin/.idx in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
