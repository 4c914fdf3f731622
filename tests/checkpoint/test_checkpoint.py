"""Checkpoints: exact resume, resharding, kill-and-restart, crashes mid-save, bad input."""

import hashlib
import os
import signal
import subprocess
import time

import pytest

from tests.helpers.launch import ROOT, TINY, child_pids, env, pretrain, read_json_log, run_script

ITERS = 6
BASE = TINY + ["--global-batch-size", "8", "--train-iters", str(ITERS)]


def _args(tp, stage, *extra):
    return BASE + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage),
                   "--zero-param-persistence-threshold", "0", *extra]


def _losses(path):
    return [m["loss"] for m in read_json_log(path)]


def _ok(r):
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def _digest(directory):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for f in sorted(files):
            h.update(f.encode())
            with open(os.path.join(root, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _save_at_2_and_resume(tmp_path, world, tp, stage, *extra):
    """(uninterrupted log from iteration 3 on, resumed log): save at 2 of 4, resume. (Two
    steps after the resume: the first on the loaded Adam moments, step count and RNG
    states, the second on moments it updated; ITERS' 6 with a save at 3 checked nothing
    more, for half again the steps.)"""
    full, resumed, save = (str(tmp_path / "full.jsonl"), str(tmp_path / "res.jsonl"),
                           str(tmp_path / "ckpt"))
    iters = ["--train-iters", "4"]  # (after BASE's: the last one wins)
    _ok(pretrain(world, _args(tp, stage, *extra, *iters, "--save", save, "--save-interval",
                              "2", "--log-json", full)))
    os.remove(os.path.join(save, "latest"))  # resume from iteration 2, not the final save
    import shutil
    shutil.rmtree(os.path.join(save, "iter_0000004"))
    _ok(pretrain(world, _args(tp, stage, *extra, *iters, "--load", save,
                              "--log-json", resumed)))
    return read_json_log(full)[2:], read_json_log(resumed)


@pytest.mark.parametrize("stage", [2, 3])
def test_exact_resume_is_bit_identical(tmp_path, stage):
    """TP2 x DP2, dropout on: save at 2 of 4, resume: losses and gradient norms
    3..4 equal to the last bit. (Stages 0 and 1 save and load through the same owned
    pieces; test_reshard_continues_the_same_curve loads into both and continues the
    curve.) Stage 2 keeps its optimizer on the nvme tier: the
    checkpoint streams from the swap files, the restart rebuilds them from it, and
    a clean exit deletes them. Stage 3 keeps its parameter shards in params.swp (the
    optimizer on the host): the loaded master goes home unit by unit."""
    flags = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    swap = tmp_path / "swap"
    if stage == 2:  # buffers smaller than a rank's optimizer state: it streams in tiles
        flags += ["--offload-optimizer", "nvme", "--offload-nvme-path", str(swap),
                  "--offload-buffer-size", "65536", "--offload-buffer-count", "2"]
    else:
        flags += ["--offload-optimizer", "cpu", "--offload-param", "nvme",
                  "--offload-nvme-path", str(swap)]
    full, resumed = _save_at_2_and_resume(tmp_path, 4, 2, stage, *flags)
    assert len(resumed) == len(full) == 2
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in full]
    assert full[0]["model_state_bytes"]["disk"] > 0
    if stage == 2:
        assert sorted(os.listdir(swap)) == [f"rank{r:05d}" for r in range(4)]
        assert not [f for r in os.listdir(swap) for f in os.listdir(swap / r) if f != ".lock"]


def test_exact_resume_with_sequence_parallel_dropout_and_selective_recompute(tmp_path):
    """SP's dropout draws from the per-TP-rank stream, and selective recompute replays
    it: with both, ZeRO-3 at TP2 x DP2, the resumed run still equals the uninterrupted
    one to the last bit."""
    flags = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--sequence-parallel",
             "--recompute-activations"]
    full, resumed = _save_at_2_and_resume(tmp_path, 4, 2, 3, *flags)
    assert len(resumed) == len(full) == 2
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in full]


RESHARD_ITERS = 4  # saved at 2: two steps after each reshard (as _save_at_2_and_resume)


@pytest.fixture(scope="module")
def stage3_checkpoint(tmp_path_factory):
    """TP2 x DP2 ZeRO-3 run saved at iteration 2 (of 4), and its uninterrupted curve."""
    tmp = tmp_path_factory.mktemp("reshard")
    save, log = str(tmp / "ckpt"), str(tmp / "full.jsonl")
    iters = ["--train-iters", str(RESHARD_ITERS)]
    _ok(pretrain(4, _args(2, 3, *iters, "--save", save, "--save-interval", "2",
                          "--keep-last", "1", "--log-json", log)))
    # keep-last 1 left only the final save; make the iteration-2 one again for resharding
    _ok(pretrain(4, _args(2, 3, "--save", str(tmp / "at2"), "--train-iters", "2")))
    return str(tmp / "at2"), _losses(log), save


