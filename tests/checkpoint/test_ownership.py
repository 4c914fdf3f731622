"""A --save directory belongs to one run (hybrid.checkpoint.ownership).

Each case goes through scripts/pretrain_gpt.py's path (pooled ranks): a new run on
another run's checkpoints, a second job on a held directory, a stale lock of a
SIGKILLed job, resuming, --overwrite-save, and an unwritable --save. Without the
claim the first two exited 0 with the other run's checkpoints overwritten.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, TINY, env, pretrain, read_json_log

ARGS = TINY + ["--global-batch-size", "8", "--tensor-model-parallel-size", "1",
               "--zero-stage", "1", "--train-iters", "2"]


def _tree(directory):
    """{relative path: bytes} of every file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = fh.read()
    return out


def _fails(r, *needles):
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.fixture(scope="module")
def used(tmp_path_factory):
    """A --save directory holding one run's checkpoint (iteration 2)."""
    save = str(tmp_path_factory.mktemp("owner") / "ckpt")
    r = pretrain(2, ARGS + ["--save", save])
    assert r.returncode == 0, r.stderr[-3000:]
    return save


def _copy(used, tmp_path):
    import shutil
    dst = str(tmp_path / "ckpt")
    shutil.copytree(used, dst)
    return dst


def test_a_new_run_on_another_run_s_checkpoints_is_refused(used, tmp_path):
    """Same model or another: one line naming the directory, the other run (from the
    record its saves wrote) and the three ways on; not one byte under the directory
    changes."""
    save = _copy(used, tmp_path)
    before = _tree(save)
    with open(os.path.join(save, "owner.json")) as f:
        record = json.load(f)  # written with the checkpoint by the run that saved it
    assert record["host"] and record["pid"] and record["model"]["fields"]["hidden_size"] == 64
    _fails(pretrain(2, ARGS + ["--save", save, "--train-iters", "4"]),
           f"--save {save} already holds checkpoints of another run (iter_0000002, a run of "
           f"host {record['host']}, pid {record['pid']}",
           f"add --load {save}", "add --overwrite-save", "--finetune")
    wider = ARGS + ["--save", save]
    wider[wider.index("--hidden-size") + 1] = "128"
    _fails(pretrain(2, wider), "a different model: hidden_size 64 there, 128 here")
    assert _tree(save) == before


def test_resuming_the_directory_is_silent_and_overwrite_save_starts_over(used, tmp_path):
    save = _copy(used, tmp_path)
    r = pretrain(2, ARGS + ["--save", save, "--load", save, "--train-iters", "3"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "taking it over" not in r.stdout and "another run" not in r.stdout
    assert "validation split is empty" not in r.stdout  # (no validation falls due)
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == [
        "iter_0000002", "iter_0000003"]
    log = str(tmp_path / "log.jsonl")
    r = pretrain(2, ARGS + ["--save", save, "--overwrite-save", "--train-iters", "1",
                            "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--overwrite-save: deleted 2 checkpoint(s) of another run" in r.stdout
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000001"]
    assert [m["iteration"] for m in read_json_log(log)] == [1]


_HOLD = """
import sys, time
from hybrid.checkpoint.ownership import RunIdentity, SaveDirClaim, model_shape
SaveDirClaim.take(sys.argv[1], RunIdentity.of_launch(), model_shape({}), resuming=True)
print("held", flush=True)
time.sleep(600)
"""


def _holder(save):
    """A process holding ``save`` as a training job would (its claim), until killed."""
    p = subprocess.Popen([sys.executable, "-c", _HOLD, save], stdout=subprocess.PIPE,
                         text=True, env=env(), cwd=ROOT)
    assert p.stdout.readline() == "held\n"
    return p


def test_a_second_job_on_a_held_directory_is_refused_and_a_dead_holder_taken_over(
        used, tmp_path):
    """While a job holds the directory, another is refused naming the holder (host, pid,
    start time) and changes nothing; once that job is SIGKILLed (its words stay in the
    lock file, the lock goes with it), the next run takes the directory over and says
    so in one line."""
    import socket
    save = _copy(used, tmp_path)
    holder = _holder(save)
    before = _tree(save)
    try:
        _fails(pretrain(2, ARGS + ["--save", save, "--load", save, "--train-iters", "3"]),
               f"--save {save} is in use by another job (host {socket.gethostname()}, pid "
               f"{holder.pid}, started ", "give this job another --save directory")
        assert _tree(save) == before
    finally:
        holder.kill()
        holder.wait()
    with open(os.path.join(save, ".lock")) as f:
        assert json.load(f)["pid"] == holder.pid  # the dead holder's words are still there
    r = pretrain(2, ARGS + ["--save", save, "--load", save, "--train-iters", "3"])
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in r.stdout.splitlines() if "taking it over" in line]
    assert len(said) == 1 and said[0].startswith(
        f"--save {save}: taking it over from a job that ended without releasing it (host "
        f"{socket.gethostname()}, pid {holder.pid}, started "), r.stdout
    assert os.path.getsize(os.path.join(save, ".lock")) == 0  # released cleanly


def test_an_unwritable_save_is_refused_before_training(tmp_path):
    """A --save under a file, or under /proc: refused at start with the flag named,
    before any iteration (it used to fail at the first save, after the training)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    log = str(tmp_path / "log.jsonl")
    for bad in (str(blocker / "ckpt"), "/proc/hybrid_ckpt"):
        _fails(pretrain(2, ARGS + ["--save", bad, "--log-json", log]),
               f"--save {bad}: cannot write there", "give --save a directory this job can write")
        assert not os.path.exists(log)
    assert blocker.read_text() == "x"


def test_a_torchrun_restart_is_the_same_run():
    """The identity a worker derives is the launch's: the same torchrun run id and agent
    (the worker's parent) give the same run, another launch another run."""
    from hybrid.checkpoint.ownership import RunIdentity
    launch = {"TORCHELASTIC_RUN_ID": "abc"}
    a, b = RunIdentity.of_launch(launch), RunIdentity.of_launch(launch)
    assert a.id == b.id and "abc" in a.id
    assert RunIdentity.of_launch({"TORCHELASTIC_RUN_ID": "def"}).id != a.id
    assert RunIdentity.of_launch({}).id != RunIdentity.of_launch({}).id


def test_the_qwen3_shape_flags_change_the_model_fingerprint_only_when_set():
    """--kv-channels and --qk-layernorm fix parameter shapes, so they are part of the
    model a save directory holds; unset, the fingerprint is the one records written
    before the flags existed hold."""
    from hybrid.checkpoint.ownership import model_shape
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    plain = model_shape(base)["fingerprint"]
    assert model_shape(dict(base, kv_channels=None, qk_layernorm=False))["fingerprint"] == plain
    prints = {model_shape(dict(base, **kw))["fingerprint"]
              for kw in ({"kv_channels": 32}, {"qk_layernorm": True},
                         {"kv_channels": 32, "qk_layernorm": True})}
    assert len(prints) == 3 and plain not in prints
