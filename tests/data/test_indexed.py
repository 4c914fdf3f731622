"""Megatron's .bin/.idx format both ways, the Megatron preprocessing command line, the old
HYBRIDX files, and token ids outside the vocabulary (refused on every rank when the data
is opened).

Reference pairs are written here by hand from the spec (struct + numpy, not hybrid's
writer), and hybrid's output is parsed here by hand, field by field."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.sections import DataConfig
from hybrid.data.dataset import build_datasets
from hybrid.data.hybridx import HybridxIndexed
from hybrid.data.indexed import IndexedWriter, MegatronIndexed, open_indexed, write_indexed
from hybrid.data.tokenizer import ByteTokenizer, GPT2BPETokenizer
from hybrid.errors import ConfigError, DataError
from tests.helpers.launch import ROOT, TINY, env, pretrain, read_json_log

PREPROCESS = os.path.join(ROOT, "scripts", "preprocess_data.py")
CONVERT = os.path.join(ROOT, "scripts", "convert_indexed.py")
SPEC_DTYPES = {1: "u1", 2: "i1", 3: "i2", 4: "i4", 5: "i8", 6: "f8", 7: "f4", 8: "u2"}


# -- the spec, by hand ---------------------------------------------------------------------
def megatron_pair(prefix, docs, code, modes=None):
    """Write PREFIX.bin/.idx from the spec; ``docs``: documents as lists of sequences."""
    dt = np.dtype("<" + SPEC_DTYPES[code])
    seqs = [s for d in docs for s in d]
    lengths = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = (np.cumsum(np.concatenate([[0], lengths[:-1]])) * dt.itemsize).astype("<i8") \
        if seqs else np.zeros(0, "<i8")
    doc_idx = np.cumsum([0] + [len(d) for d in docs]).astype("<i8")
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
           + struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx))
           + lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    if modes is not None:
        idx += np.asarray(modes, dtype=np.int8).tobytes()
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(b"".join(np.asarray(s, dtype=dt).tobytes() for s in seqs))


def hybridx_pair(prefix, docs, code=1):
    """hybrid's older format by hand: magic, version, dtype code, D, offsets[D + 1]."""
    dt = {1: "<u2", 2: "<i4"}[code]
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"HYBRIDX\0" + struct.pack("<QQQ", 1, code, len(docs)) + offsets.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.write(b"".join(np.asarray(d, dtype=dt).tobytes() for d in docs))


def parse_idx(path):
    """A Megatron .idx parsed by hand: (header fields, lengths, pointers, document indices)."""
    raw = Path(path).read_bytes()
    magic, version, code, n_seq, n_di = struct.unpack_from("<9sQBQQ", raw, 0)
    at = 34
    lengths = np.frombuffer(raw, "<i4", n_seq, at)
    pointers = np.frombuffer(raw, "<i8", n_seq, at + 4 * n_seq)
    doc_idx = np.frombuffer(raw, "<i8", n_di, at + 12 * n_seq)
    assert len(raw) == at + 12 * n_seq + 8 * n_di  # nothing else in the file
    return (magic, version, code, n_seq, n_di), lengths.tolist(), pointers.tolist(), \
        doc_idx.tolist()


DOCS = [[[1, 2, 3], [4]], [], [[5, 6]], [[7, 100]]]  # two sequences; an empty document


