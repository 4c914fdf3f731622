"""Tokenizers: byte-level, trained GPT-2 BPE (checked against the tokenizers library)."""

import os
import subprocess
import sys

import pytest

from hybrid.config import Flags, build_config
from hybrid.data.tokenizer import ByteTokenizer, GPT2BPETokenizer, build_tokenizer
from hybrid.errors import DataError
from tests.helpers.launch import ROOT, env

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.\n\nHowever little known the feelings or views "
        "of such a man may be on his first entering a neighbourhood, this truth is so well "
        "fixed in the minds of the surrounding families -- 1813, naïve café!\n") * 20


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "corpus.txt").write_text(TEXT)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_tokenizer.py"),
                        "--input", str(d / "corpus.txt"), "--vocab-size", "400",
                        "--output-dir", str(d)], capture_output=True, check=False, text=True,
                       env=env())
    assert r.returncode == 0, r.stderr
    return str(d / "vocab.json"), str(d / "merges.txt")


def test_byte_tokenizer_round_trip():
    t = ByteTokenizer()
    assert t.decode(t.encode(TEXT)) == TEXT and t.eod == 256
    assert t.encode_array("é").tolist() == t.encode("é")


def test_trained_bpe_round_trips_and_compresses(bpe_files):
    tok = GPT2BPETokenizer(*bpe_files)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < 0.5 * len(TEXT.encode())
    assert tok.vocab_size == 400 and tok.eod == 399


def test_bpe_matches_the_tokenizers_library(bpe_files):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(*bpe_files))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = GPT2BPETokenizer(*bpe_files)
    for text in (TEXT, "  leading spaces\tand\ttabs\n\n\nend", "numbers 12345 and 'quotes'"):
        assert tok.encode(text) == hf.encode(text).ids


def test_tokenizer_json_through_the_library(bpe_files, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(*bpe_files))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    cfg = build_config(Flags(tokenizer_type="hf", tokenizer_file=path), 1)
    tok = build_tokenizer(cfg.tokenizer)
    assert tok.encode(TEXT) == GPT2BPETokenizer(*bpe_files).encode(TEXT)
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_missing_tokenizer_files_are_named(tmp_path):
    cfg = build_config(Flags(tokenizer_type="gpt2bpe", vocab_file=str(tmp_path / "v.json"),
                merge_file=str(tmp_path / "m.txt")), 1)
    with pytest.raises(DataError, match="--vocab-file .*v.json: no such file"):
        build_tokenizer(cfg.tokenizer)