@pytest.mark.parametrize("tp,dp,stage", [(1, 4, 1), (4, 1, 0), (1, 2, 2), (2, 1, 3)])
def test_reshard_continues_the_same_curve(stage3_checkpoint, tmp_path, tp, dp, stage):
    ckpt, curve, _ = stage3_checkpoint
    log = str(tmp_path / "re.jsonl")
    _ok(pretrain(tp * dp, _args(tp, stage, "--train-iters", str(RESHARD_ITERS), "--load", ckpt,
                                "--log-json", log)))
    for a, b in zip(_losses(log), curve[2:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_keep_last_prunes_only_after_a_complete_save(stage3_checkpoint):
    _, _, save = stage3_checkpoint
    assert sorted(os.listdir(save)) == [".lock", "iter_0000004", "latest", "owner.json"]


def test_convert_merges_into_one_file_equal_to_the_shards(stage3_checkpoint, tmp_path):
    import torch

    from hybrid.checkpoint.reshard import merged_state
    ckpt = stage3_checkpoint[0]
    out = str(tmp_path / "merged.pt")
    r = run_script("convert_checkpoint", [ckpt, out])
    assert r.returncode == 0, r.stderr
    merged = torch.load(out)
    _, state = merged_state(os.path.join(ckpt, "iter_0000002"))
    assert set(merged["model"]) == set(state)
    for n, s in state.items():
        assert torch.equal(merged["model"][n], s["master"])
    assert merged["model"]["blocks.0.attn.qkv.weight"].shape == (192, 64)  # full, not a shard
    again = run_script("convert_checkpoint", [ckpt, out])
    assert again.returncode == 2 and "not overwriting" in again.stderr


def test_sigkill_of_one_rank_restarts_from_the_last_checkpoint(tmp_path):
    """scripts/pretrain_gpt.sh with MAX_RESTARTS=1 (torchrun --max-restarts 1 through the
    product's launcher): SIGKILL rank 1 after the first save; the launcher says in one line
    who died, how, and where the job resumes; the restarted job resumes from there and
    ends with the uninterrupted run's final loss."""
    ref_log, log, save = (str(tmp_path / "ref.jsonl"), str(tmp_path / "run.jsonl"),
                          str(tmp_path / "ckpt"))
    _ok(pretrain(2, _args(1, 1, "--train-iters", "16", "--log-json", ref_log)))
    cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"),
           *_args(1, 1, "--train-iters", "16", "--save-interval", "4", "--save", save,
                  "--load", save, "--log-json", log)]
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    # Files, not pipes: nobody reads a pipe while we poll, and a full one blocks torchrun.
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True, cwd=ROOT,
                                env=dict(env(), NPROC_PER_NODE="2", MAX_RESTARTS="1"))
    killed = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(save, "latest")) and killed is None:
            workers = child_pids(proc.pid)
            if len(workers) == 2:
                killed = workers[1]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    try:
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = out_path.read_text(), err_path.read_text()
    assert killed is not None, f"no worker was killed before the run ended:\n{err[-3000:]}"
    assert proc.returncode == 0, err[-3000:]
    import re
    said = re.findall(rf"^pretrain_gpt\.sh: rank \d \(pid {killed}\) was killed by SIGKILL.*; "
                      r"restart 1 of 1, resuming from iteration (\d+) ", err, re.M)
    resumed = re.findall(r"resumed from \S+ at iteration (\d+)", out)
    assert said and said == resumed, err[-3000:]
    assert _losses(log)[-1] == _losses(ref_log)[-1]


# -- crashes and bad input: one clear error, non-zero exit, nothing existing touched --------

@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("small") / "ckpt")
    _ok(pretrain(2, _args(1, 1, "--train-iters", "2", "--save", save)))
    return save


def _copy(src, tmp_path):
    import shutil
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    return dst


def _fails_naming(r, *needles):
    assert r.returncode != 0
    for n in needles:
        assert n in r.stderr, r.stderr[-3000:]


def test_truncated_shard_is_named(small_checkpoint, tmp_path):
    ck = _copy(small_checkpoint, tmp_path)
    shard = os.path.join(ck, "iter_0000002", "rank_00001.pt")
    with open(shard, "r+b") as f:
        f.truncate(100)
    before = _digest(ck)
    r = pretrain(2, _args(1, 1, "--load", ck, "--save", ck, "--train-iters", "4"))
    _fails_naming(r, "rank_00001.pt", "corrupt or truncated")
    assert _digest(ck) == before


