"""``client_state`` of ``engine.save_checkpoint``: any value the safe loader takes back,
round-tripped exactly (tensors on the CPU), refused at the save with the value's path
and type when it would not load, its file covered by the checksums, and the JSON
client_state of older checkpoints still returned. One process, ``ParallelState.single()``."""

import argparse
import json
import os
import time
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid import deepspeed
from hybrid.checkpoint import allow_client_state_types, client_state as client
from hybrid.checkpoint.integrity import verify_checkpoint
from hybrid.errors import CheckpointError
from hybrid.parallel.state import ParallelState

DS = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
      "zero_optimization": {"stage": 1}}


class Opt:
    """A script's own class, not on the allow-list."""

    def __init__(self, beta: float):
        self.beta = beta


@pytest.fixture(autouse=True)
def _own_allow_list(monkeypatch):
    monkeypatch.setattr(client, "_ADDED", [])  # allow_client_state_types is per process


def _engine():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    return deepspeed.initialize(model=net, config=DS, mpu=ParallelState.single())[0]


def test_tensors_namespaces_and_nested_values_round_trip_exactly(tmp_path):
    engine = _engine()
    weights = torch.randn(3, 2, dtype=torch.bfloat16)
    state = {"epoch": 3, "args": argparse.Namespace(lr=0.5, layers=[1, 2], path=None),
             "rng": torch.get_rng_state(), "ema": {"w": weights, "steps": (1, 2)},
             "history": [1.5, {"loss": torch.tensor([0.25, 0.5])}, OrderedDict(a=1)],
             7: "an int key", "np": {"arr": np.arange(4, dtype=np.int16),
                                     "scalar": np.float32(2.5)}}
    path = engine.save_checkpoint(str(tmp_path), client_state=state)
    assert sorted(os.listdir(path)) == ["client_state.pt", "metadata.json", "rank_00000.bin",
                                        "rank_00000.pt"]
    meta = json.loads((tmp_path / "iter_0000000" / "metadata.json").read_text())
    assert "client_state" not in meta and meta["client_state_file"] == "client_state.pt"
    size = os.path.getsize(os.path.join(path, "client_state.pt"))
    assert meta["checksums"]["files"]["client_state.pt"][0] == size
    report = verify_checkpoint(path)  # the offline check reads it too
    assert report["damaged"] == [] and report["files"] == 4

    got_path, got = _engine().load_checkpoint(str(tmp_path))
    assert got_path == path and set(got) == set(state)
    assert got["epoch"] == 3 and got[7] == "an int key"  # an int key stays an int
    assert isinstance(got["args"], argparse.Namespace) and vars(got["args"]) == {
        "lr": 0.5, "layers": [1, 2], "path": None}
    assert got["ema"]["steps"] == (1, 2)  # a tuple stays a tuple
    for saved, loaded in ((state["ema"]["w"], got["ema"]["w"]), (state["rng"], got["rng"]),
                          (state["history"][1]["loss"], got["history"][1]["loss"])):
        assert loaded.device == torch.device("cpu") and loaded.dtype == saved.dtype
        assert torch.equal(loaded, saved)
    assert got["history"][0] == 1.5 and got["history"][2] == OrderedDict(a=1)
    assert got["np"]["arr"].dtype == np.int16 and got["np"]["arr"].tolist() == [0, 1, 2, 3]
    assert type(got["np"]["scalar"]) is np.float32 and got["np"]["scalar"] == 2.5


def test_a_type_off_the_allow_list_is_refused_at_the_save_then_allowed(tmp_path):
    engine = _engine()
    with pytest.raises(ValueError) as e:
        engine.save_checkpoint(str(tmp_path), client_state={
            "args": argparse.Namespace(lr=1.0, opt=Opt(0.9))})
    assert str(e.value) == (
        "save_checkpoint(client_state=...): client_state['args'].opt is a "
        f"{__name__}.Opt, which hybrid's safe loader does not accept: to accept it, call "
        f"hybrid.checkpoint.allow_client_state_types({__name__}.Opt) on every rank before "
        "save_checkpoint and load_checkpoint; or store it as plain values (dicts, lists, "
        "numbers, strings, tensors); nothing was written")
    assert not (tmp_path / "iter_0000000").exists() and not (tmp_path / "latest").exists()
    with pytest.raises(ValueError, match=r"client_state\['q'\] is a collections.deque, .*"
                                         r"cannot rebuild even when allowed .*store it as a list"):
        engine.save_checkpoint(str(tmp_path), client_state={"q": deque([1, 2])})
    with pytest.raises(ValueError, match=r"client_state\['f'\]\[1\] is a function, which "
                                         r"cannot be pickled"):
        engine.save_checkpoint(str(tmp_path), client_state={"f": [1, lambda: 0]})

    allow_client_state_types(Opt)
    engine.save_checkpoint(str(tmp_path), client_state={"opt": Opt(0.9)})
    got = _engine().load_checkpoint(str(tmp_path))[1]
    assert type(got["opt"]) is Opt and got["opt"].beta == 0.9
    client._ADDED.clear()  # a resuming process that did not allow it: the error says so
    with pytest.raises(CheckpointError, match=rf"client_state.pt: the client_state saved there "
                                              rf"holds {__name__}.Opt, .*allow_client_state_"
                                              rf"types\({__name__}.Opt\)"):
        _engine().load_checkpoint(str(tmp_path))


