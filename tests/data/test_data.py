"""Data: preprocessing round trip, constant memory, sample order, DP slices, blending."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid.config import Flags, build_config
from hybrid.data.blending import BlendedSamples
from hybrid.data.dataset import GPTSamples, build_datasets, dp_micro_batches
from hybrid.data.indexed import open_indexed
from hybrid.data.tokenizer import ByteTokenizer
from tests.helpers.launch import ROOT, env

PREPROCESS = os.path.join(ROOT, "scripts", "preprocess_data.py")
SHAKESPEARE = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")


def _preprocess(*args):
    r = subprocess.run([sys.executable, PREPROCESS, *args], capture_output=True, check=False,
                       text=True, env=env())
    assert r.returncode == 0, r.stderr
    return r


def test_preprocess_round_trip_with_empty_tiny_and_huge_documents(tmp_path):
    docs = ["", "x", "héllo wörld " * 20000, "line one\nline two\n"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    r = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "out"),
                    "--workers", "2", "--append-eod")
    assert "4 documents" in r.stdout
    ds, tok = open_indexed(str(tmp_path / "out_text_document")), ByteTokenizer()
    assert len(ds) == 4 and ds.tokens.dtype == np.uint16
    for i, d in enumerate(docs):  # as Megatron: no end-of-document token after nothing
        assert ds.document(i).tolist() == (tok.encode(d) + [tok.eod] if d else [])
    _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "raw"))
    raw = open_indexed(str(tmp_path / "raw_text_document"))
    assert [len(raw.document(i)) for i in range(4)] == [0, 1, len(docs[2].encode()), 18]


def test_preprocess_memory_stays_flat_on_a_large_file(tmp_path):
    big = tmp_path / "big.txt"
    line = ("All the world's a stage, and all the men and women merely players. " * 3) + "\n"
    with open(big, "w") as f:
        for _ in range(40 * 2**20 // len(line)):  # 40 MB
            f.write(line)
    probe = ("import resource, subprocess, sys; "
             "r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
             "sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", probe, sys.executable, PREPROCESS, "--input",
                        str(big), "--output-prefix", str(tmp_path / "big"), "--workers", "2"],
                       capture_output=True, check=False, text=True, env=env())
    assert r.returncode == 0, r.stderr
    peak_mb = int(r.stdout.strip().splitlines()[-1]) / 1024
    assert open_indexed(str(tmp_path / "big_text_document")).tokens.size > 40 * 10**6
    assert peak_mb < 100, f"peak RSS {peak_mb:.0f} MB for a 40 MB input"  # tokens alone: 80 MB


def _samples(n_tokens=5000, seq=16, seed=3):
    return GPTSamples(np.arange(n_tokens), seq, seed)


def test_same_seed_same_order_and_epochs_reshuffle():
    a, b, c = _samples(), _samples(), _samples(seed=4)
    n = a.samples_per_epoch
    assert all(np.array_equal(a[i], b[i]) for i in range(2 * n))
    assert not all(np.array_equal(a[i], c[i]) for i in range(20))
    first = {a[i].tobytes() for i in range(n)}
    assert len(first) == n  # an epoch visits every window once
    assert [a[i].tobytes() for i in range(n, n + 10)] != [a[i].tobytes() for i in range(10)]


def test_dp_ranks_get_disjoint_slices_of_the_global_batch():
    s = _samples()
    whole = dp_micro_batches(s, 40, 16, 4, 0, 1, torch.device("cpu"))
    parts = [dp_micro_batches(s, 40, 16, 2, r, 4, torch.device("cpu")) for r in range(4)]
    whole_rows = torch.cat([x for x, _ in whole])
    rank_rows = torch.cat([x for p in parts for x, _ in p])
    assert torch.equal(whole_rows, rank_rows)  # together: exactly the global batch, in order
    for x, y in whole:
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one


class _Reads:
    """Samples that count the tokens read through ``window`` (what a pipeline stage reads)."""

    def __init__(self, inner):
        self.inner, self.seq_length, self.tokens = inner, inner.seq_length, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.window(i, slice(None))

    def window(self, i, part):
        out = self.inner.window(i, part)
        self.tokens += len(out)
        return out


@pytest.mark.parametrize("eod", [None, 7])
@pytest.mark.parametrize("blend", [False, True])
def test_a_pipeline_stage_reads_only_its_share_of_the_same_samples(eod, blend):
    """The first stage reads the inputs, the last the labels (and, for the mask, the one
    input before them), a middle stage nothing; each share equals that part of the whole
    micro-batches, under CP too (positions kept)."""
    cpu = torch.device("cpu")
    keep = torch.tensor([0, 1, 14, 15])  # a CP rank's positions (2 of 4 chunks)
    for cut in (None, keep):
        def data():
            s = [_Reads(_samples(seed=k, n_tokens=5000 + 3 * k)) for k in (1, 2)]
            return s, (BlendedSamples(s, [1, 2]) if blend else s[0])
        def micro(reads, cut=cut):
            parts, samples = data()
            got = dp_micro_batches(samples, 40, 16, 4, 1, 2, cpu, eod, cut, reads)
            return got, sum(p.tokens for p in parts)
        (whole, n_all), (toks, n_tok), (labs, n_lab) = (micro(r) for r in
                                                        ("all", "tokens", "labels"))
        assert n_all == 8 * 17 and n_tok == 8 * 16 and n_lab == 8 * (17 if eod else 16)
        assert len(whole) == len(toks) == len(labs) == 2
        for w, t, lab in zip(whole, toks, labs):
            assert len(w) == len(t) == len(lab) == (2 if eod is None else 3)
            assert torch.equal(t[0], w[0]) and all(x is None for x in t[1:])
            assert lab[0] is None and all(torch.equal(a, b) for a, b in zip(lab[1:], w[1:]))
        parts, samples = data()
        none = dp_micro_batches(samples, 40, 16, 4, 1, 2, cpu, eod, cut, "none")
        assert none == [(None,) * (2 if eod is None else 3)] * 2
        assert sum(p.tokens for p in parts) == 0
    with pytest.raises(ValueError, match="reads='some'"):
        dp_micro_batches(_samples(), 0, 4, 2, 0, 1, cpu, reads="some")


def test_resuming_at_consumed_samples_continues_the_order():
    s1, s2 = _samples(), _samples()
    run = [dp_micro_batches(s1, k * 8, 8, 8, 0, 1, torch.device("cpu"))[0][0]
           for k in range(6)]
    resumed = [dp_micro_batches(s2, k * 8, 8, 8, 0, 1, torch.device("cpu"))[0][0]
               for k in range(3, 6)]  # a fresh process that starts at consumed = 24
    assert all(torch.equal(a, b) for a, b in zip(run[3:], resumed))


def test_blend_draws_in_the_requested_proportions():
    b = BlendedSamples([_samples(seed=1), _samples(seed=2), _samples(seed=3)], [2, 5, 3])
    for n in (10, 100, 1000, 20000):
        counts = np.bincount([b.source_of(i) for i in range(n)], minlength=3)
        assert np.all(np.abs(counts - n * np.array([0.2, 0.5, 0.3])) <= 1), (n, counts)
    assert np.allclose(b.bound, [0.7, 0.5, 0.8])  # 1/2 sum_a w_d / W_a: (0.2, 0.3) under the root
    rng = np.random.default_rng(0)
    for w in ([2, 5, 3], [0.68] + [0.0355] * 9, rng.random(6) ** 3, np.exp(rng.normal(0, 2, 10))):
        b = BlendedSamples([None] * len(w), w)
        which, _ = b.locate(0, 200_000)
        n = np.arange(1, 200_001)
        dev = [np.abs(np.cumsum(which == d) - b.weights[d] * n).max() for d in range(len(w))]
        assert np.all(dev <= b.bound + 1e-9) and b.bound.max() < 1.68, (w, dev, b.bound)
        far = [b.counts(k) for k in (10**9 + 7, 3 * 10**9 + 1, 10**10)]  # closed form, any n
        assert all(np.all(np.abs(c - b.weights * c.sum()) <= b.bound + 1e-5) for c in far)
    assert max(dev) > 0.8 * b.bound.max()  # the bound is nearly reached, not loose


def _reference_walk(b, lo, hi):
    """The blend as a run walking it sample by sample: every split keeps counters, and its
    smaller child takes the next sample when at least half a sample behind its share."""
    first = len(b.datasets)
    kids = {g: (b._small[g - first], b._big[g - first], b._q[g - first])
            for g in range(first, b._root + 1)}
    seen, small = {b._root: lo}, {}  # state at lo: each split's counts, top down
    for g in range(b._root, first - 1, -1):
        s_child, b_child, q = kids[g]
        small[g] = int(np.floor(q * seen[g] + 0.5))
        seen[s_child], seen[b_child] = small[g], seen[g] - small[g]
    out = []
    for _ in range(lo, hi):
        g = b._root
        while g >= first:
            s_child, b_child, q = kids[g]
            take = q * (seen[g] + 1) - small[g] >= 0.5
            small[g] += take
            seen[g] += 1
            g = s_child if take else b_child
        out.append((g, seen[g]))
        seen[g] += 1
    return np.array(out).T


def test_blend_random_access_matches_a_sequential_walk():
    b = BlendedSamples([None] * 5, [0.07, 0.3, 0.13, 0.5, 0.011])
    walk = _reference_walk(b, 0, 200_000)
    cuts = [0, 1, 65535, 65536, 65537, 131072, 199_999, 200_000]  # blocks of odd sizes
    got = np.concatenate([np.stack(b.locate(x, y)) for x, y in zip(cuts, cuts[1:])], axis=1)
    assert np.array_equal(got, walk)
    assert np.array_equal(np.bincount(walk[0], minlength=5), b.counts(200_000))
    at = [0, 65535, 65536, 199_999]
    assert [b.source_of(i) for i in at] == walk[0, at].tolist()


def test_resume_with_blended_data_is_exact():
    w, lo, n = [0.3, 1.1, 0.25], 10**8, 5000
    fresh = BlendedSamples([_samples(seed=s) for s in range(3)], w)
    which, index = fresh.locate(lo, lo + n)
    assert np.array_equal([which, index], _reference_walk(fresh, lo, lo + n))
    other = BlendedSamples([_samples(seed=s) for s in range(3)], w)
    other.locate(lo + 2 * n, lo + 3 * n)  # another path there: no state carries over
    parts = [np.stack(other.locate(x, min(x + 777, lo + n))) for x in range(lo, lo + n, 777)]
    assert np.array_equal(np.concatenate(parts, axis=1), [which, index])
    before = fresh.counts(lo)  # samples each dataset gave the first 10**8
    assert before.tolist() == [18_181_818, 66_666_667, 15_151_515] and before.sum() == lo
    assert np.all(np.abs(before - fresh.weights * lo) <= fresh.bound)
    for d in range(3):  # each dataset continues exactly where the first 10**8 left it
        assert np.array_equal(index[which == d], before[d] + np.arange((which == d).sum()))
    assert np.array_equal(fresh.counts(lo + n) - before, np.bincount(which, minlength=3))
    i = lo + 123
    assert np.array_equal(fresh[i], fresh.datasets[which[123]][index[123]])


def test_build_datasets_splits_and_blends_prefixes(tmp_path):
    for name, text in (("a", "alpha " * 3000), ("b", "beta " * 3000)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": text[i: i + 150]}) + "\n" for i in range(0, 18000, 150)))
        _preprocess("--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix",
                    str(tmp_path / name), "--append-eod")
    cfg = build_config(Flags(seq_length=32, split="80,10,10",
                data_path=["0.25", str(tmp_path / "a_text_document"), "0.75",
                           str(tmp_path / "b_text_document")]), 1)
    data = build_datasets(cfg.data, ByteTokenizer())
    assert all(data[s] is not None for s in ("train", "valid", "test"))
    train = data["train"]
    assert np.bincount([train.source_of(i) for i in range(40)]).tolist() == [10, 30]
    batches = dp_micro_batches(train, 10**6, 8, 2, 1, 2, torch.device("cpu"))  # rank 1 of 2
    rows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in batches]).numpy()
    assert np.array_equal(rows, np.stack([train[i] for i in range(10**6 + 4, 10**6 + 8)]))
    text = ByteTokenizer().decode(train[0])
    assert ("alpha" in text) != ("beta" in text)  # each sample comes from one prefix
    assert list(tmp_path.glob("shuffle_*.npy"))  # the sample order was cached


@pytest.mark.skipif(not os.path.isfile(SHAKESPEARE), reason="shared corpus not present")
def test_tinyshakespeare_through_the_bpe_tokenizer(tmp_path):
    from hybrid.data.tokenizer import GPT2BPETokenizer
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_tokenizer.py"),
                        "--input", SHAKESPEARE, "--vocab-size", "512", "--output-dir",
                        str(tmp_path / "tok")], capture_output=True, check=False, text=True,
                       env=env())
    assert r.returncode == 0, r.stderr
    vocab, merges = str(tmp_path / "tok" / "vocab.json"), str(tmp_path / "tok" / "merges.txt")
    _preprocess("--input", SHAKESPEARE, "--output-prefix", str(tmp_path / "shake"),
                "--tokenizer-type", "gpt2bpe", "--vocab-file", vocab, "--merge-file", merges,
                "--append-eod")
    tok = GPT2BPETokenizer(vocab, merges)
    ds = open_indexed(str(tmp_path / "shake_text_document"))
    text = Path(SHAKESPEARE).read_text(encoding="utf-8")
    assert tok.decode(ds.document(0)[:-1]) == text
    assert len(ds.document(0)) < 0.7 * len(text.encode())  # BPE compresses


@pytest.mark.parametrize("data_path,needle", [
    (["nan", "a", "1", "b"], "--data-path weights must be finite numbers > 0, got nan"),
    (["1", "a", "inf", "b"], "--data-path weights must be finite numbers > 0, got inf"),
    (["0", "a", "1", "b"], "--data-path weights must be finite numbers > 0, got 0"),
])
def test_blend_weights_that_are_not_positive_numbers_are_named(data_path, needle):
    from hybrid.errors import DataError
    cfg = build_config(Flags(seq_length=32, data_path=data_path), 1)
    with pytest.raises(DataError) as e:
        build_datasets(cfg.data, ByteTokenizer())
    assert str(e.value) == needle


def test_preprocess_names_a_non_utf8_input_and_an_unwritable_output(tmp_path, capsys):
    from tests.helpers.launch import script_module
    main = script_module("preprocess_data").main
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    out = tmp_path / "out"
    assert main(["--input", str(bad), "--output-prefix", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"preprocess_data.py: error: --input {bad}: cannot read as UTF-8 "
                          f"text") and "\n" not in err, err
    assert not list(tmp_path.glob("out*"))  # the partial output is gone
    good = tmp_path / "good.txt"
    good.write_text("hello")
    under_file = str(good / "out")  # a path below a file: cannot be created
    assert main(["--input", str(good), "--output-prefix", under_file, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"preprocess_data.py: error: --output-prefix {under_file}: "
                          f"cannot write there") and "\n" not in err, err
    for args, message in ((["--workers", "0"], "--workers must be >= 1, got 0"),
                          (["--tokenizer-type", "GPT2BPETokenizer"],
                           "--tokenizer-type GPT2BPETokenizer needs --vocab-file")):
        assert main(["--input", str(good), "--output-prefix", str(out), *args]) == 2
        assert capsys.readouterr().err.strip() == f"preprocess_data.py: error: {message}"


def test_null_tokenizer_on_a_text_file_names_the_file(tmp_path):
    from hybrid.data.tokenizer import build_tokenizer
    from hybrid.errors import DataError
    text = tmp_path / "words.txt"
    text.write_text("not ids")
    cfg = build_config(Flags(seq_length=32, tokenizer_type="NullTokenizer", vocab_size=10,
                data_path=[str(text)]), 1)
    with pytest.raises(DataError, match=f"^--data-path {text}: NullTokenizer: the text must be "
                                        f"integer token ids"):
        build_datasets(cfg.data, build_tokenizer(cfg.tokenizer))


def test_eod_mask_loss_masks_the_predictions_made_at_end_of_document_inputs():
    import numpy as np
    rows = [np.array([5, 256, 7, 8, 256, 9], dtype=np.int64), np.array([1, 2, 3, 4, 5, 6])]
    (x, y), = dp_micro_batches(rows, 0, 2, 2, 0, 1, "cpu")
    (mx, my, mask), = dp_micro_batches(rows, 0, 2, 2, 0, 1, "cpu", eod=256)
    assert torch.equal(mx, x) and torch.equal(my, y) and mask.dtype == torch.float32
    assert mask.tolist() == [[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]]  # input 256: its target left out


def test_the_builtin_corpus_is_parsed_once_and_cached(tmp_path, monkeypatch, caplog):
    """The parse goes to the cache directory once; a later call reads the same documents
    without parsing; a corrupt cache file is parsed again (with a warning) and rewritten;
    a changed stdlib gets a file of its own; an unwritable directory only means no
    cache. The entry point's environment or --data-cache-path picks the directory."""
    from hybrid.data import builtin

    lib = tmp_path / "stdlib"  # a two-module standard library: parsed in milliseconds
    lib.mkdir()
    (lib / "a.py").write_text('"""Module a: a docstring long enough to be kept as a document."""\n'
                              'def f():\n    """f: another docstring long enough to be kept."""\n')
    (lib / "b.py").write_text('class B:\n    """B: the last docstring, also long enough."""\n')
    monkeypatch.setattr(builtin.sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    parse = builtin._parse.__wrapped__  # (not the in-process memo: it keeps the real stdlib's)
    monkeypatch.setattr(builtin, "_parse", parse)
    want = builtin.builtin_documents()  # no cache directory: the parse
    assert len(want) == 3 and want[0].startswith("Module a")
    assert builtin.builtin_documents(str(tmp_path / "c")) == want
    (cached,) = (tmp_path / "c").iterdir()
    assert cached.name.startswith("builtin-corpus-") and json.loads(cached.read_text()) == want

    def no_parse(*a):
        raise AssertionError("parsed although cached")
    monkeypatch.setattr(builtin, "_parse", no_parse)
    assert builtin.builtin_documents(str(tmp_path / "c")) == want

    monkeypatch.setattr(builtin, "_parse", parse)
    cached.write_text('["half a docu')
    assert builtin.builtin_documents(str(tmp_path / "c")) == want
    assert "unreadable" in caplog.text and json.loads(cached.read_text()) == want

    (lib / "b.py").write_text('class B:\n    """B: the last docstring, changed since cached."""\n')
    assert builtin.builtin_documents(str(tmp_path / "c"))[-1].endswith("changed since cached.")
    assert len(list((tmp_path / "c").iterdir())) == 2  # another stdlib: a file of its own
    want = builtin.builtin_documents()

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if not os.access(ro, os.W_OK):  # (root writes anywhere)
        assert builtin.builtin_documents(str(ro)) == want and not list(ro.iterdir())

    home = {"HOME": str(tmp_path / "home")}
    assert build_config(Flags(), 1, environ=home).data.corpus_cache == \
        str(tmp_path / "home" / ".cache" / "hybrid")
    assert build_config(Flags(), 1, environ={"XDG_CACHE_HOME": "/x", **home}).data.corpus_cache \
        == "/x/hybrid"
    assert build_config(Flags(data_cache_path="/d"), 1, environ=home).data.corpus_cache == "/d"
    assert build_config(Flags(), 1).data.corpus_cache is None
