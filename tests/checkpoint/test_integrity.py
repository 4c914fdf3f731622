"""Every checkpoint byte is checked against the checksum saved with it.

The blocks and their joins in one process; then, through scripts/pretrain_gpt.py's
path, a shard overwritten with other finite values and one with NaNs: each is one
error naming the file, the iteration and the checkpoint to go back to (which then
loads), where without checksums both loaded and trained on. The offline
``convert_checkpoint.py verify`` names the same file.
"""

import os
import random
import zlib

import numpy as np
import pytest

from tests.helpers.launch import TINY, pretrain, read_json_log, script_module

ARGS = TINY + ["--global-batch-size", "8", "--tensor-model-parallel-size", "1",
               "--zero-stage", "1"]


def test_crc32_combine_joins_any_two_parts():
    from hybrid.checkpoint.integrity import crc32_combine
    rng = random.Random(0)
    for n1, n2 in [(0, 5), (5, 0), (1, 1), (1000, 3000), (123457, 99991), (1 << 20, 7)]:
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)


def _table(data: bytes, ncols: int, block: int) -> dict:
    from hybrid.checkpoint.integrity import BlockSums
    sums, n = BlockSums(block), len(data) // ncols
    for c in range(ncols):
        sums.column()
        view = memoryview(data)[c * n: (c + 1) * n]
        sums.update(view[: n // 3])  # fed in uneven pieces, as pieces are written
        sums.update(view[n // 3:])
    return sums.table()


@pytest.mark.parametrize("seed", range(4))
def test_reads_in_any_order_check_every_touched_block_reading_only_its_gaps(seed):
    """Ranges of a 3-column file read in random order, some left out: every block
    touched is checked, and finishing reads exactly the bytes of touched blocks the
    load did not read -- nothing twice, nothing of an untouched block."""
    from hybrid.checkpoint.integrity import Verifier
    rng = random.Random(seed)
    block, ncols, n = 1000, 3, 10_000
    data = rng.randbytes(ncols * n)
    table = _table(data, ncols, block)
    assert [len(c) for c in table["columns"]] == [10, 10, 10]  # blocks restart per column
    cuts = sorted(rng.sample(range(1, len(data)), 60))
    ranges = list(zip([0] + cuts, cuts + [len(data)]))
    rng.shuffle(ranges)
    read = ranges[:40]
    v = Verifier("f.bin", table, len(data), lambda lo, hi: f"bad [{lo}, {hi})")
    for a, b in read:
        v.feed(a, memoryview(data)[a:b])
    covered = np.zeros(len(data), bool)
    for a, b in read:
        covered[a:b] = True

    idx = np.flatnonzero(covered)
    touched = np.unique(idx // n * n + idx % n // block * block)  # blocks restart per column
    gaps = sum(int((~covered[s: min(s + block, s // n * n + n)]).sum()) for s in touched)
    reread = []
    v.finish(lambda at, k: (reread.append(k), data[at: at + k])[1])
    assert sum(reread) == gaps
    assert len(v.done) == len(touched)


def test_a_changed_byte_is_named_by_its_block():
    from hybrid.checkpoint.integrity import Verifier
    from hybrid.errors import CheckpointError
    data = bytearray(random.Random(1).randbytes(3 * 4096))
    table = _table(bytes(data), 3, 1024)
    data[5000] ^= 0x10  # column 1 (4096..8191), its block [4096, 5120)
    for order in (1, -1):
        v = Verifier("f.bin", table, len(data), lambda lo, hi: f"f.bin: bad [{lo}, {hi})")
        with pytest.raises(CheckpointError, match=r"bad \[4096, 5120\)"):
            for a in range(0, len(data), 700)[::order]:
                v.feed(a, memoryview(bytes(data))[a: a + 700])
            v.finish(lambda at, k: bytes(data[at: at + k]))


# -- through the training script ------------------------------------------------------------

@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    """Checkpoints at iterations 1 and 2 of a 2-rank run, and its losses."""
    tmp = tmp_path_factory.mktemp("integrity")
    save, log = str(tmp / "ckpt"), str(tmp / "log.jsonl")
    r = pretrain(2, ARGS + ["--train-iters", "3", "--save", save, "--save-interval", "1",
                            "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    import shutil
    shutil.rmtree(os.path.join(save, "iter_0000003"))  # resume from 2
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("iter_0000002")
    return save, [m["loss"] for m in read_json_log(log)]


def _overwrite(path, offset, values):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.asarray(values, np.float32).tobytes())


@pytest.mark.parametrize("garbage", ["finite", "nan"])
def test_a_changed_shard_is_one_error_naming_it_and_the_checkpoint_to_go_back_to(
        two_saves, tmp_path, garbage):
    """40,000 bytes of rank 1's data file (master and moments) replaced -- by other
    finite values, or by NaN: the resume stops before training with one error naming
    the file, the iteration, and iteration 1 to go back to, leaving no swap file of
    its nvme tier behind; --ckpt-step 1, as the message says, resumes from there on
    the run's own curve. The offline verify names the same file and passes the
    checkpoint before it."""
    import shutil
    save, losses = two_saves
    ck = str(tmp_path / "ckpt")
    shutil.copytree(save, ck)
    data = os.path.join(ck, "iter_0000002", "rank_00001.bin")
    old = np.fromfile(data, np.float32)[1000: 11000]
    _overwrite(data, 4000, old * 1.01 + 1e-3 if garbage == "finite" else np.full(10000, np.nan))
    log, swap = str(tmp_path / "log.jsonl"), tmp_path / "swap"
    # (on the nvme tier: a run that fails to start removes the swap files it made)
    r = pretrain(2, ARGS + ["--train-iters", "3", "--load", ck, "--save", ck,
                            "--log-json", log, "--offload-optimizer", "nvme",
                            "--offload-nvme-path", str(swap)])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert sorted(os.listdir(swap)) == ["rank00000", "rank00001"]
    assert [os.listdir(swap / d) for d in sorted(os.listdir(swap))] == [[".lock"]] * 2
    assert f"{data}: bytes [" in r.stderr and "do not match their saved checksum" in r.stderr
    assert "(checkpoint of iteration 2)" in r.stderr
    assert "iter_0000001 (iteration 1), has all its files" in r.stderr
    assert "--ckpt-step 1" in r.stderr
    assert not os.path.exists(log) or not read_json_log(log)  # not one iteration trained

    verify = script_module("convert_checkpoint").main
    assert verify(["verify", os.path.join(ck, "iter_0000002")]) == 2
    assert verify(["verify", os.path.join(ck, "iter_0000001")]) == 0

    r = pretrain(2, ARGS + ["--train-iters", "3", "--load", ck, "--save", ck,
                            "--ckpt-step", "1", "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["loss"] for m in read_json_log(log)] == losses[1:]


def test_verify_reports_a_whole_checkpoint(two_saves, capsys):
    import json
    save, _ = two_saves
    assert script_module("convert_checkpoint").main(["verify", save]) == 0
    report = json.loads(capsys.readouterr().out)
    ckpt = os.path.join(save, "iter_0000002")
    assert report["checkpoint"] == ckpt and report["iteration"] == 2 and report["damaged"] == 0
    assert report["files"] == 5  # metadata and two ranks' header and data
    assert report["bytes"] == sum(os.path.getsize(os.path.join(ckpt, f))
                                  for f in os.listdir(ckpt))


def test_a_long_read_is_checked_chunk_by_chunk_while_it_reads(tmp_path):
    """A read of several 8 MiB chunks hashes each on the reader's helper thread while the
    next is read: every block is checked by the time the read returns, and a changed
    byte in a middle chunk fails the read itself, naming its block."""
    import torch

    from hybrid.checkpoint.integrity import Verifier
    from hybrid.checkpoint.reader import CHUNK_BYTES, RangeReader
    from hybrid.errors import CheckpointError
    data = bytearray(random.Random(2).randbytes(3 * CHUNK_BYTES))
    table = _table(bytes(data), 1, 1 << 20)
    path = tmp_path / "rank_00000.bin"

    class Checks:  # the Integrity a load would set, for this one file
        seconds = 0.0

        def verifier(self, p, size, reader):
            return Verifier(p, table, size, lambda lo, hi: f"{p}: bad [{lo}, {hi})")

    for flip in (None, CHUNK_BYTES + 12345):
        if flip is not None:
            data[flip] ^= 1
        path.write_bytes(bytes(data))
        reader = RangeReader()
        reader.integrity = Checks()
        out = torch.empty(len(data) // 4, dtype=torch.float32)
        try:
            if flip is None:
                reader.read_into(str(path), len(data), 0, out)
                check = reader._verifiers[str(path)]
                assert len(check.done) == len(data) >> 20 and not check.partial
                assert reader._hasher is not None  # it went through the helper thread
                assert bytes(out.numpy().tobytes()) == bytes(data)
            else:
                with pytest.raises(CheckpointError, match=r"bad \[8388608, 9437184\)"):
                    reader.read_into(str(path), len(data), 0, out)
        finally:
            reader.close()


def test_a_corrupt_header_of_a_checkpoint_without_checksums_is_hybrid_s_message(
        two_saves, tmp_path):
    """A checkpoint saved before checksums (none in its metadata) whose header is garbage:
    one line naming the file, without torch's advice to load it with weights_only=False
    (unsafe for a file of unknown origin)."""
    import json
    import shutil
    ck = str(tmp_path / "ckpt")
    shutil.copytree(two_saves[0], ck)
    meta_path = os.path.join(ck, "iter_0000002", "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["checksums"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    head = os.path.join(ck, "iter_0000002", "rank_00000.pt")
    with open(head, "r+b") as f:
        f.seek(64)
        f.write(b"\x00" * 256)
    r = pretrain(2, ARGS + ["--train-iters", "3", "--load", ck])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert f"{head}: corrupt or truncated checkpoint shard (not a readable header" in r.stderr
    assert "weights_only" not in r.stderr
    assert "saved before checkpoints carried checksums; loading it unverified" in r.stdout
