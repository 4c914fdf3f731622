"""Bad input around the peers' checkpoints, as a user meets it (the acceptance pass of
docs/checkpoints.md): files of two DeepSpeed saves mixed, a format forced on another
format's checkpoint, a ``--save`` directory holding a peer's checkpoint, a legacy Megatron
file of a version whose layout hybrid does not read, an export or an import on a full
disk, a tool given a peer's checkpoint, an export into a hybrid save directory or another
model's DeepSpeed one. Each is one CheckpointError naming the file or the flag, and
nothing is left behind. And --finetune from a peer's checkpoint, which was refused. On
the committed fixtures, on one process (the finetune: one pooled rank)."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import sys

import pytest
import torch

from hybrid.checkpoint.peers import open_peer
from hybrid.errors import CheckpointError
from tests.checkpoint.test_peer_deepspeed import _copy as _copy_deepspeed
from tests.checkpoint.test_peer_megatron import FIXTURE, LEGACY

DEEPSPEED = os.path.join(os.path.dirname(FIXTURE), "deepspeed-0.19.8")


def test_a_zero0_model_state_file_beside_zero_optimizer_files_is_one_error(tmp_path):
    """A stage-0 save's model-state file (param_shapes None) copied over a ZeRO 2 save's:
    one line naming the file, not a TypeError."""
    d = _copy_deepspeed("gpt2_zero2", tmp_path)
    model = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
    shutil.copy(os.path.join(DEEPSPEED, "gpt2_zero0", "global_step3",
                             "mp_rank_00_model_states.pt"), model)
    with pytest.raises(CheckpointError, match=rf"^{model}: param_shapes None \(a save without "
                                              rf"ZeRO\) beside ZeRO's files: files of two"):
        open_peer(d)


def test_a_format_forced_on_another_format_s_checkpoint_names_the_flag(tmp_path):
    """--load-format megatron on a DeepSpeed save, dcp on a Megatron one, hybrid on a
    Megatron one: the flag and the format the files show, not a missing file of the
    forced format's or 'which hybrid does not read'."""
    from hybrid.checkpoint.peers.importing import import_for_load
    from hybrid.parallel.state import ParallelState
    gpt2 = os.path.join(DEEPSPEED, "gpt2_zero2")
    with pytest.raises(CheckpointError, match=rf"^--load-format megatron: {gpt2} holds a "
                                              rf"deepspeed checkpoint, not a megatron one"):
        open_peer(gpt2, "megatron")
    with pytest.raises(CheckpointError, match=rf"^--load-format dcp: {FIXTURE} holds a "
                                              rf"megatron checkpoint"):
        open_peer(FIXTURE, "dcp")
    save = str(tmp_path / "save")
    with pytest.raises(CheckpointError, match=rf"^--load-format hybrid: --load {FIXTURE} "
                                              rf"holds a megatron checkpoint, not a hybrid"):
        import_for_load(FIXTURE, save, ParallelState.single(), {}, None, "hybrid")
    assert not os.path.exists(save)


def test_a_save_directory_holding_a_peer_s_checkpoint_is_refused(tmp_path):
    """--save on a DeepSpeed save directory: refused before anything is written (hybrid's
    ``latest`` replaced DeepSpeed's, which then named no tag DeepSpeed could load); on
    a Megatron one, the message names --save, not --load."""
    from hybrid.checkpoint.ownership import RunIdentity, claim_save_dir
    from hybrid.config.sections import CheckpointConfig
    from hybrid.parallel.state import ParallelState
    run = RunIdentity("test", "host", 1, 0.0)
    for name, src, fmt in (("ds", os.path.join(DEEPSPEED, "gpt2_zero2"), "DeepSpeed"),
                           ("mg", FIXTURE, "Megatron-LM")):
        d = str(tmp_path / name)
        shutil.copytree(src, d)
        before = sorted(os.listdir(d))
        ck = CheckpointConfig(save=d, load=str(tmp_path / "elsewhere"))
        with pytest.raises(CheckpointError, match=rf"^--save {d} holds a {fmt} checkpoint "
                                                  rf"\({d}/\S+\): hybrid's saves there"):
            claim_save_dir(ck, ParallelState.single(), run, {"num_layers": 2})
        assert sorted(os.listdir(d)) == before  # (not even the lock)


def test_a_legacy_megatron_file_of_another_checkpoint_version_is_one_error(tmp_path):
    """checkpoint_version 1.0 (Megatron-LM's QKV rows in another order) and a missing
    one (version 0): refused naming the file, not read into the wrong rows."""
    for version in (1.0, None):
        d = tmp_path / f"v{version}"
        shutil.copytree(LEGACY, d)
        for rank in ("00", "01"):
            path = d / "iter_0000003" / f"mp_rank_{rank}" / "model_optim_rng.pt"
            sd = torch.load(path, weights_only=False)
            sd.pop("checkpoint_version")
            torch.save(sd if version is None else dict(sd, checkpoint_version=version), path)
        first = d / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
        with pytest.raises(CheckpointError, match=rf"^{first}: checkpoint_version "
                                                  rf"{version or 0}; hybrid reads"):
            open_peer(str(d))