def test_a_damaged_or_missing_client_state_file_is_one_error_naming_it(tmp_path):
    path = _engine().save_checkpoint(str(tmp_path), client_state={"t": torch.ones(8)})
    file = os.path.join(path, "client_state.pt")
    data = bytearray(Path(file).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(file).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"^{file}: bytes \[0, {len(data)}\) do not "
                                              r"match their saved checksum"):
        _engine().load_checkpoint(str(tmp_path))
    assert f"{file}: bytes [0, {len(data)})" in verify_checkpoint(path)["damaged"][0]
    os.remove(file)
    with pytest.raises(CheckpointError, match=rf"^{file}: missing checkpoint file$"):
        _engine().load_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"^f.pt: corrupt or truncated client_state"):
        client.decode(b"not a torch file", "f.pt")


def test_an_older_checkpoint_with_a_json_client_state_still_loads(tmp_path):
    """The format before client_state.pt: the state as JSON in metadata.json, no file."""
    path = _engine().save_checkpoint(str(tmp_path), client_state={"x": torch.zeros(1)})
    meta_path = os.path.join(path, "metadata.json")
    meta = json.loads(Path(meta_path).read_text())
    del meta["client_state_file"], meta["checksums"]["files"]
    meta["client_state"] = {"epoch": 7, "best": [0.5, "ckpt"]}
    Path(meta_path).write_text(json.dumps(meta))
    os.remove(os.path.join(path, "client_state.pt"))
    assert _engine().load_checkpoint(str(tmp_path)) == (path, {"epoch": 7,
                                                                 "best": [0.5, "ckpt"]})


def _two_ranks(ps, save):
    from hybrid import deepspeed
    torch.manual_seed(0)
    engine = deepspeed.initialize(model=torch.nn.Linear(4, 2), config=DS, mpu=ps)[0]
    refused = None
    try:  # rank 0's state is the one checked and saved: its refusal is every rank's
        engine.save_checkpoint(save, client_state={"bad": Opt(1.0)} if ps.rank == 0 else {})
    except ValueError as e:
        refused = str(e)
    mine = {"rank": ps.rank, "t": torch.full((2,), float(ps.rank)),
            "args": argparse.Namespace(seed=ps.rank)}
    engine.save_checkpoint(save, client_state=mine)
    path, got = engine.load_checkpoint(save)
    return {"refused": refused, "path": path, "rank": got["rank"], "t": got["t"].tolist(),
            "seed": got["args"].seed}


def test_every_rank_gets_rank_0s_client_state_and_its_refusal(tmp_path):
    from tests.helpers.harness import run_ranks
    out = run_ranks(_two_ranks, world_size=2, args=(str(tmp_path),))
    assert out[0]["refused"] == out[1]["refused"] and "client_state['bad'] is a" in out[0][
        "refused"]
    for r in out:  # rank 0's values, on both ranks
        assert (r["path"], r["rank"], r["t"], r["seed"]) == (
            str(tmp_path / "iter_0000000"), 0, [0.0, 0.0], 0)


def _each_rank_its_own_dir(ps, root):
    """HelloDeepSpeed names its save directory by the clock on each rank: ranks that read
    the clock in different seconds pass different directories."""
    from hybrid import deepspeed
    torch.manual_seed(0)
    engine = deepspeed.initialize(model=torch.nn.Linear(4, 2), config=DS, mpu=ps)[0]
    path = engine.save_checkpoint(os.path.join(root, f"run.{ps.rank}"))
    return {"path": path, "listing": sorted(os.listdir(root))}


def test_ranks_passing_different_save_dirs_write_one_checkpoint_in_rank_0s(tmp_path):
    from tests.helpers.harness import run_ranks
    out = run_ranks(_each_rank_its_own_dir, world_size=2, args=(str(tmp_path),))
    assert [r["path"] for r in out] == [str(tmp_path / "run.0" / "iter_0000000")] * 2
    assert out[1]["listing"] == ["run.0"]  # (rank 1's own name never made)
    files = set(os.listdir(tmp_path / "run.0" / "iter_0000000"))
    assert {"metadata.json", "rank_00000.bin", "rank_00001.bin"} <= files, files


def test_a_decoupled_writer_saves_in_the_background_the_same_bytes(tmp_path, monkeypatch):
    """``checkpoint.writer.decoupled`` (--async-save): save_checkpoint returns once the
    values are copied; with the write held back, the tag is not there (nor in ``latest``)
    until a later step finds every rank done, and then its files equal, byte for byte, a
    synchronous save's of the same step; its client state loads back."""
    from hybrid.checkpoint.save import PendingSave

    gate, write = [], PendingSave.write

    def held_write(pending):
        while not gate:
            time.sleep(0.01)
        write(pending)

    def engine(config):
        e = _engine_with(config)
        x = torch.ones(2, 4)
        e.backward(e(x).sum())
        e.step()
        return e

    sync = engine(DS)
    done = sync.save_checkpoint(str(tmp_path / "sync"), tag="t1", client_state={"epoch": 1})
    monkeypatch.setattr(PendingSave, "write", held_write)
    asyn = engine({**DS, "checkpoint": {"writer": {"decoupled": True}}})
    path = asyn.save_checkpoint(str(tmp_path / "async"), tag="t1", client_state={"epoch": 1})
    assert not os.path.exists(path) and not (tmp_path / "async" / "latest").exists()
    gate.append(1)
    while asyn.saver.in_flight:  # (a step polls; the thread ends soon after the gate)
        asyn.backward(asyn(torch.ones(2, 4)).sum())
        asyn.step()
    assert (tmp_path / "async" / "latest").read_text().strip() == "t1"
    for name in ("rank_00000.bin", "rank_00000.pt", "client_state.pt"):
        assert (Path(path) / name).read_bytes() == (Path(done) / name).read_bytes()
    assert _engine_with(DS).load_checkpoint(str(tmp_path / "async"))[1] == {"epoch": 1}
    asyn.close()


def _engine_with(config):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    return deepspeed.initialize(model=net, config=config, mpu=ParallelState.single())[0]