def test_missing_shard_and_corrupt_metadata_are_named(small_checkpoint, tmp_path):
    ck = _copy(small_checkpoint, tmp_path)
    os.remove(os.path.join(ck, "iter_0000002", "rank_00000.pt"))
    _fails_naming(pretrain(2, _args(1, 1, "--load", ck)), "rank_00000.pt", "missing")
    with open(os.path.join(ck, "iter_0000002", "metadata.json"), "w") as f:
        f.write("{not json")
    # metadata unreadable: the directory no longer counts as a complete checkpoint
    _fails_naming(pretrain(2, _args(1, 1, "--load", ck)), "metadata.json")


def test_checkpoint_of_another_model_shape_is_refused(small_checkpoint):
    args = _args(1, 1, "--load", small_checkpoint)
    args[args.index("--hidden-size") + 1] = "128"
    _fails_naming(pretrain(2, args), "different model", "--hidden-size")


def test_checkpoint_of_another_tokenizer_is_refused_even_when_the_padding_hides_it(
        small_checkpoint):
    """257 byte ids and 301 NullTokenizer ids both pad to 384 rows: same shapes."""
    _fails_naming(pretrain(2, _args(1, 1, "--load", small_checkpoint, "--mock-data",
                                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "300")),
                  "trained on a vocabulary of 257 tokens (--tokenizer-type byte), this run's "
                  "tokenizer has 301")


def test_one_process_model_pads_as_the_run_did_and_old_metadata_still_loads(
        small_checkpoint, tmp_path):
    """load_full_model (generate.py) rebuilds the model section from metadata.json's
    flags: the TP-1 model pads the vocabulary with the run's
    --make-vocab-size-divisible-by, and saved flags without it (an older checkpoint,
    or import_hf.py's few shape flags) pad with 128. The padding changes no logit."""
    import json

    import torch

    from hybrid.checkpoint.full_model import load_full_model
    ck = os.path.join(_copy(small_checkpoint, tmp_path), "iter_0000002")
    path = os.path.join(ck, "metadata.json")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    shape_only = {k: meta["config"][k] for k in ("num_layers", "hidden_size",
                                                 "num_attention_heads", "ffn_hidden_size",
                                                 "max_position_embeddings")}
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    rows, logits = [], []
    for config in (dict(meta["config"], make_vocab_size_divisible_by=1),
                   dict(meta["config"], make_vocab_size_divisible_by=64), shape_only):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dict(meta, config=config), f)
        model, _ = load_full_model(ck)
        rows.append(model.padded_vocab_size)
        with torch.no_grad():
            logits.append(model(x)[..., :257])
    assert rows == [257, 320, 384]
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0])