# -- reading ------------------------------------------------------------------------------
@pytest.mark.parametrize("code", sorted(SPEC_DTYPES))
def test_hand_built_megatron_pair_reads_back(tmp_path, code):
    p = str(tmp_path / "m")
    megatron_pair(p, DOCS, code)
    src = open_indexed(p)
    src.validate()
    item = np.dtype(SPEC_DTYPES[code]).itemsize
    assert isinstance(src, MegatronIndexed) and src.tokens.dtype == np.dtype(SPEC_DTYPES[code])
    assert src.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 100]
    assert (src.num_documents, src.num_sequences, src.num_tokens) == (4, 4, 8)
    assert [src.document(i).tolist() for i in range(4)] == [[1, 2, 3, 4], [], [5, 6], [7, 100]]
    assert src.sequence_lengths.tolist() == [3, 1, 2, 2]
    assert src.sequence_pointers.tolist() == [0, 3 * item, 4 * item, 6 * item]
    assert src.document_indices.tolist() == [0, 2, 2, 3, 4]
    assert src.sequence_modes is None
    assert src.doc_start(np.arange(5)).tolist() == [0, 4, 4, 6, 8]
    assert src.first_doc_at_or_after([0, 1, 4, 5, 6, 7, 8]).tolist() == [0, 1, 1, 3, 3, 4, 4]
    assert src.document_of([0, 3, 4, 5, 6, 7]).tolist() == [0, 0, 2, 2, 3, 3]


