"""Checkpoints of a model with MoE layers (every expert on every rank, EP 1): saved at
DP 2 x PP 2 at ZeRO 3, resumed there to the last bit, and loaded at one process at ZeRO 1
with the optimizer state, the curve going on; the sigmoid router's expert bias saved and
restored (at another pipeline size too); a dense checkpoint and an MoE model (and the
other way) refused, naming the parameters that differ."""

import json
import os
import shutil

import pytest

from tests.helpers.launch import TINY, pretrain, read_json_log
from tests.helpers.opened import opened_by_rank, own_files, recording_rank
from tests.models.moe_grid import MOE

# saved at AT of TOTAL steps: AT = 2 leaves an optimizer state with a history (Adam's
# moments past their first step) and TOTAL - AT = 2 steps of curve to compare after
TOTAL, AT = 4, 2
ITERS = ["--train-iters", str(TOTAL), "--eval-iters", "0"]


def _ok(r):
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory holding iteration AT, the uninterrupted curve's records)."""
    tmp = tmp_path_factory.mktemp("moe_ckpt")
    save, log = str(tmp / "ckpt"), str(tmp / "full.jsonl")
    _ok(pretrain(4, [*TINY, *MOE, *ITERS, "--pipeline-model-parallel-size", "2",
                     "--zero-stage", "3", "--save", save, "--save-interval", str(AT),
                     "--log-json", log]))
    os.remove(os.path.join(save, "latest"))  # resume from iteration AT, not the final save
    shutil.rmtree(os.path.join(save, f"iter_{TOTAL:07d}"))
    return save, read_json_log(log)


def test_an_moe_run_resumes_to_the_last_bit(saved, tmp_path):
    save, full = saved
    log = str(tmp_path / "res.jsonl")
    _ok(pretrain(4, [*TINY, *MOE, *ITERS, "--pipeline-model-parallel-size", "2",
                     "--zero-stage", "3", "--load", save, "--log-json", log]))
    resumed = read_json_log(log)
    for key in ("loss", "grad_norm", "moe"):
        assert [m[key] for m in resumed] == [m[key] for m in full[AT:]], key


def test_an_moe_checkpoint_loads_at_another_layout_and_goes_on(saved, tmp_path):
    """PP 2 x DP 2 at ZeRO 3 (every expert whole on every rank) -> 2 ranks with each
    expert's hidden units over ETP 2, at ZeRO 1: the same curve within 1e-5."""
    save, full = saved
    log = str(tmp_path / "etp.jsonl")
    _ok(pretrain(2, [*TINY, *MOE, *ITERS, "--zero-stage", "1", "--expert-tensor-parallel-size",
                     "2", "--load", save, "--log-json", log]))
    for got, want in zip(read_json_log(log), full[AT:], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"]
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"]


def test_a_dense_checkpoint_and_an_moe_model_do_not_mix(saved, tmp_path):
    """The MoE checkpoint into a dense model, and a dense one into the MoE model: exit 2,
    one line naming the parameters and --num-experts."""
    save, _ = saved
    dense = [*TINY, "--num-layers", "4", "--global-batch-size", "8", *ITERS]
    r = pretrain(1, [*dense, "--load", save])
    assert r.returncode == 2 and "checkpoint is for a different model (it has " \
        "['blocks.1.mlp.experts.fc', " in r.stderr and "check --num-experts" in r.stderr, r.stderr
    dense_save = str(tmp_path / "dense")
    _ok(pretrain(1, [*dense, "--train-iters", "1", "--save", dense_save]))
    r = pretrain(1, [*TINY, *MOE, *ITERS, "--load", dense_save])
    assert r.returncode == 2 and "lacks ['blocks.1.mlp.experts.fc', " in r.stderr \
        and "check --num-experts" in r.stderr, r.stderr


BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05"]
# (the bias needs more than 2 steps of counts to move on every layer: saved at 3 of 6)
BIAS_ITERS = ["--train-iters", "6", "--eval-iters", "0"]


def test_the_expert_bias_is_saved_and_restored(saved, tmp_path):
    """Saved at 3 of 6 at PP 2 x DP 2, resumed there and at one process: the same curve
    (the bias moved the routing: without it restored the token counts part at once);
    the checkpoint without a bias into a run that keeps one: exit 2, named."""
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "full.jsonl")
    pp2 = ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
    _ok(pretrain(4, [*TINY, *MOE, *BIAS_ITERS, *BIAS, *pp2, "--save", save, "--save-interval",
                     "3", "--log-json", log]))
    full = read_json_log(log)
    os.remove(os.path.join(save, "latest"))
    shutil.rmtree(os.path.join(save, "iter_0000006"))
    with open(os.path.join(save, "iter_0000003", "metadata.json")) as f:
        biases = json.load(f)["buffers"]
    assert sorted(biases) == [f"blocks.{i}.mlp.experts.router.expert_bias" for i in (1, 3)]
    assert all(len(v) == 4 and any(v) for v in biases.values())
    for world, flags, name in ((4, pp2, "pp2"), (1, [], "one")):
        out = str(tmp_path / f"{name}.jsonl")
        _ok(pretrain(world, [*TINY, *MOE, *BIAS_ITERS, *BIAS, *flags, "--load", save,
                             "--log-json", out]))
        resumed = read_json_log(out)
        for got, want in zip(resumed, full[3:], strict=True):
            assert abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"], name
            for layer, numbers in want["moe"].items():  # (counts exact, losses rounded)
                assert got["moe"][layer] == pytest.approx(numbers, rel=1e-6), (name, layer)
        if name == "pp2":  # the same layout: to the last bit
            assert [m["moe"] for m in resumed] == [m["moe"] for m in full[3:]]
    r = pretrain(1, [*TINY, *MOE, *BIAS_ITERS, *BIAS, "--load", saved[0]])
    assert r.returncode == 2 and "mlp.experts.router.expert_bias (the run saved no expert " \
        "bias)" in r.stderr, r.stderr[-2000:]