def test_tools_name_an_output_they_cannot_write(small_checkpoint, tmp_path, capsys):
    from tests.helpers.launch import script_module
    afile = tmp_path / "afile"
    afile.write_text("x")
    for tool, out, needle in (("convert_checkpoint", afile / "merged.pt", "cannot write"),
                              ("export_hf", afile / "hf", "cannot write the model there")):
        assert script_module(tool).main([small_checkpoint, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{tool}.py: error: {out}: {needle}") and err.count("\n") == 1, err
    assert afile.read_text() == "x"


def test_load_of_an_empty_directory_is_an_error(tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    _fails_naming(pretrain(2, _args(1, 1, "--load", empty)), f"--load {empty}", "no checkpoint")
    _fails_naming(pretrain(2, _args(1, 1, "--load", str(tmp_path / "nope"))),
                  "no such directory")


def test_unwritable_save_dir_is_named_and_existing_untouched(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = str(blocker / "ckpt")
    _fails_naming(pretrain(2, _args(1, 1, "--train-iters", "1", "--save", bad)),
                  f"--save {bad}")
    assert blocker.read_text() == "not a directory"


def test_nan_loss_stops_the_run_without_saving(small_checkpoint, tmp_path):
    ck = _copy(small_checkpoint, tmp_path)
    before = _digest(ck)
    r = pretrain(2, _args(1, 1, "--load", ck, "--save", ck, "--train-iters", "30",
                          "--lr", "1e30", "--clip-grad", "0", "--exit-on-nan-iterations", "3"))
    _fails_naming(r, "not finite for 3 consecutive iterations")
    assert _digest(ck) == before


def test_a_kill_mid_save_leaves_the_previous_checkpoint_loadable(small_checkpoint, tmp_path):
    """What a SIGKILL during a save can leave: a half-written temporary directory
    (and, worst case, a directory without its metadata). Loading skips both."""
    from hybrid.checkpoint import find_checkpoint
    ck = _copy(small_checkpoint, tmp_path)
    os.makedirs(os.path.join(ck, ".tmp_iter_0000004"))
    with open(os.path.join(ck, ".tmp_iter_0000004", "rank_00000.pt"), "wb") as f:
        f.write(b"partial")
    os.makedirs(os.path.join(ck, "iter_0000005"))
    assert find_checkpoint(ck).endswith("iter_0000002")
    os.remove(os.path.join(ck, "latest"))  # even without the pointer
    assert find_checkpoint(ck).endswith("iter_0000002")
    log = str(tmp_path / "log.jsonl")
    _ok(pretrain(2, _args(1, 1, "--load", ck, "--train-iters", "3", "--log-json", log)))
    assert [m["iteration"] for m in read_json_log(log)] == [3]


def _save_with_full_disk(ps, save_dir):
    import errno

    import hybrid.checkpoint.save as save_mod
    from hybrid.checkpoint import save_checkpoint
    from hybrid.config import Flags, build_config
    from hybrid.errors import CheckpointError
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_model
    from tests.helpers.zero_reference import zero_engine
    cfg = build_config(Flags(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                      zero_stage=2), ps.world_size)
    rng = seed_all(1, ps.tp_rank, ps.dp_rank, ps.device)
    engine = zero_engine(build_model(cfg, ps, 257, rng), ps, cfg)
    save_checkpoint(save_dir, 1, 8, engine, ps, cfg.to_dict(), rng)
    real = save_mod.fsync_write

    def full_disk(path, write):
        if ps.rank == 1 and path.endswith(".pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, write)
    save_mod.fsync_write = full_disk
    error = None
    try:
        save_checkpoint(save_dir, 2, 16, engine, ps, cfg.to_dict(), rng)
    except CheckpointError as e:
        error = str(e)
    finally:
        save_mod.fsync_write = real
    # the interrupted save left the previous checkpoint loadable
    from hybrid.checkpoint import load_checkpoint
    return error, load_checkpoint(save_dir, engine, ps, cfg.seed, rng)


def test_full_disk_during_save_fails_everywhere_and_keeps_the_old_one(tmp_path):
    from tests.helpers.harness import run_ranks
    save = str(tmp_path / "ckpt")
    errors, loaded = zip(*run_ranks(_save_with_full_disk, world_size=2, tp=1, args=(save,)))
    assert loaded == ((1, 8), (1, 8))
    assert errors[1] is not None and "No space left on device" in errors[1]
    assert errors[1].startswith(f"--save {save}: writing")
    assert errors[0] == errors[1]  # rank 0 learns of it too and stops, with the same message
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest"]
    with open(os.path.join(save, "latest")) as f:
        assert f.read() == "iter_0000001"


def test_a_stale_latest_falls_back_to_the_newest_complete_checkpoint_and_says_so(tmp_path):
    import logging

    from hybrid.checkpoint.files import find_checkpoint
    for name, complete in (("iter_0000002", True), ("iter_0000004", False)):
        os.makedirs(tmp_path / name)
        if complete:
            (tmp_path / name / "metadata.json").write_text("{}")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("hybrid")
    log.addHandler(handler)
    try:
        for latest, warned in (("iter_0000009", True), ("iter_0000004", True),
                               ("iter_0000002", False)):
            (tmp_path / "latest").write_text(latest)
            said.clear()
            assert find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000002")
            assert bool(said) == warned, (latest, said)
            if warned:
                assert f"names '{latest}', which is not a complete checkpoint there; " \
                       f"loading iter_0000002" in said[0]
    finally:
        log.removeHandler(handler)



def test_context_parallel_checkpoint_round_trip_2_1_4(tmp_path):
    """CP holds no parameter of its own: a checkpoint saved at CP 2 (ZeRO-3 sharded
    over DP 2 x CP 2) resumes at CP 2 to the last bit, loads at CP 1 (DP 4, stage 1),
    whose save loads at CP 4 (stage 0), and the curve goes on as the CP 2 run's:
    2 -> 1 -> 4. (--seq-length 32: 4 chunks of 4 tokens per rank at CP 4.)"""
    def run(cp, stage, *extra):
        log = str(tmp_path / f"cp{cp}_{len(os.listdir(tmp_path))}.jsonl")
        _ok(pretrain(4, _args(1, stage, "--context-parallel-size", str(cp), "--log-json", log,
                              *extra)))
        return _losses(log)

    cp2 = str(tmp_path / "cp2")
    curve = run(2, 3, "--save", cp2, "--save-interval", "2")  # saves 2, 4, 6
    cp1 = str(tmp_path / "cp1")
    with open(os.path.join(cp2, "latest"), "w") as f:
        f.write("iter_0000004")
    assert run(2, 3, "--load", cp2) == curve[4:]  # exact resume at CP 2: 5, 6
    with open(os.path.join(cp2, "latest"), "w") as f:
        f.write("iter_0000002")
    got = run(1, 1, "--load", cp2, "--save", cp1, "--train-iters", "4")  # 3, 4; saves 4
    got += run(4, 0, "--load", cp1)  # 5, 6 (stage 0: all-reduce over DP x CP)
    assert len(got) == len(curve) - 2
    for a, b in zip(got, curve[2:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