@pytest.mark.peer("megatron.core")
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_writes_hybrid_s_bytes_and_each_reads_the_other(tmp_path, dtype):
    """Against megatron-core's own IndexedDatasetBuilder and IndexedDataset: documents of
    one sequence each (as preprocess_data writes them) give byte-identical .bin and .idx
    files from both writers; documents of several sequences and an empty one, written
    by megatron-core, read back in hybrid as megatron-core reads them."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    flat = [[9, 8, 7], [], [65000 if dtype == np.uint16 else 70000, 0], [5]]
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    writer = IndexedWriter(ours, dtype)
    builder = IndexedDatasetBuilder(theirs + ".bin", dtype=dtype)
    for doc in flat:
        writer.add(np.asarray(doc, dtype=dtype))
        writer.end_document()
        if doc:
            builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    writer.finalize()
    builder.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        assert Path(ours + ext).read_bytes() == Path(theirs + ext).read_bytes(), ext
    read = IndexedDataset(ours)
    assert [read[i].tolist() for i in range(len(read))] == [d for d in flat if d]
    assert read.document_indices.tolist() == [0, 1, 1, 2, 3]

    # several sequences a document (DOCS), written by megatron-core, read by hybrid
    multi = str(tmp_path / "multi")
    builder = IndexedDatasetBuilder(multi + ".bin", dtype=dtype)
    for doc in DOCS:
        for seq in doc:
            builder.add_item(torch.tensor(seq, dtype=torch.int64))
        builder.end_document()
    builder.finalize(multi + ".idx")
    src, read = open_indexed(multi), IndexedDataset(multi)
    src.validate()
    assert src.document_indices.tolist() == read.document_indices.tolist() == [0, 2, 2, 3, 4]
    assert src.sequence_lengths.tolist() == read.sequence_lengths.tolist() == [3, 1, 2, 2]
    assert [src.document(i).tolist() for i in range(src.num_documents)] == \
        [[1, 2, 3, 4], [], [5, 6], [7, 100]]
    assert src.tokens.dtype == np.dtype(dtype)


def test_multimodal_tail_and_empty_pair(tmp_path):
    megatron_pair(str(tmp_path / "mm"), DOCS, 4, modes=[0, 1, 0, 1])
    assert open_indexed(str(tmp_path / "mm")).sequence_modes.tolist() == [0, 1, 0, 1]
    megatron_pair(str(tmp_path / "empty"), [[], []], 8)
    src = open_indexed(str(tmp_path / "empty"))
    src.validate()
    assert (src.num_documents, src.num_tokens, src.doc_start(2).tolist()) == (2, 0, 0)


def test_opening_reads_the_header_only_and_maps_the_rest(tmp_path):
    p = str(tmp_path / "m")
    megatron_pair(p, DOCS, 8)
    src = open_indexed(p)
    assert src.io.files_opened == [p + ".idx", p + ".bin"]
    assert src.io.bytes_read == 34 + 36  # header; di[0], di[-1], ptr[0], ptr[-1], len[-1]
    assert src.io.bytes_read < os.path.getsize(p + ".idx")  # no array was read
    src.validate()  # reads every index entry once
    assert src.io.bytes_read == 36 + 34 + 12 * 4 + 8 * 5


# -- writing ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "corpus.txt").write_text("Hello world! naïve café, 1813; the truth of it.\n" * 40)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_tokenizer.py"),
                        "--input", str(d / "corpus.txt"), "--vocab-size", "300",
                        "--output-dir", str(d)], capture_output=True, check=False, text=True,
                       env=env())
    assert r.returncode == 0, r.stderr
    return str(d / "vocab.json"), str(d / "merges.txt")


def _preprocess(*args, ok=True):
    r = subprocess.run([sys.executable, PREPROCESS, *args], capture_output=True, check=False,
                       text=True, env=env())
    assert (r.returncode == 0) == ok, r.stderr
    return r


TEXTS = ["", "Hello world!", "naïve café, the truth " * 30, "x"]


def test_megatron_command_line_output_matches_the_spec_field_by_field(tmp_path, bpe_files):
    src = tmp_path / "x.jsonl"
    src.write_text("".join(json.dumps({"text": t, "title": t[:5]}) + "\n" for t in TEXTS))
    _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "p"),
                "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe_files[0],
                "--merge-file", bpe_files[1], "--append-eod", "--workers", "2",
                "--json-keys", "text", "title")
    tok = GPT2BPETokenizer(*bpe_files)
    for key, texts in (("text", TEXTS), ("title", [t[:5] for t in TEXTS])):
        prefix = tmp_path / f"p_{key}_document"
        ids = [tok.encode(t) + [tok.eod] if t else [] for t in texts]
        head, lengths, pointers, doc_idx = parse_idx(f"{prefix}.idx")
        raw_head = Path(f"{prefix}.idx").read_bytes()[:34]
        n_seq = sum(1 for d in ids if d)
        assert raw_head == (b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8])
                            + n_seq.to_bytes(8, "little") + (len(texts) + 1).to_bytes(8, "little"))
        assert head == (b"MMIDIDX\x00\x00", 1, 8, n_seq, len(texts) + 1)  # uint16 tokens
        assert lengths == [len(d) for d in ids if d]  # eod inside the last sequence
        assert pointers == (2 * np.cumsum([0] + lengths[:-1])).tolist()
        assert doc_idx == np.cumsum([0] + [1 if d else 0 for d in ids]).tolist()
        expect = np.array([i for d in ids for i in d], dtype="<u2").tobytes()
        assert Path(f"{prefix}.bin").read_bytes() == expect


def test_null_and_huggingface_tokenizers_from_the_command_line(tmp_path, bpe_files):
    tokenizers = pytest.importorskip("tokenizers")
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["3 1 4 1 5", "", "9\n10"]))
    _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "10", "--append-eod")
    got = open_indexed(str(tmp_path / "n_text_document"))
    assert [got.document(i).tolist() for i in range(3)] == [[3, 1, 4, 1, 5, 10], [], [9, 10, 10]]
    src.write_text(json.dumps({"text": "3 11"}) + "\n")  # 11 >= 10 ids + eod
    r = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "bad"),
                    "--tokenizer-type", "null", "--vocab-size", "10", ok=False)
    assert "token id 11 is outside [0, 11)" in r.stderr
    assert not list(tmp_path.glob("bad*"))  # nothing half-written left behind

    hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(*bpe_files))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    model = tmp_path / "hf_model"
    model.mkdir()
    hf.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "h"), "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", str(model), "--append-eod",
                "--workers", "2")
    got = open_indexed(str(tmp_path / "h_text_document"))
    eod = hf.token_to_id("<|endoftext|>")
    want = [hf.encode(t).ids + [eod] if t else [] for t in TEXTS]
    assert [got.document(i).tolist() for i in range(4)] == want
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(model))  # what Megatron runs
    assert [auto(t).input_ids + [auto.eos_token_id] if t else [] for t in TEXTS] == want
    assert len(auto) == hf.get_vocab_size()


def test_writer_cuts_documents_past_the_int32_limit_into_sequences(tmp_path):
    w = IndexedWriter(str(tmp_path / "w"), np.uint16, max_sequence_length=4)
    for doc in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [], [11, 12, 13, 14]):
        w.add(doc[:3])
        w.add(doc[3:])
        w.end_document()
    w.finalize()
    _, lengths, pointers, doc_idx = parse_idx(str(tmp_path / "w.idx"))
    assert (lengths, pointers, doc_idx) == ([4, 4, 2, 4], [0, 8, 16, 20], [0, 3, 3, 4])
    src = open_indexed(str(tmp_path / "w"))
    write_indexed(src, str(tmp_path / "w2"), max_sequence_length=4, chunk=2)
    assert (tmp_path / "w2.idx").read_bytes() == (tmp_path / "w.idx").read_bytes()
    with pytest.raises(DataError, match="does not fit uint16"):
        IndexedWriter(str(tmp_path / "v"), np.uint16).add([70000])


# -- the older format and the converter -------------------------------------------------
def test_hybridx_files_load_convert_and_feed_training_identically(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 257, size=int(n)).tolist() for n in rng.integers(0, 60, size=150)]
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    hybridx_pair(old, docs)
    src = open_indexed(old)
    src.validate()
    assert isinstance(src, HybridxIndexed)
    assert [src.document(i).tolist() for i in range(len(docs))] == docs
    r = subprocess.run([sys.executable, CONVERT, old, new], capture_output=True, check=False,
                       text=True, env=env())
    assert r.returncode == 0, r.stderr
    conv = open_indexed(new)
    conv.validate()
    assert isinstance(conv, MegatronIndexed) and conv.tokens.dtype == np.uint16
    assert Path(new + ".bin").read_bytes() == Path(old + ".bin").read_bytes()
    assert conv.num_sequences == sum(1 for d in docs if d)
    assert [conv.document(i).tolist() for i in range(len(docs))] == docs
    data = {p: build_datasets(DataConfig(seq_length=16, data_path=(p,), split="80,10,10",
                                         cache_path=str(tmp_path / p[-3:])), ByteTokenizer())
            for p in (old, new)}
    for split in ("train", "valid", "test"):
        a, b = data[old][split], data[new][split]
        assert len(a) == len(b) > 0
        assert all(np.array_equal(a[i], b[i]) for i in range(2 * len(a)))


# -- corrupt files ------------------------------------------------------------------------
def _poke(path, offset, data):
    raw = bytearray(Path(path).read_bytes())
    raw[offset: offset + len(data)] = data
    Path(path).write_bytes(bytes(raw))


def _truncate(path, n):
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:n] if n >= 0 else raw[:len(raw) + n])


def _append(path, data):
    with open(path, "ab") as f:
        f.write(data)


# DOCS as uint16: S = 4, D = 5; lengths at 34, pointers at 50, document_indices at 82.
CORRUPT = [
    ("magic", lambda p: _poke(p + ".idx", 0, b"MMIDIDY\0\0"), "idx", "not a token index"),
    ("version", lambda p: _poke(p + ".idx", 9, struct.pack("<Q", 2)), "idx", "version 2"),
    ("dtype code", lambda p: _poke(p + ".idx", 17, b"\x09"), "idx", "dtype code 9"),
    ("truncated idx", lambda p: _truncate(p + ".idx", -3), "idx", "truncated index"),
    ("trailing bytes", lambda p: _append(p + ".idx", b"\0\0\0"), "idx",
     "3 trailing bytes"),
    ("odd .bin", lambda p: _truncate(p + ".bin", -1), "bin", "not a whole number of uint16"),
    ("truncated .bin", lambda p: _truncate(p + ".bin", -2), "idx", "does not match .*m.bin"),
    ("first pointer", lambda p: _poke(p + ".idx", 50, struct.pack("<q", 2)), "idx",
     r"sequence_pointers\[0\] = 2"),
    ("pointer order", lambda p: _poke(p + ".idx", 66, struct.pack("<q", 2)), "idx",
     r"sequence_pointers\[2\] = 2 decreases"),
    ("pointer gap", lambda p: _poke(p + ".idx", 58, struct.pack("<q", 4)), "idx",
     r"sequence_pointers\[1\] = 4 does not follow"),
    ("negative length", lambda p: _poke(p + ".idx", 38, struct.pack("<i", -1)), "idx",
     r"sequence_lengths\[1\] = -1 is negative"),
    ("document order", lambda p: _poke(p + ".idx", 90, struct.pack("<q", 3)), "idx",
     r"document_indices\[2\] = 2 is out of order"),
    ("document end", lambda p: _poke(p + ".idx", 114, struct.pack("<q", 3)), "idx",
     "document_indices run from 0 to 3"),
    ("missing .bin", lambda p: os.remove(p + ".bin"), "bin", "does not exist"),
]


@pytest.mark.parametrize("mutate,which,message", [c[1:] for c in CORRUPT],
                         ids=[c[0] for c in CORRUPT])
def test_each_corrupt_field_is_a_data_error_naming_file_and_field(tmp_path, mutate, which,
                                                                  message):
    p = str(tmp_path / "m")
    megatron_pair(p, DOCS, 8)
    mutate(p)
    with pytest.raises(DataError, match=re.escape(f"{p}.{which}") + ".*" + message):
        open_indexed(p).validate()
    # and through the training data path, at open, naming the flag
    with pytest.raises(DataError, match=re.escape(f"{p}.{which}")):
        build_datasets(DataConfig(seq_length=2, data_path=(p,), cache_path=str(tmp_path)),
                       ByteTokenizer())


def test_corrupt_hybridx_files_are_named(tmp_path):
    p = str(tmp_path / "o")
    hybridx_pair(p, [[1, 2], [3]])
    _truncate(p + ".idx", -3)
    with pytest.raises(DataError, match=re.escape(p + ".idx") + ": corrupt or truncated"):
        open_indexed(p)
    hybridx_pair(p, [[1, 2], [3]])
    _poke(p + ".idx", 40, struct.pack("<q", 3))  # offsets [0, 3, 3]: fine; [0, 3, 2]: not
    _poke(p + ".idx", 48, struct.pack("<q", 3))
    open_indexed(p).validate()
    hybridx_pair(p, [[1, 2], [3]])
    _poke(p + ".idx", 40, struct.pack("<q", 4))
    with pytest.raises(DataError, match=re.escape(p + ".idx") + ": document offset 2 decreases"):
        open_indexed(p).validate()




# -- configuration and training end to end ----------------------------------------------
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


@pytest.mark.parametrize("flags,message", [
    (["--train-data-path", "a", "--data-path", "b"],
     "--train-data-path and --data-path are exclusive"),
    (["--train-data-path", "a", "--split", "90,5,5"], "--split 90,5,5 cuts --data-path"),
    (["--valid-data-path", "a"], "--valid-data-path needs --train-data-path"),
    (["--mock-data", "--data-path", "a"], "--mock-data .* drop --data-path"),
    (["--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "needs --vocab-file and --merge-file"),
    (["--tokenizer-type", "bpe"], "--tokenizer-type must be byte, GPT2BPETokenizer, gpt2bpe, "
                                      "HuggingFaceTokenizer, hf, NullTokenizer, null or "
                                      "Llama2Tokenizer, got .bpe."),
])
def test_data_flags_are_checked_naming_the_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config(parse_args(BASE + flags), 1)


def test_llama2_tokenizer_reads_the_hf_tokenizer_and_names_a_sentencepiece_file(tmp_path):
    """Megatron's Llama2Tokenizer takes the model's SentencePiece .model file; hybrid's
    reads its Hugging Face tokenizer, and a .model file is one DataError saying so."""
    from hybrid.data.tokenizer import HFTokenizer
    from hybrid.errors import DataError
    cfg = build_config(parse_args(BASE + ["--tokenizer-type", "Llama2Tokenizer",
                                          "--tokenizer-model", "tok.json"]), 1)
    assert cfg.tokenizer.type == "HuggingFaceTokenizer"
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"\n\x0c")
    with pytest.raises(DataError, match=r"--tokenizer-model .*tokenizer\.model: a SentencePiece "
                                        r"model file; hybrid reads the model's Hugging Face "
                                        r"tokenizer instead"):
        HFTokenizer(str(model))


def test_megatron_tokenizer_names_and_mock_data_config():
    cfg = build_config(parse_args(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50",
                             "--mock-data"]), 1)
    assert cfg.data.mock_data and cfg.tokenizer.vocab_size == 50
    assert cfg.tokenizer.type == "NullTokenizer"
    cfg = build_config(parse_args(BASE + ["--tokenizer-type", "HuggingFaceTokenizer",
                                          "--tokenizer-model", "some/dir",
                                          "--train-data-path", "0.3", "a", "0.7", "b",
                                          "--valid-data-path", "c"]), 1)
    assert cfg.data.train_data_path == ("0.3", "a", "0.7", "b")
    assert cfg.tokenizer.model == "some/dir"


def test_mock_data_is_a_function_of_the_seed():
    from hybrid.data.sources import MockTokens
    a, b, c = (MockTokens(s, 257, 256, 10_000, 32) for s in (1, 1, 2))
    assert np.array_equal(a.tokens, b.tokens) and not np.array_equal(a.tokens, c.tokens)
    assert a.num_tokens >= 10_000 and a.tokens.max() <= 256
    for i in range(a.num_documents):
        d = a.document(i).astype(np.int64)
        assert d[-1] == 256 and 1 <= len(d) <= 32  # counts up (mod 257), then eod
        assert np.all(np.diff(d[:-1]) % 257 == 1)


def test_per_split_paths_mock_data_and_out_of_vocab_through_pretrain(tmp_path):
    """Two ranks: --train-data-path (a Megatron pair blended with an old HYBRIDX one; each
    file checked by one rank, cached) and --valid-data-path; --mock-data; and a file
    with ids past the vocabulary, found by rank 1, failing every rank at open."""
    rng = np.random.default_rng(3)
    text = [rng.integers(97, 123, int(n)).tolist() for n in rng.integers(20, 200, 60)]
    megatron_pair(str(tmp_path / "a"), [[d] for d in text[:30]], 8)
    hybridx_pair(str(tmp_path / "b"), text[30:50])
    megatron_pair(str(tmp_path / "c"), [[d] for d in text[50:]], 1)
    cache = str(tmp_path / "cache")
    log = str(tmp_path / "split.jsonl")
    r = pretrain(2, TINY + ["--train-iters", "4", "--global-batch-size", "4", "--train-data-path",
                            "0.6", str(tmp_path / "a"), "0.4", str(tmp_path / "b"),
                            "--valid-data-path", str(tmp_path / "c"), "--eval-interval", "2",
                            "--eval-iters", "1", "--data-cache-path", cache, "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(read_json_log(log)) == 4 and len(read_json_log(log, "valid")) == 2
    assert not read_json_log(log, "test")  # no --test-data-path: no test evaluation
    assert len(list((tmp_path / "cache").glob("tokens_*.json"))) == 3  # scanned a, b; c: uint8
    log = str(tmp_path / "mock.jsonl")
    r = pretrain(2, TINY + ["--train-iters", "6", "--global-batch-size", "8", "--mock-data",
                            "--lr", "3e-3", "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in read_json_log(log)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3  # counting is learnable
    megatron_pair(str(tmp_path / "bpe"), [[list(range(250, 270))] * 3], 8)
    r = pretrain(2, TINY + ["--train-iters", "1", "--data-path", "0.5", str(tmp_path / "a"),
                            "0.5", str(tmp_path / "bpe"), "--data-cache-path", cache])
    assert r.returncode == 2
    assert f"{tmp_path / 'bpe'}.bin: token id 257 at position 7 (document 0)" in r.stderr
