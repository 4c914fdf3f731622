"""--async-save (hybrid/checkpoint/async_save.py): the step copies its values and goes on
while a thread writes; the checkpoint is published only whole, and holds the bytes a
synchronous save of that step holds; a rank killed mid-write leaves the previous
checkpoint as ``latest`` and the unfinished one unloadable by name."""

import json
import os
import re
import signal
import time

import pytest

from hybrid.checkpoint.files import rank_paths
from hybrid.checkpoint.save import PendingSave
from tests.helpers.launch import TINY, pretrain, pretrain_rank_with, read_json_log

RUN = TINY + ["--train-iters", "6", "--zero-stage", "2", "--eval-iters", "0"]
ARGS = RUN + ["--save-interval", "3"]


_WRITE = PendingSave.write


def _slow_write(pending):
    """PendingSave.write a second late: the loop runs on meanwhile."""
    time.sleep(1.0)
    _WRITE(pending)


def _ok(r):
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def _slow_rank(ps, cfg):
    return pretrain_rank_with(ps, cfg, PendingSave, "write", _slow_write, "slow",
                              lambda: None)


def _files(ckpt):
    out = {}
    for it in ("iter_0000003", "iter_0000006"):
        for name in sorted(os.listdir(os.path.join(ckpt, it))):
            if name.startswith("rank_"):
                with open(os.path.join(ckpt, it, name), "rb") as f:
                    out[f"{it}/{name}"] = f.read()
    return out


def test_an_async_save_holds_the_sync_save_s_bytes_and_training_goes_on(tmp_path):
    """Saves at 3 and 6 of a DP 2 ZeRO 2 run: written in the background with each write
    a second late (so iterations 4-5 run while iteration 3's files are written), every
    rank file equals, byte for byte, a synchronous save's of the same run, the losses are
    the same, and iteration 3's checkpoint was published after iteration 3 (from the
    loop, once both ranks had written)."""
    sync, asyn = str(tmp_path / "sync"), str(tmp_path / "async")
    _ok(pretrain(2, ARGS + ["--save", sync, "--log-json", str(tmp_path / "s.jsonl")]))
    r = pretrain(2, ARGS + ["--save", asyn, "--async-save", "--log-json",
                            str(tmp_path / "a.jsonl")], rank_fn=_slow_rank)
    _ok(r)
    assert _files(asyn) == _files(sync) and len(_files(sync)) == 8
    assert [m["loss"] for m in read_json_log(str(tmp_path / "a.jsonl"))] == \
        [m["loss"] for m in read_json_log(str(tmp_path / "s.jsonl"))]
    with open(os.path.join(asyn, "latest")) as f:
        assert f.read().strip() == "iter_0000006"
    published = [int(x) for x in re.findall(
        r"saved checkpoint \S+iter_0000003 \(written in the background; published at "
        r"iteration (\d+)\)", r.stdout + r.stderr)]
    assert published and published[0] > 3, r.stdout[-3000:]
    with open(os.path.join(asyn, "iter_0000003", "metadata.json")) as f:
        assert json.load(f)["complete"] is True


def _dying_write(pending):
    """Rank 1 writes part of its iteration-6 data file, then is gone (SIGKILL)."""
    if pending.name == "iter_0000006" and pending.header["rank"] == 1:
        with open(rank_paths(pending.tmp, 1)[1], "wb") as f:
            f.write(b"\0" * 64)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    _WRITE(pending)


def _dying_rank(ps, cfg):
    return pretrain_rank_with(ps, cfg, PendingSave, "write", _dying_write, "dying",
                              lambda: None)


def test_a_rank_killed_mid_write_leaves_the_last_checkpoint_and_the_partial_one_refused(
        tmp_path):
    """Rank 1 killed (SIGKILL) while writing iteration 6's files in the background: the
    run fails, ``latest`` still names iteration 3, which resumes; iteration 6 was never
    published, and asking for it is one error naming its unfinished save."""
    save = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] died with exit codes \[-9\]"):
        pretrain(2, ARGS + ["--save", save, "--async-save"], rank_fn=_dying_rank,
                 reuse=False, timeout=120)
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000003"
    assert not os.path.exists(os.path.join(save, "iter_0000006"))
    assert os.path.isdir(os.path.join(save, ".tmp_iter_0000006"))
    _ok(pretrain(2, RUN + ["--load", save, "--log-json", str(tmp_path / "r.jsonl")]))
    assert [m["iteration"] for m in read_json_log(str(tmp_path / "r.jsonl"))] == [4, 5, 6]
    r = pretrain(1, RUN + ["--load", save, "--ckpt-step", "6"])
    assert r.returncode == 2 and ".tmp_iter_0000006 there is a save of it that never " \
        "finished" in r.stderr, r.stderr[-2000:]


def test_the_nvme_tier_s_snapshot_is_a_copy_on_disk(tmp_path, monkeypatch):
    """ZeRO 3 with the optimizer on NVMe: the snapshot copies the swap file on disk (no
    host buffer; the copy's name is gone at once), on a thread behind the step, and reads
    what the step had when it was taken, whatever later steps write into the swap file:
    with 1024-element tiles and a copier slowed to 20 ms a tile, so that the next steps
    reach tiles not yet copied (they wait for those only), every piece equals the values
    read from the engine at that step, and differs from the next step's."""
    import torch

    import hybrid.checkpoint.snapshot as snapshot_module

    copy_file_range = os.copy_file_range

    def slow_copy(*args):
        time.sleep(0.02)
        return copy_file_range(*args)

    monkeypatch.setattr(snapshot_module.os, "copy_file_range", slow_copy)

    from hybrid.checkpoint.snapshot import SNAPSHOT_FILE, DiskSnapshot, snapshot_for
    from hybrid.config import Flags, build_config
    from hybrid.parallel.state import ParallelState
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    from hybrid.zero.state import iter_piece_values

    ps = ParallelState.single()
    cfg = build_config(Flags(num_layers=1, hidden_size=32, num_attention_heads=2,
                             seq_length=16, micro_batch_size=1, zero_stage=3,
                             offload_optimizer="nvme", offload_param="nvme",
                             offload_nvme_path=str(tmp_path / "nvme"),
                             offload_buffer_size=1024, hidden_dropout=0.0,
                             attention_dropout=0.0), 1)
    rng = seed_all(1, 0, 0, ps.device)
    model, _, engine = build_engine(cfg, ps, 64, rng)
    tokens = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(0))

    def step():
        engine.zero_grad()
        engine.backward(model(tokens[:, :-1], tokens[:, 1:]))
        engine.step(1e-2)

    try:
        step()
        snap = snapshot_for(engine)
        assert isinstance(snap, DiskSnapshot)
        columns = tuple(engine.optimizer.columns)
        then = [[v.clone() for v in iter_piece_values(engine, (k,))] for k in columns]
        rows = sum(v.numel() for v in then[0])
        taken = snap.take(engine, columns, (), rows)
        assert engine.optimizer.states.tiles >= 8
        swap_dir = os.path.dirname(engine.optimizer.states.file.path)
        assert SNAPSHOT_FILE not in os.listdir(swap_dir)  # (unlinked once open)
        step()
        step()  # the swap file now holds later states
        later = [list(iter_piece_values(engine, (k,))) for k in columns]
        for c, key in enumerate(columns):
            got = list(taken[c])
            assert len(got) == len(then[c])
            assert all(torch.equal(g.reshape(-1), t.reshape(-1)) for g, t in zip(got, then[c]))
            assert not all(torch.equal(g.reshape(-1), t.reshape(-1))
                           for g, t in zip(got, later[c])), key
    finally:
        engine.close()
