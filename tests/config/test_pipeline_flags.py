"""Megatron's pipeline flags: each one reaches the config as Megatron means it, and each bad
input is one error naming the flag -- through the launcher's preflight with exit code 2.

A pipeline run combines with every other flag (the last refusal, tied embeddings with an
offloaded optimizer, went when the step learned to sum the tied unit before it goes down).
"""

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.megatron_flags import REFUSED
from hybrid.errors import ConfigError
from tests.helpers.launch import script_module

BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1"]


def _plan(*flags, world=8):
    return build_config(parse_args(BASE + list(flags)), world, plan_only=True)


def test_pp_is_the_outermost_dimension_and_divides_the_world():
    cfg = _plan("--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2")
    par, pipe = cfg.parallel, cfg.pipeline
    assert (par.pipeline_model_parallel_size, par.tensor_model_parallel_size,
            par.data_parallel_size) == (2, 2, 2)
    assert (pipe.size, pipe.virtual_size, pipe.schedule) == (2, 1, "1f1b")
    assert pipe.split is not None and pipe.split.layers == (4, 4)
    assert cfg.num_micro_batches == 1  # the global batch defaults to micro x DP


def test_pp_1_is_todays_config():
    cfg = build_config(parse_args(BASE), 2)
    assert cfg.parallel.pipeline_model_parallel_size == 1 and cfg.parallel.data_parallel_size == 2
    assert cfg.pipeline.split is not None and cfg.pipeline.split.layers == (8,)
    assert (cfg.pipeline.virtual_size, cfg.pipeline.schedule) == (1, "1f1b")
    # Megatron scripts that say PP 1, or count the embedding at PP 1, still run
    build_config(parse_args(BASE + ["--pipeline-model-parallel-size", "1",
                                    "--account-for-embedding-in-pipeline-split"]), 2)


@pytest.mark.parametrize("flags,layers,vpp", [
    (["--decoder-first-pipeline-num-layers", "1"], (1, 7), 1),
    (["--decoder-last-pipeline-num-layers", "2"], (6, 2), 1),
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
      "--num-layers", "6"], (3, 3), 1),
    (["--virtual-pipeline-model-parallel-size", "2"], (2, 2, 2, 2), 2),
    (["--num-virtual-stages-per-pipeline-rank", "2"], (2, 2, 2, 2), 2),  # Megatron's newer name
    (["--num-layers-per-virtual-pipeline-stage", "1"], (1,) * 8, 4),
    (["--pipeline-model-parallel-layout", "Ettt|(t|)*4,tL"], (3, 1, 1, 1, 1, 1), 3),
])
def test_each_split_flag_reaches_the_split(flags, layers, vpp):
    cfg = _plan("--pipeline-model-parallel-size", "2", "--global-batch-size", "8", *flags)
    assert cfg.pipeline.split is not None and cfg.pipeline.split.layers == layers
    assert cfg.pipeline.virtual_size == cfg.flags.virtual_pipeline_model_parallel_size == vpp
    assert cfg.pipeline.schedule == ("interleaved_1f1b" if vpp > 1 else "1f1b")
    # the filled flags check again as they are (a checkpoint's saved flags rebuild)
    again = build_config(cfg.flags, 8, plan_only=True)
    assert again.pipeline == cfg.pipeline


def test_zero3_holds_a_stage_s_parameters_for_the_step_unless_told():
    assert not _plan("--pipeline-model-parallel-size", "2").pipeline.reshard_after_micro_batch
    cfg = _plan("--pipeline-model-parallel-size", "2", "--zero-stage", "3",
                "--pipeline-reshard-after-micro-batch")
    assert cfg.pipeline.reshard_after_micro_batch


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_one_chunk_schedules(schedule):
    cfg = _plan("--pipeline-model-parallel-size", "4", "--pipeline-schedule", schedule)
    assert cfg.pipeline.schedule == schedule


@pytest.mark.parametrize("flags,message", [
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--pipeline-schedule", "1f1b", "--global-batch-size", "8"],
     "--pipeline-schedule 1f1b runs one model chunk per stage, but "
     "--virtual-pipeline-model-parallel-size makes 2: use interleaved_1f1b"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved_1f1b"],
     "--pipeline-schedule interleaved_1f1b needs more than one model chunk per stage"),
    (["--virtual-pipeline-model-parallel-size", "2"],
     "--virtual-pipeline-model-parallel-size makes 2 model chunks per pipeline rank, which "
     "interleave over the stages: it needs --pipeline-model-parallel-size > 1"),
    (["--decoder-first-pipeline-num-layers", "2"], "--decoder-first-pipeline-num-layers sets "
     "the layers of one pipeline stage: it needs --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|ttL"],
     "--pipeline-model-parallel-layout 'Ett|ttL' places 4 transformer layers ('t'), but "
     "--num-layers is 8"),
    (["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
      "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "100"],
     "--virtual-pipeline-model-parallel-size (interleaved 1F1B) runs the micro-batches in "
     "groups of --pipeline-model-parallel-size 4: the 6 micro-batches per step "
     "(--global-batch-size 12 / (--micro-batch-size 1 x data-parallel size 2)) must be a "
     "multiple of 4"),
    (["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
      "--global-batch-size", "24", "--rampup-batch-size", "4", "4", "100"],
     "--rampup-batch-size START's 2 micro-batches per step (START 4"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size must be >= 1"),
    (["--pipeline-reshard-after-micro-batch", "--zero-stage", "3"],
     "--pipeline-reshard-after-micro-batch frees ZeRO-3's parameters between a pipeline "
     "step's micro-batches: it needs --pipeline-model-parallel-size > 1"),
    # a schedule at PP 1 would be ignored: any, the default's name included
    *((["--pipeline-schedule", s], f"--pipeline-schedule {s} orders the micro-batches of "
                                   f"pipeline stages: it needs --pipeline-model-parallel-size > 1")
      for s in ("zb_h1", "1f1b")),
])
def test_bad_pipeline_flags_are_one_error_naming_the_flag(flags, message):
    with pytest.raises(ConfigError) as e:
        _plan(*flags)
    assert message in str(e.value)