# (world, PP, EP) of the saving run; the other EP size the save is loaded at. ZeRO 3's
# run has no PP: PP x ZeRO 3 resumes bit for bit in test_an_moe_run_resumes_to_the_last_bit
# and PP x EP in stage 0's case, so 8 ranks on 2 cores would buy nothing more.
SAVED_AT = {0: (4, 2, 2, 4), 3: (4, 1, 4, 2)}


@pytest.mark.parametrize("stage", [0, 3])
def test_experts_over_ep_save_resume_and_reshard(tmp_path, stage):
    """Saved at 2 of 4 with the experts over EP (ZeRO 0: EP 2 x PP 2 of 4 ranks, each EP
    rank writing its own experts whole; ZeRO 3: EP 4 of 4 ranks, an expert a rank),
    version 5: resumed there to the last bit; loaded at one process (EP 1, ZeRO 1)
    and at another EP size of 4 ranks (ZeRO 2), the curve goes on within 1e-6; the
    one-process tools read every expert whole."""
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "full.jsonl")
    world, pp, ep, other_ep = SAVED_AT[stage]
    layout = ["--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep),
              "--zero-stage", str(stage)]
    _ok(pretrain(world, [*TINY, *MOE, *ITERS, *layout, "--save", save,
                         "--save-interval", str(AT), "--log-json", log]))
    full = read_json_log(log)
    os.remove(os.path.join(save, "latest"))
    shutil.rmtree(os.path.join(save, f"iter_{TOTAL:07d}"))
    with open(os.path.join(save, f"iter_{AT:07d}", "metadata.json")) as f:
        meta = json.load(f)
    saved_layout = meta["zero_layout"]
    assert meta["version"] == 5 and saved_layout["ep_size"] == ep
    assert sorted(saved_layout["experts"]) == sorted(f"blocks.{i}.mlp.experts.{w}" for i in (1, 3)
                                               for w in ("fc", "proj"))
    assert meta["model"]["blocks.1.mlp.experts.fc"][0] == 4  # the full tensor: every expert
    out = str(tmp_path / "same.jsonl")
    _ok(pretrain(world, [*TINY, *MOE, *ITERS, *layout, "--load", save, "--log-json", out]))
    resumed = read_json_log(out)
    for key in ("loss", "grad_norm", "moe"):
        assert [m[key] for m in resumed] == [m[key] for m in full[AT:]], key
    shapes = _goes_on_elsewhere(tmp_path, save, full, (
        (1, ["--zero-stage", "1"]),
        (4, ["--expert-model-parallel-size", str(other_ep), "--zero-stage", "2"])))
    assert shapes["blocks.3.mlp.experts.proj"] == (4, 64, 256)


