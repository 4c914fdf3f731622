"""Token ids outside the tokenizer's vocabulary stop a run when its data is opened,
cheaply: no scan when the dtype cannot hold such an id, else one chunked scan per
file, cached, done by one rank per file."""

import os
import re
import struct

import numpy as np
import pytest

from hybrid.data.indexed import open_indexed
from hybrid.data.vocab_check import RECORD_LIMIT, check_sources, scan_tokens, sidecar_path
from hybrid.errors import DataError
from tests.data.test_indexed import DOCS, _poke, megatron_pair
from tests.helpers.harness import run_ranks


def _records_by_loop(tokens):
    best, out = None, []
    for i, t in enumerate(tokens.tolist()):
        if best is None or t > best:
            best = t
            out.append((i, t))
    return out


def test_scan_records_match_a_plain_loop_across_chunks():
    rng = np.random.default_rng(1)
    tokens = np.concatenate([rng.integers(0, 50, 500), rng.integers(0, 900, 500)]).astype("<i2")
    tokens[777] = -4
    for chunk in (7, 64, 10_000):
        s = scan_tokens(tokens, type("IO", (), {"bytes_read": 0})(), chunk)
        assert s.records == _records_by_loop(tokens) and s.complete
        assert s.max_id == int(tokens.max()) and s.first_negative == (777, -4)


def test_out_of_vocabulary_ids_are_found_once_and_answered_from_the_cache(tmp_path):
    p, cache = str(tmp_path / "big_vocab"), str(tmp_path / "cache")
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 257, 5000)
    tokens[1234], tokens[3000] = 300, 999  # a 1000-id tokenizer's data under the byte one
    megatron_pair(p, [[tokens[:1000].tolist()], [tokens[1000:].tolist()]], 8)
    size = os.path.getsize(p + ".bin")

    def check(vocab):
        src = open_indexed(p)
        before = src.io.bytes_read
        try:
            return check_sources([src], vocab, "ByteTokenizer", [cache], chunk=512)[0], \
                src.io.bytes_read - before, None
        except DataError as e:
            return None, src.io.bytes_read - before, str(e)

    first, read, _ = check(1000)  # in range: the one scan, validation included
    assert first.scanned and read == size + 12 * 2 + 8 * 3
    assert os.path.isfile(sidecar_path(open_indexed(p), cache))
    for _ in range(2):  # any vocabulary now, from the sidecar: no token read
        _, read, err = check(257)
        assert read == os.path.getsize(sidecar_path(open_indexed(p), cache))
        assert err == (f"{p}.bin: token id 300 at position 1234 (document 1) is >= the "
                       f"vocabulary size 257 of ByteTokenizer: was it tokenized with another "
                       f"tokenizer? (match --tokenizer-type and its files to the ones "
                       f"preprocess_data.py used)")
    _, read, err = check(500)
    assert "token id 999 at position 3000" in err and read < size
    os.utime(p + ".bin", ns=(1, 1))  # the file changed: its cache entry no longer applies
    again, read, _ = check(1000)
    assert again.scanned and read > size


def test_dtype_limits_skip_the_scan_and_long_records_still_locate(tmp_path):
    p = str(tmp_path / "bytes")
    megatron_pair(p, [[list(range(256))]], 1)  # uint8 cannot hold an id >= 257
    src = open_indexed(p)
    assert not check_sources([src], 257, "ByteTokenizer", [str(tmp_path)])[0].scanned
    assert src.io.bytes_read < 256  # the index was validated; not one token was read
    p = str(tmp_path / "ramp")  # every id a new maximum: more records than are kept
    megatron_pair(p, [[list(range(RECORD_LIMIT + 1000))]], 4)
    for _ in range(2):  # scanned, then cached
        with pytest.raises(DataError, match=f"token id {RECORD_LIMIT + 500} at position "
                                            f"{RECORD_LIMIT + 500} "):
            check_sources([open_indexed(p)], RECORD_LIMIT + 500, "X", [str(tmp_path)], chunk=999)
    p = str(tmp_path / "neg")
    megatron_pair(p, [[[5, 6, 7]], [[8, -3, 9]]], 3)
    with pytest.raises(DataError, match=re.escape(p + ".bin") + ": negative token id -3 at "
                                        "position 4 "):
        check_sources([open_indexed(p)], 257, "ByteTokenizer", [None])


def _check_on_ranks(ps, prefixes, vocab):
    """Every rank opens the files; each is checked by one rank; the error each rank raises."""
    try:
        done = check_sources([open_indexed(p) for p in prefixes], vocab, "ByteTokenizer",
                             [None] * len(prefixes), ps)
    except DataError as e:
        return str(e)
    return [c is not None and c.scanned for c in done]


def test_each_file_is_checked_by_one_rank_and_every_rank_raises_its_error(tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    megatron_pair(good, DOCS, 8)
    megatron_pair(bad, DOCS, 8)
    assert run_ranks(_check_on_ranks, world_size=2, tp=1, args=([good, bad], 257)) == \
        [[True, False], [False, True]]  # file i on rank i mod 2
    _poke(bad + ".idx", 66, struct.pack("<q", 2))  # found by rank 1 alone
    out = run_ranks(_check_on_ranks, world_size=2, tp=1, args=([good, bad], 257))
    assert out[0] == out[1] == f"{bad}.idx: sequence_pointers[2] = 2 decreases (expected 8 = " \
        f"sequence_pointers[1] + sequence_lengths[1] x 2 bytes)"
    small = str(tmp_path / "small")
    megatron_pair(small, [[[1, 2]]], 8)
    out = run_ranks(_check_on_ranks, world_size=2, tp=1, args=([small, good], 50))
    assert out[0] == out[1] and out[0].startswith(f"{good}.bin: token id 100 at position 7 ")