def test_the_pipeline_flags_are_not_refused_any_more():
    for name in ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers",
                 "--num-layers-per-virtual-pipeline-stage"):
        assert name not in REFUSED
    with pytest.raises(ConfigError, match="--overlap-p2p-communication is a Megatron-LM flag "
                                          "hybrid does not implement: hybrid's pipeline "
                                          "schedules decide"):
        parse_args(BASE + ["--overlap-p2p-communication"])


def test_pipeline_runs_combine_with_everything_else():
    cfg = build_config(parse_args(BASE + ["--pipeline-model-parallel-size", "2",
                                          "--untie-embeddings-and-output-weights"]), 4)
    assert cfg.pipeline.size == 2 and cfg.pipeline.schedule == "1f1b"
    # interleaved stages, CP and the offload tiers run (issue 40's second slice)
    pp2 = BASE + ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
    il = build_config(parse_args(pp2 + ["--virtual-pipeline-model-parallel-size", "2",
                                        "--global-batch-size", "8"]), 8)
    assert il.pipeline.virtual_size == 2 and il.pipeline.schedule == "interleaved_1f1b"
    cp = build_config(parse_args(pp2 + ["--context-parallel-size", "2"]), 8)
    assert cp.parallel.context_parallel_size == 2
    for extra in (["--offload-optimizer", "cpu", "--zero-stage", "2"],
                  ["--offload-optimizer", "nvme", "--offload-param", "nvme", "--zero-stage", "3",
                   "--offload-nvme-path", "/tmp"]):
        off = build_config(parse_args(pp2 + extra), 8)
        assert off.offload.optimizer == extra[1]
    # checkpoints are no longer among them: stage-sharded saves load in any layout
    ck = build_config(parse_args(BASE + ["--pipeline-model-parallel-size", "2",
                                         "--untie-embeddings-and-output-weights",
                                         "--save", "x", "--load", "x"]), 4)
    assert ck.checkpoint.save == ck.checkpoint.load == "x"
    # tied embeddings run (their copies summed over the embedding group), with an
    # offloaded optimizer too (the tied unit goes down only after the step's sum)
    tied = build_config(parse_args(BASE + ["--pipeline-model-parallel-size", "2"]), 4)
    assert not tied.model.untie_embeddings_and_output_weights
    off = build_config(parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--zero-stage",
                                          "2", "--offload-optimizer", "cpu"]), 4)
    assert off.offload.optimizer == "cpu" and not off.model.untie_embeddings_and_output_weights
    # a bad flag elsewhere still gets its own message first
    bad = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--zero-stage", "5"])
    with pytest.raises(ConfigError, match="--zero-stage must be 0, 1, 2 or 3"):
        build_config(bad, 4)


# The bad inputs of the issue, each through scripts/pretrain_gpt.py's preflight: one line
# naming the flag, exit code 2.
PREFLIGHT = [
    (["--num-layers", "30", "--pipeline-model-parallel-size", "4"], 8,
     "--num-layers 30 is not divisible by --pipeline-model-parallel-size 4: set "
     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers or "
     "--pipeline-model-parallel-layout"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
      "Etttt|tttL"], 4,
     "--pipeline-model-parallel-layout 'Etttt|tttL' places 7 transformer layers ('t'), but "
     "--num-layers is 8: each layer needs one stage"),
    (["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
      "--global-batch-size", "6"], 8,
     "--virtual-pipeline-model-parallel-size (interleaved 1F1B) runs the micro-batches in "
     "groups of --pipeline-model-parallel-size 4: the 3 micro-batches per step "
     "(--global-batch-size 6 / (--micro-batch-size 1 x data-parallel size 2)) must be a "
     "multiple of 4"),
    (["--pipeline-model-parallel-size", "3", "--tensor-model-parallel-size", "2"], 8,
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 3 = 6 does not divide "
     "the world size 8 (nodes x processes per node): use one of 1, 2, 4, 8"),
    (["--pipeline-model-parallel-size", "3"], 8,
     "--pipeline-model-parallel-size 3 does not divide the world size 8"),
]


@pytest.mark.parametrize("flags,world,message", PREFLIGHT)
def test_the_launcher_preflight_says_it_in_one_line_with_exit_2(flags, world, message, capsys,
                                                                monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    rc = script_module("pretrain_gpt").main(["--check-config", *BASE, *flags])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("pretrain_gpt.py: error: " + message), err


def test_zero_bubble_with_recompute_is_accepted():
    # the recompute's backward runs inside ZB-H1's input half (see
    # tests/scripts/test_pretrain_gpt.py for the curves)
    for extra in (["--recompute-granularity", "full"], ["--recompute-activations"]):
        cfg = build_config(parse_args(BASE + ["--pipeline-model-parallel-size", "2",
                                              "--pipeline-schedule", "zb_h1", *extra]), 4)
        assert cfg.pipeline.schedule == "zb_h1" and cfg.recompute.granularity