def _goes_on_elsewhere(tmp_path, save, full, layouts) -> dict:
    """Iteration AT of ``save`` loaded at each ``(world, flags)`` of ``layouts``: the next
    losses within 1e-6 and grad norms within 1e-5 of the uninterrupted ``full`` run's.
    Returns every saved parameter's full shape as the one-process tools read it."""
    for n, flags in layouts:
        out = str(tmp_path / f"w{n}.jsonl")
        _ok(pretrain(n, [*TINY, *MOE, *ITERS, *flags, "--load", save, "--log-json", out]))
        for got, want in zip(read_json_log(out), full[AT:], strict=True):
            assert abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"], (n, got, want)
            assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"]
    from hybrid.checkpoint import iter_full_params
    _, params = iter_full_params(os.path.join(save, f"iter_{AT:07d}"), ("master",))
    return {n: tuple(v["master"].shape) for n, v in params}


# The TP runs' global batch: a micro-batch under TP 2 with SP is ~100 collectives of the
# TP group (SP's gathers and reductions, an all-reduce per norm and bias gradient), so at
# MOE's 8 samples the 2-rank load at DP 1 ran 1393 of them; at 4, two micro-batches of 2
# there and one a rank at DP 2, half as many. What is saved, opened and resumed is the
# same state whatever the batch.
TP_BATCH = ["--global-batch-size", "4"]


def test_experts_under_etp_folded_over_tp_save_resume_and_reshard(tmp_path):
    """Saved at 2 of 4 at TP 2 (SP) x DP 2 with each expert's hidden units over ETP 2 and
    the experts over EP 2 (the ETP x EP group folding over TP and DP; ZeRO 1): resumed
    there to the last bit, each rank opening the metadata and its own two files only (its
    experts' piece and its dense shard); loaded at one process (EP 1, ETP 1, TP 1) and at
    TP 2 x EP 2 without ETP on 2 ranks (ZeRO 3), the curve going on within 1e-6; the
    one-process tools read every expert whole. (Every run at :data:`TP_BATCH`.)"""
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "full.jsonl")
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", *TP_BATCH]
    layout = [*tp, "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2",
              "--zero-stage", "1"]
    _ok(pretrain(4, [*TINY, *MOE, *ITERS, *layout, "--save", save, "--save-interval", str(AT),
                     "--log-json", log]))
    full = read_json_log(log)
    os.remove(os.path.join(save, "latest"))
    shutil.rmtree(os.path.join(save, f"iter_{TOTAL:07d}"))
    with open(os.path.join(save, f"iter_{AT:07d}", "metadata.json")) as f:
        saved = json.load(f)["zero_layout"]
    assert (saved["ep_size"], saved["etp_size"]) == (2, 2)
    assert saved["expert_rows"]["blocks.1.mlp.experts.proj"] == 4 * 64  # E x hidden
    out = str(tmp_path / "same.jsonl")
    r = pretrain(4, [*TINY, *MOE, *ITERS, *layout, "--load", save, "--log-json", out],
                 rank_fn=recording_rank)
    _ok(r)
    resumed = read_json_log(out)
    for key in ("loss", "grad_norm", "moe"):
        assert [m[key] for m in resumed] == [m[key] for m in full[AT:]], key
    for rank, files in opened_by_rank(r.stdout).items():
        assert sorted(files) == sorted([f"iter_{AT:07d}/metadata.json", *own_files(rank, AT)])
    shapes = _goes_on_elsewhere(tmp_path, save, full, (
        (1, ["--zero-stage", "1", *TP_BATCH]),
        (2, [*tp, "--expert-model-parallel-size", "2", "--zero-stage", "3"])))
    assert shapes["blocks.1.mlp.experts.fc"] == (4, 256, 64)