@contextlib.contextmanager
def _disk_full_after(nbytes: int):
    """Writes past ``nbytes`` of any file fail with EFBIG (RLIMIT_FSIZE: Python ignores
    SIGXFSZ), a full disk's error for the writers. No bytecode is cached meanwhile: a
    module imported under the limit would leave a cut .pyc (one short write), which every
    later import of it fails on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    was = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        sys.dont_write_bytecode = was


def test_an_export_on_a_full_disk_is_one_error_and_leaves_nothing(tmp_path):
    """export --to megatron | dcp | deepspeed when the disk fills: one CheckpointError
    naming the output, no temporary directory left (before: a traceback, and
    ``.tmp_iter_*`` / ``.tmp_step-*`` / ``.tmp_global_step*`` left in OUT)."""
    from hybrid.checkpoint.peers import dcp_export, deepspeed, megatron
    from hybrid.checkpoint.peers.importing import import_peer
    llama = import_peer(open_peer(LEGACY), str(tmp_path / "llama"), {}, None)
    gpt2 = import_peer(open_peer(os.path.join(DEEPSPEED, "gpt2_zero2")),
                       str(tmp_path / "gpt2"), {"hidden_dropout": 0.0, "attention_dropout": 0.0,
                                                "init_method_std": 0.02}, None)
    writers = {"megatron": lambda out: megatron.write(llama, out),
               "dcp": lambda out: dcp_export.write(llama, out),
               "deepspeed": lambda out: deepspeed.write(gpt2, out, 2, 2)}
    for name, write in writers.items():
        out = str(tmp_path / name)
        with _disk_full_after(8192), pytest.raises(CheckpointError) as e:
            write(out)
        said = str(e.value)
        assert said.startswith(f"{out}") and "File too large" in said, (name, said)
        assert "\n" not in said, (name, said)
        assert [n for n in os.listdir(out) if n.startswith(".")] == [], name
    # a truncated shard of the checkpoint: its own message, and no .tmp_global_step3 left
    shard = os.path.join(gpt2, "rank_00000.bin")
    os.truncate(shard, os.path.getsize(shard) // 2)
    out = str(tmp_path / "truncated")
    with pytest.raises(CheckpointError, match=rf"^{shard}: corrupt or truncated"):
        writers["deepspeed"](out)
    assert os.listdir(out) == []


def test_an_import_on_a_full_disk_names_save(tmp_path):
    """The import's write failing (a full --save disk) says --save and the load, not a
    bare '[Errno 27] File too large'; nothing is published."""
    from hybrid.checkpoint.peers.importing import import_for_load
    from hybrid.parallel.state import ParallelState
    save = str(tmp_path / "save")
    with _disk_full_after(8192), pytest.raises(CheckpointError) as e:
        import_for_load(LEGACY, save, ParallelState.single(), {}, None)
    said = str(e.value)
    assert said.startswith(f"--save {save}: the import of {LEGACY} failed (") and (
        "File too large" in said), said
    assert [n for n in os.listdir(save) if n.startswith("iter_")] == []


def test_a_tool_given_a_peer_s_checkpoint_says_to_import_it_first(tmp_path, capsys):
    """convert_checkpoint.py export of a DeepSpeed save directory (not a hybrid one):
    one line saying the tool reads hybrid checkpoints and how to import it, exit 2 and
    no output (before: "which hybrid does not read ... point --load at ...")."""
    from tests.helpers.launch import script_module
    gpt2, out = os.path.join(DEEPSPEED, "gpt2_zero2"), str(tmp_path / "out")
    assert script_module("convert_checkpoint").main(
        ["export", "--to", "megatron", gpt2, out]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"convert_checkpoint.py: error: {gpt2} holds a DeepSpeed "
                           f"checkpoint (") and "import it first" in said, said
    assert "\n" not in said and not os.path.exists(out)


def test_an_export_into_a_hybrid_save_directory_or_another_model_s_is_refused(tmp_path,
                                                                             capsys):
    """export's output given as the checkpoint's own --save directory (DeepSpeed's
    ``latest`` replaced hybrid's there), or a DeepSpeed save directory of another model
    (its config.json, which its tags are read with, replaced): exit 2, one line, nothing
    written."""
    from hybrid.checkpoint.peers.importing import import_peer
    from tests.helpers.launch import script_module
    convert = script_module("convert_checkpoint").main
    save = str(tmp_path / "save")
    import_peer(open_peer(os.path.join(DEEPSPEED, "gpt2_zero2")), save,
                {"hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02},
                None)
    before = sorted(os.listdir(save))
    for to in ("deepspeed", "megatron", "dcp"):
        assert convert(["export", "--to", to, save, save]) == 2, to
        said = capsys.readouterr().err.strip()
        assert said == (f"convert_checkpoint.py: error: {save}: holds hybrid checkpoints "
                        f"(iter_0000003), which the export would write beside (DeepSpeed's "
                        f"latest over hybrid's): give a new output directory"), said
    assert sorted(os.listdir(save)) == before
    other = _copy_deepspeed("gpt2_zero2", tmp_path / "other")
    config = os.path.join(other, "config.json")
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace('"n_layer": 2', '"n_layer": 4'))
    before = sorted(os.listdir(other))
    again = ["--dp-size", "2", "--tag", "global_step3_again"]
    assert convert(["export", "--to", "deepspeed", save, other, *again]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"convert_checkpoint.py: error: {config}: another model's "
                           f"config.json (n_layer differ)"), said
    assert sorted(os.listdir(other)) == before
    # the same model's DeepSpeed directory takes the export beside its own tag
    shutil.copy(os.path.join(DEEPSPEED, "gpt2_zero2", "config.json"), config)
    assert convert(["export", "--to", "deepspeed", save, other, *again]) == 0


def test_finetune_from_a_peer_s_checkpoint_imports_it_beside_the_new_series(tmp_path):
    """--finetune --load DS_DIR --save NEW (it said "which hybrid does not read"): the
    import goes to NEW/.finetune_import, and the series starts at iteration 1 from its
    weights (the finetune record of the series' checkpoint names it)."""
    from hybrid.checkpoint import read_metadata
    from tests.checkpoint.test_peer_deepspeed import _recorder
    from tests.helpers.launch import pretrain, read_json_log
    gpt2, save, log = os.path.join(DEEPSPEED, "gpt2_zero2"), tmp_path / "ft", tmp_path / "log"
    r = pretrain(1, [*_recorder().GPT_ARGS, "--train-iters", "1", "--finetune", "--load",
                     gpt2, "--save", str(save), "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [m["iteration"] for m in read_json_log(str(log))] == [1]
    assert sorted(os.listdir(save)) == [".finetune_import", ".lock", "iter_0000001",
                                        "latest", "owner.json"]
    origin = read_metadata(str(save / "iter_0000001"))["finetune"]
    assert origin == {"load": gpt2, "iteration": 3, "checkpoint": str(
        save / ".finetune_import" / "iter_0000003")}, origin


def test_a_megatron_release_checkpoint_is_found_and_a_dangling_latest_said(tmp_path):
    """Megatron-LM's ``release`` (latest_checkpointed_iteration.txt saying "release",
    its converters' output) is detected and read (it was 'which hybrid does not read');
    a DeepSpeed ``latest`` naming a tag that is not there is said to be incomplete."""
    from hybrid.checkpoint.files import find_checkpoint
    from hybrid.checkpoint.peers import detect_peer
    d = tmp_path / "released"
    shutil.copytree(LEGACY, d)
    os.rename(d / "iter_0000003", d / "release")
    (d / "latest_checkpointed_iteration.txt").write_text("release")
    assert detect_peer(str(d)) == "megatron"
    peer = open_peer(str(d))
    assert (peer.path, peer.iteration) == (str(d / "release"), 3)
    ds = _copy_deepspeed("gpt2_zero2", tmp_path)
    with open(os.path.join(ds, "latest"), "w") as f:
        f.write("global_step9")
    assert detect_peer(ds) is None
    with pytest.raises(CheckpointError, match=rf"^{ds} holds a DeepSpeed checkpoint .*: "
                                              rf"incomplete \(a latest naming a tag"):
        find_checkpoint(ds)


def test_a_peer_s_smaller_vocabulary_names_the_peer_s_tokenizer_not_the_run_s():
    """A peer checkpoint of 64 tokens loaded by a run whose tokenizer has 100: the line
    says the checkpoint's vocabulary came with the peer's run's tokenizer; the config an
    import carries is the importing run's, so its ``--tokenizer-type`` (here byte) is not
    the peer's and is not named."""
    from hybrid.checkpoint.load import check_model
    shapes = {"wte.weight": [64, 8]}
    meta = {"model": shapes, "config": {"tokenizer_type": "byte"}, "vocab_size": 64}
    with pytest.raises(CheckpointError) as e:
        check_model({**meta, "imported_from": {"format": "megatron"}}, None, 100, "X", shapes)
    assert "64 tokens (its megatron run's tokenizer), this run's tokenizer has 100" in str(e.value)
    assert "byte" not in str(e.value)
    with pytest.raises(CheckpointError, match=r"64 tokens \(--tokenizer-type byte\)"):
        check_model(meta, None, 100, "X", shapes)  # (hybrid's own: its flag)
