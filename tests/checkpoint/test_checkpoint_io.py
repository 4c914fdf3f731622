"""Checkpoint I/O proportional to what a rank owns, and exact resharding.

One 4-process session (tests/helpers/checkpoint_io_session.py) does every save and load
below; the tests check its records against the raw files, read independently
of hybrid.checkpoint. (End-to-end resume, crashes and bad input through
pretrain_gpt.py: tests/checkpoint/test_checkpoint.py; format 2: test_checkpoint_format2.py.)
"""

import os

import pytest

from tests.helpers.checkpoint_io_session import (
    _check_reshard,
    _old_full_tensors,
    _own_file_bytes,
    _rows,
)


def test_same_layout_load_reads_only_the_rank_s_own_files(io_session):
    """TP2 x DP2 ZeRO-3, same layout: each rank opens latest, the metadata, its own
    header and its own data file, nothing else; reads at most 1.1x its own files
    (the reader's count agrees with the kernel's); and gets back exactly what it saved."""
    import torch
    root, results = io_session
    ckpt = os.path.join(root, "a", "iter_0000002")
    for r, out in enumerate(results):
        s, got = out["saved"], out["same"]
        assert "error" not in got, got
        with open(os.path.join(root, "a", "latest")) as f:
            assert f.read() == "iter_0000002"
        own = {f"iter_0000002/rank_{r:05d}.pt", f"iter_0000002/rank_{r:05d}.bin"}
        assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json", *own])
        assert sorted(got["reader_files"]) == sorted(own | {"iter_0000002/metadata.json"})
        assert got["bytes"] <= 1.1 * _own_file_bytes(ckpt, r)
        assert got["rechecked"] == 0  # every checksum block was read whole by the load
        # rchar also counts 'latest' and Python's own reads; nothing of size
        assert got["bytes"] <= got["rchar"] <= got["bytes"] + 64 * 1024, (got["bytes"],
                                                                          got["rchar"])
        assert got["pieces"] == s["pieces"]
        assert torch.equal(got["values"], s["values"])


@pytest.mark.parametrize("case", ["stage1", "tp1dp4", "tp4dp1", "single"])
def test_reshard_is_exact_and_reads_only_the_overlapping_ranges(io_session, case):
    """TP2 x DP2 ZeRO-3 -> ZeRO-1 in the same world layout (header read for the RNG
    states), TP1 x DP4, TP4 x DP1 ZeRO-0, and one process: master and both moments
    equal the old full tensors' cut to the bit, and each rank opened only the data
    files holding its elements and read at most 2x what it needs."""
    root, results = io_session
    ckpt = os.path.join(root, "a", "iter_0000002")
    for r, out in enumerate(results):
        if case in out:
            _check_reshard(ckpt, out[case], r, header=case == "stage1")


def test_no_save_optim_writes_the_master_column_only(io_session):
    """--no-save-optim: every data file is exactly 1/3 of the full one (4 of 12 bytes
    per element), the whole checkpoint smaller by just the moments, the columns are
    named, no step or loss scale is recorded, and the master values are the full
    checkpoint's."""
    import json

    import torch
    root, results = io_session
    full, weights = (os.path.join(root, n, "iter_0000002") for n in ("a", "aw"))
    for r in range(len(results)):
        data = [os.path.getsize(os.path.join(c, f"rank_{r:05d}.bin")) for c in (full, weights)]
        assert data[1] * 3 == data[0] == 12 * _rows(full, r) > 0
    # The rest (headers: RNG states, piece tables; metadata) is the same but for the
    # step and loss scale; at this toy size it is a good part of the whole (the
    # whole-checkpoint ratio at a larger size: tests/checkpoint/test_checkpoint.py).
    total = [sum(os.path.getsize(os.path.join(c, f)) for f in os.listdir(c))
             for c in (full, weights)]
    moments = sum(8 * _rows(full, r) for r in range(len(results)))
    assert abs(total[0] - total[1] - moments) < 1024, (total, moments)
    with open(os.path.join(weights, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["zero_layout"]["columns"] == ["master"]
    assert meta["step"] is None and meta["loss_scaler"] is None
    _, old_full = _old_full_tensors(full)
    _, old_weights = _old_full_tensors(weights)
    for name, (values, _) in old_full.items():
        assert torch.equal(old_weights[name][0], values[..., :1]), name


def test_weights_only_load_reads_only_the_master_bytes(io_session):
    """load_optim=False, load_rng=False (--finetune) from a full checkpoint, same layout:
    each rank opens latest, the metadata, its own data file and its header (for the
    data file's checksums), and reads exactly those two small files plus its master
    block (a third of its data file; nothing read twice for the checksums); it gets
    the saved master, zero moments and step, and keeps its own RNG. With the RNG
    (--no-load-optim) from a weights-only checkpoint: the same files, whole."""
    import torch
    root, results = io_session
    ckpt, wckpt = (os.path.join(root, n, "iter_0000002") for n in ("a", "aw"))
    for r, out in enumerate(results):
        s, got = out["saved"], out["weights"]
        assert "error" not in got, got
        own_bin, head = f"iter_0000002/rank_{r:05d}.bin", f"iter_0000002/rank_{r:05d}.pt"
        assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json",
                                                head, own_bin])
        small = sum(os.path.getsize(os.path.join(ckpt, f)) for f in
                    ("metadata.json", f"rank_{r:05d}.pt"))
        assert got["bytes"] == small + 4 * _rows(ckpt, r) and got["rechecked"] == 0
        assert got["bytes"] <= got["rchar"] <= got["bytes"] + 64 * 1024
        assert got["pieces"] == s["pieces"]
        assert torch.equal(got["values"][:, 0], s["values"][:, 0])
        assert s["values"][:, 1:].abs().sum() > 0 and not got["values"][:, 1:].any()
        assert got["step"] == 0 and out["same"]["step"] == 2
        assert got["rng_kept"] and not out["same"]["rng_kept"]
        w = out["wonly_same"]
        assert "error" not in w, w
        assert sorted(w["opened"]) == sorted(["latest", "iter_0000002/metadata.json",
                                              head, own_bin])
        assert w["bytes"] == sum(os.path.getsize(os.path.join(wckpt, f)) for f in
                                 ("metadata.json", f"rank_{r:05d}.pt", f"rank_{r:05d}.bin"))
        assert torch.equal(w["values"][:, 0], s["values"][:, 0]) and not w["values"][:, 1:].any()
        assert not w["rng_kept"] and w["step"] == 0


@pytest.mark.parametrize("case,ckpt", [("weights_tp1dp4", "a"), ("wonly_tp4dp1", "aw")])
def test_weights_only_reshard_reads_only_the_overlapping_master_ranges(io_session, case, ckpt):
    """load_optim=False into TP1 x DP4 ZeRO-1 from the full checkpoint, and into TP4 x
    DP1 ZeRO-0 from the weights-only one: the master is the old full tensor's cut to
    the bit, the moments zero, and each rank read at most 2x the master bytes it
    needs, from only the data files holding its elements."""
    root, results = io_session
    for r, out in enumerate(results):
        _check_reshard(os.path.join(root, ckpt, "iter_0000002"), out[case], r, header=False,
                       master_only=True)


def test_exact_load_of_a_weights_only_checkpoint_names_the_flags(io_session):
    """Resuming a --no-save-optim checkpoint with its optimizer: the same error on every
    rank, naming the checkpoint and the flags that load it, nothing zeroed silently."""
    _, results = io_session
    for out in results:
        e = out["wonly_exact"]
        assert e == results[0]["wonly_exact"]
        assert "aw/iter_0000002: saved with --no-save-optim" in e, e
        assert "--no-load-optim" in e and "--finetune" in e, e


def test_reshard_there_and_back_is_bit_identical(io_session):
    """TP2 x DP2 ZeRO-3 -> TP1 x DP4 ZeRO-1, saved, -> TP2 x DP2 ZeRO-3: every rank has
    exactly the pieces and values it saved at first."""
    import torch
    _, results = io_session
    for out in results:
        assert out["back"]["pieces"] == out["saved"]["pieces"]
        assert torch.equal(out["back"]["values"], out["saved"]["values"])


def test_merged_state_equals_the_raw_files(io_session):
    """The tools' path (one full parameter at a time through the reader)."""
    import torch

    from hybrid.checkpoint import merged_state
    ckpt = os.path.join(io_session[0], "a", "iter_0000002")
    _, old = _old_full_tensors(ckpt)
    _, merged = merged_state(ckpt)
    assert set(merged) == set(old)
    for name, (full, _) in old.items():
        for k, key in enumerate(("master", "exp_avg", "exp_avg_sq")):
            assert torch.equal(merged[name][key], full[..., k]), (name, key)


def test_merged_state_of_a_weights_only_checkpoint_is_its_master(io_session):
    """The tools' path on --no-save-optim: the master only; asking for a moment is a
    CheckpointError naming the flag."""
    import torch

    from hybrid.checkpoint import iter_full_params, merged_state
    from hybrid.errors import CheckpointError
    root = io_session[0]
    _, full = merged_state(os.path.join(root, "a", "iter_0000002"))
    _, weights = merged_state(os.path.join(root, "aw", "iter_0000002"))
    assert set(weights) == set(full)
    for name, s in weights.items():
        assert list(s) == ["master"] and torch.equal(s["master"], full[name]["master"])
    with pytest.raises(CheckpointError, match="saved with --no-save-optim"):
        iter_full_params(os.path.join(root, "aw", "iter_0000002"), ("master", "exp_avg"))


def test_bad_data_files_fail_every_rank_naming_the_file(io_session):
    """A truncated data file (read by rank 1 only) and a missing one (read by the TP4
    ranks that need it): every rank raises the same error, which names the file."""
    _, results = io_session
    for out in results:
        assert "rank_00001.bin: corrupt or truncated" in out["truncated"], out["truncated"]
        assert "rank_00002.bin: missing checkpoint shard" in out["missing"], out["missing"]


@pytest.mark.parametrize("version", [1])
def test_an_older_checkpoint_version_is_named_as_an_older_format(tmp_path, version):
    import json

    from hybrid.checkpoint import read_metadata
    from hybrid.errors import CheckpointError
    (tmp_path / "metadata.json").write_text(json.dumps({"version": version, "complete": True}))
    with pytest.raises(CheckpointError, match=f"metadata.json: an older checkpoint format "
                                              f"\\(version {version}"):
        read_metadata(str(tmp_path))
