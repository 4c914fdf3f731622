"""Megatron's recompute, sequence-parallel and checkpoint flags resolve into one plan, or
one error naming the flag to change."""

import dataclasses

import pytest

from hybrid.config import build_config, parse_args
from hybrid.errors import ConfigError

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32"]


def _cfg(*flags, world=2, tp=2):
    return build_config(parse_args(BASE + ["--tensor-model-parallel-size", str(tp), *flags]), world)


@pytest.mark.parametrize("flags,granularity,num_layers,per_checkpoint", [
    ([], None, None, 1),
    (["--recompute-activations"], "selective", None, 1),  # Megatron's shorthand
    (["--recompute-granularity", "selective"], "selective", None, 1),
    (["--checkpoint-activations"], "full", None, 1),  # the older Megatron name
    (["--recompute-granularity", "full"], "full", None, 1),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "full", None, 1),
    # uniform N: every layer checkpointed, in groups of N that store one input each
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "3"], "full", None, 3),
    (["--checkpoint-activations", "--recompute-method", "uniform",
      "--recompute-num-layers", "4"], "full", None, 4),
    (["--recompute-granularity", "full", "--recompute-num-layers", "3"], "full", 3, 1),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"], "full", 2, 1),
])
def test_recompute_flags_resolve_to_granularity_and_layers(flags, granularity, num_layers,
                                                           per_checkpoint):
    rc = _cfg(*flags).recompute
    assert (rc.granularity, rc.num_layers, rc.layers_per_checkpoint) == (
        granularity, num_layers, per_checkpoint)


def test_distribute_saved_activations_is_partitioning_and_moot_under_sp():
    cfg = _cfg("--recompute-granularity", "full", "--distribute-saved-activations")
    assert cfg.flags.partition_activations and cfg.recompute.partition_activations
    cfg = _cfg("--recompute-granularity", "full", "--distribute-saved-activations",
               "--sequence-parallel")
    assert not cfg.recompute.partition_activations  # the block input is already 1/TP


@pytest.mark.parametrize("flags,message", [
    (["--recompute-granularity", "some"], "--recompute-granularity must be full or selective"),
    (["--recompute-activations", "--recompute-granularity", "full"],
     "--recompute-activations means --recompute-granularity selective"),
    (["--recompute-num-layers", "2"], "need --recompute-granularity full"),
    (["--recompute-activations", "--recompute-method", "block"],
     "need --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "5"],
     "--recompute-num-layers must be in [1, --num-layers 4]"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "0"], "--recompute-num-layers must be in [1, --num-layers 4]"),
    (["--recompute-granularity", "full", "--recompute-method", "every"],
     "--recompute-method must be uniform or block"),
    (["--recompute-activations", "--cpu-checkpointing"],
     "--cpu-checkpointing needs --recompute-granularity full"),
    (["--sequence-parallel", "--seq-length", "33", "--max-position-embeddings", "64"],
     "use a multiple of 2"),
])
def test_bad_recompute_and_sp_flags_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _cfg(*flags)


def test_sequence_parallel_at_tp_1_is_dropped_as_megatron_drops_it():
    """Megatron's Mixtral script passes --sequence-parallel at TP 1: nothing to split,
    so it is dropped and listed with the flags that had no effect."""
    cfg = _cfg("--sequence-parallel", world=1, tp=1)
    assert not cfg.parallel.sequence_parallel
    assert cfg.flags.ignored_megatron_flags == ["--sequence-parallel (TP 1: nothing to split)"]


@pytest.mark.parametrize("flag", ["--lr", "--min-lr", "--clip-grad", "--hidden-dropout",
                                  "--loss-scale", "--adam-eps", "--init-method-std"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_float_flags_are_refused(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be a finite number"):
        _cfg(f"{flag}={value}")  # "=": argparse reads a bare -inf as a flag


# -- Megatron's flags ----------------------------------------------------------

def test_megatron_implementation_flags_are_dropped_and_listed():
    f = parse_args(BASE + ["--use-mcore-models", "--transformer-impl", "local",
                           "--no-masked-softmax-fusion", "--optimizer", "adam",
                           "--pipeline-model-parallel-size", "1", "--num-workers", "2"])
    assert f.ignored_megatron_flags == ["--use-mcore-models", "--transformer-impl local",
                                        "--no-masked-softmax-fusion", "--optimizer adam",
                                        "--num-workers 2"]
    assert build_config(f, 1).model.num_layers == 4  # the values after them still parse


@pytest.mark.parametrize("flags,needle", [
    (["--moe-router-topk", "2"], "--moe-router-topk: options of MoE layers, and the model "
                                 "has none: add --num-experts N"),
    (["--moe-use-upcycling"], "--moe-use-upcycling is a Megatron-LM flag hybrid does not "
                              "implement: turn the dense checkpoint into an MoE one with "
                              "scripts/upcycle_checkpoint.py"),
    (["--fp8-format", "hybrid"], "use --bf16"),
    (["--use-torch-fsdp2"], "--zero-stage 3"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size: options of MoE "
                                            "layers, and the model has none"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size: options of MoE "
                                             "layers, and the model has none"),
    (["--optimizer", "sgd"], "--optimizer sgd: hybrid implements only adam"),
    (["--num-layerz", "2"], "--num-layerz is not a flag hybrid knows, nor a Megatron-LM flag it "
                            "maps (README: 'Coming from Megatron-LM'); did you mean "
                            "--num-layers?"),
])
def test_unimplemented_flags_get_one_named_error(flags, needle):
    with pytest.raises(ConfigError) as e:
        build_config(parse_args(BASE + flags), 1)
    assert needle in str(e.value)
    assert "unrecognized arguments" not in str(e.value)


def test_context_parallel_flags_have_megatrons_meaning():
    cfg = build_config(parse_args(BASE + ["--context-parallel-size", "2", "--cp-comm-type",
                                          "all_gather", "--seq-length", "64"]), 8)
    par = cfg.parallel
    assert (par.context_parallel_size, par.data_parallel_size, par.cp_comm_type,
            par.cp_layout) == (2, 4, "all_gather", "load_balanced")
    assert build_config(parse_args(BASE), 2).parallel.context_parallel_size == 1


@pytest.mark.parametrize("flags,world,needle", [
    (["--context-parallel-size", "3"], 4, "--context-parallel-size 3 = 3 does not divide the "
                                          "world size 4"),
    (["--context-parallel-size", "0"], 4, "--context-parallel-size must be >= 1"),
    (["--context-parallel-size", "2", "--seq-length", "66"], 2,
     "cuts --seq-length 66 into 4 equal parts: use a multiple of 4"),
    (["--context-parallel-size", "2", "--cp-layout", "striped", "--seq-length", "65"], 2,
     "into 2 equal parts"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], 2,
     "--cp-comm-type must be p2p, all_gather or a2a, got 'ring'"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2, "hierarchical CP"),
    (["--context-parallel-size", "2", "--cp-layout", "zigzag"], 2,
     "--cp-layout must be load_balanced or striped, got 'zigzag'"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "2",
      "--hidden-size", "64"], 4, "--num-attention-heads 2 / TP 1 must be divisible by 4"),
    # the heads split, the key/value heads do not: the groups are named
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention",
      "--num-query-groups", "2", "--tensor-model-parallel-size", "2"], 4,
     "splits each TP rank's key/value heads over --context-parallel-size 2: --num-query-groups "
     "2 / TP 2 must be divisible by 2; give --num-query-groups a multiple of 4"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention"], 2,
     "--num-query-groups 1 (the default with --group-query-attention) / TP 1 must be "
     "divisible by 2"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "4",
      "--sequence-parallel", "--seq-length", "68"], 8, "use a --seq-length that is a multiple "
                                                       "of 8"),
])
def test_context_parallel_bad_layouts_name_the_flag(flags, world, needle):
    with pytest.raises(ConfigError) as e:
        build_config(parse_args(BASE + flags), world)
    assert needle in str(e.value)


def test_megatron_optimizer_and_overlap_flags_map_onto_zero():
    cfg = build_config(parse_args(BASE + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                             "--overlap-param-gather"]), 2)
    assert (cfg.zero.stage, cfg.zero.overlap_comm) == (1, True)
    cfg = build_config(parse_args(BASE + ["--use-distributed-optimizer", "--zero-stage", "3"]), 2)
    assert cfg.zero.stage == 3  # already shards more than Megatron's optimizer
    assert build_config(parse_args(BASE), 2).zero == build_config(parse_args(BASE), 2).zero


def test_attention_backend_and_use_flash_attn():
    cfg = build_config(parse_args(BASE + ["--use-flash-attn"]), 1)
    assert cfg.model.attention_backend == "flash"
    assert build_config(parse_args(BASE), 1).model.attention_backend == "auto"
    with pytest.raises(ConfigError, match="--use-flash-attn means --attention-backend flash"):
        build_config(parse_args(BASE + ["--use-flash-attn", "--attention-backend", "unfused"]), 1)
    with pytest.raises(ConfigError, match="--attention-backend must be"):
        build_config(parse_args(BASE + ["--attention-backend", "cudnn"]), 1)


@pytest.mark.parametrize("flags,needle", [
    (["--train-iters", "5", "--train-samples", "80"], "exclusive"),
    (["--train-samples", "80", "--lr-decay-iters", "5"], "--lr-decay-iters counts iterations"),
    (["--lr-warmup-samples", "8"], "--lr-warmup-samples counts samples: it needs --train-samples"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "exclusive"),
    (["--rampup-batch-size", "4", "4"], "three numbers"),
    (["--global-batch-size", "16", "--rampup-batch-size", "3", "4", "40"],
     "--rampup-batch-size START 3 is not a multiple of --micro-batch-size 2"),
    (["--global-batch-size", "18", "--rampup-batch-size", "4", "4", "40"],
     "must be START 4 plus a whole number of INCR 4"),
    (["--exit-interval", "0"], "--exit-interval must be >= 1"),
])
def test_schedule_flags_are_checked(flags, needle):
    with pytest.raises(ConfigError) as e:
        build_config(parse_args(BASE + ["--micro-batch-size", "2", *flags]), 1)
    assert needle in str(e.value)


def test_flags_are_not_modified_and_defaults_are_filled_in_the_copy():
    f = parse_args(BASE)
    cfg = build_config(f, 2)
    assert f.train_iters is None and f.global_batch_size is None
    assert cfg.flags.train_iters == 200 and cfg.flags.global_batch_size == 16  # 8 x DP 2
    assert cfg.to_dict()["lr_decay_iters"] == 200 and "ignored_megatron_flags" not in cfg.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 3  # frozen


@pytest.mark.parametrize("flags,message", [
    (["--no-save-optim"], "--no-save-optim needs --save DIR"),
    (["--no-load-optim"], "--no-load-optim needs --load DIR"),
    (["--no-load-rng", "--save", "s"], "--no-load-rng needs --load DIR"),
    (["--finetune", "--save", "s"], "--finetune needs --load DIR"),
])
def test_checkpoint_flags_without_their_directory_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*flags)


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--data-cache-path",
                                  "--collective-dump-dir", "--kernel-cache-dir"])
def test_a_directory_flag_naming_a_file_is_refused_at_start(tmp_path, flag):
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(ConfigError, match=f"^{flag} {path} is a file; give a directory$"):
        _cfg(flag, str(path))
    _cfg(flag, str(tmp_path / "new_dir"))  # missing: created when first written


def _error(*flags) -> str:
    with pytest.raises(ConfigError) as e:
        _cfg(*flags)
    return str(e.value)


def test_a_directory_as_data_or_a_file_as_load_says_what_is_wanted_at_preflight(tmp_path):
    """Said by build_config (the launcher's --check-config), before any worker starts."""
    data = tmp_path / "data"
    data.mkdir()
    want = (f"--data-path {data} is a directory; give a text file, or the prefix of "
            f"preprocessed data (PREFIX for PREFIX.bin and PREFIX.idx)")
    assert _error("--data-path", str(data)) == want
    for suffix in (".bin", ".idx"):  # the prefix of what is there is suggested
        (data / f"corpus_text_document{suffix}").write_bytes(b"")
    assert _error("--data-path", "0.5", str(data), "0.5", "other") == (
        f"{want}; did you mean --data-path {data / 'corpus_text_document'}?")
    assert _error("--train-data-path", "a", "--valid-data-path", str(data)).startswith(
        f"--valid-data-path {data} is a directory")
    (tmp_path / "data.bin").write_bytes(b"")  # a prefix beside a directory of its name: fine
    _cfg("--data-path", str(data))

    save = tmp_path / "save"
    (save / "iter_0000010").mkdir(parents=True)
    (save / "iter_0000010" / "metadata.json").write_text("{}")
    (save / "latest").write_text("iter_0000010")
    takes = ("--load takes the directory a run saved into with --save (it holds 'latest' "
             "and the iter_* checkpoints)")
    for path in (save / "latest", save / "iter_0000010" / "metadata.json"):
        assert _error("--load", str(path)) == (
            f"--load {path} is a file; {takes}; did you mean --load {save}?")
    other = tmp_path / "weights.pt"
    other.write_bytes(b"")
    assert _error("--load", str(other)) == f"--load {other} is a file; {takes}"
    assert _cfg("--load", str(save)).checkpoint.load == str(save)


def test_checkpoint_flags_reach_the_checkpoint_section():
    ck = _cfg("--load", "a", "--save", "b", "--save-interval", "5", "--keep-last", "2",
              "--no-save-optim", "--no-load-optim", "--no-load-rng", "--finetune").checkpoint
    assert (ck.load, ck.save, ck.save_interval, ck.keep_last) == ("a", "b", 5, 2)
    assert ck.no_save_optim and ck.no_load_optim and ck.no_load_rng and ck.finetune
    assert _cfg().checkpoint == type(ck)()  # all off by default


def test_kv_channels_sets_the_head_width_and_qk_layernorm_is_accepted():
    m = build_config(parse_args(BASE + ["--kv-channels", "16"]), 1).model
    assert (m.hidden_size, m.head_size, m.attention_size) == (64, 16, 64)
    m = build_config(parse_args(BASE + ["--kv-channels", "32", "--qk-layernorm"]), 1).model
    assert (m.head_size, m.attention_size, m.qkv_size, m.qk_layernorm) == (32, 128, 384, True)
    assert not build_config(parse_args(BASE), 1).model.qk_layernorm
    # heads of their own width: the hidden size need not split into whole heads
    odd = ["--hidden-size", "60", "--num-attention-heads", "8"]
    assert build_config(parse_args(BASE + odd + ["--kv-channels", "8"]), 1).model.head_size == 8
    with pytest.raises(ConfigError, match="--hidden-size 60 is not divisible by "
                                          "--num-attention-heads 8: give the head width"):
        build_config(parse_args(BASE + odd), 1)


@pytest.mark.parametrize("value", ["0", "-16"])
def test_kv_channels_below_one_is_refused_naming_the_flag(value):
    with pytest.raises(ConfigError, match=f"^--kv-channels must be >= 1, got {value}$"):
        build_config(parse_args(BASE + ["--kv-channels", value]), 1)


def test_kv_channels_whose_rope_share_is_odd_is_refused():
    rope = ["--position-embedding-type", "rope", "--kv-channels", "6", "--rotary-percent", "0.5"]
    with pytest.raises(ConfigError, match="--rotary-percent 0.5 of the head size 6 rotates 3"):
        build_config(parse_args(BASE + rope), 1)


# -- edge values found by the bad-input audit: each refused before any worker starts ------

@pytest.mark.parametrize("flags,world,needle", [
    (["--adam-beta1", "1.5"], 2, "--adam-beta1 must be in [0, 1), got 1.5"),
    (["--adam-beta2", "-1"], 2, "--adam-beta2 must be in [0, 1), got -1.0"),
    (["--adam-eps", "0"], 2, "--adam-eps must be > 0, got 0.0"),
    (["--ffn-hidden-size", "0"], 2, "--ffn-hidden-size must be >= 1, got 0"),
    (["--init-method-std", "-1"], 2, "--init-method-std must be >= 0, got -1.0"),
    (["--seed", "-1"], 2, "--seed must be in [0, 2**32 - 1], got -1"),
    (["--seed", str(2**32)], 2, f"--seed must be in [0, 2**32 - 1], got {2**32}"),
    (["--distributed-timeout-minutes", "1e-9"], 2,
     "--distributed-timeout-minutes must be at least 1/60 (one second)"),
    (["--train-iters", "10", "--lr-warmup-iters", "11"], 2,
     "--lr-warmup-iters 11 exceeds --lr-decay-iters 10"),
    (["--train-samples", "80", "--lr-warmup-samples", "100"], 2,
     "--lr-warmup-samples 100 exceeds --lr-decay-samples 80"),
    (["--split", "nan,1,1"], 2, "--split 'nan,1,1' must be three non-negative numbers"),
    (["--split", "inf,1,1"], 2, "--split 'inf,1,1' must be three non-negative numbers"),
    ([], 0, "the world size (nodes x processes per node) must be >= 1, got 0"),
])
def test_edge_values_are_refused_naming_the_flag(flags, world, needle):
    with pytest.raises(ConfigError) as e:
        build_config(parse_args(BASE + flags), world)
    assert needle in str(e.value)


def test_edge_values_just_inside_the_range_are_accepted():
    cfg = build_config(parse_args(BASE + ["--adam-beta1", "0", "--adam-beta2", "0.999999", "--seed",
                             str(2**32 - 1), "--init-method-std", "0", "--train-iters", "10",
                             "--lr-warmup-iters", "10", "--distributed-timeout-minutes",
                             str(1 / 60)]), 2)
    assert cfg.seed == 2**32 - 1 and cfg.lr_schedule.warmup == cfg.lr_schedule.decay == 10


def test_zero_flags_land_in_one_section_each():
    """Sharding, AdamW, precision and offload are separate sections: each component
    takes only its own (apply_zero takes them as separate arguments)."""
    cfg = build_config(parse_args(BASE + [
        "--zero-stage", "2", "--reduce-bucket-size", "1000", "--adam-beta2", "0.95",
        "--adam-eps", "1e-6", "--weight-decay", "0.1", "--clip-grad", "0.5", "--fp16",
        "--loss-scale-window", "50", "--offload-optimizer", "--offload-delayed-update"]), 2)
    assert (cfg.zero.stage, cfg.zero.reduce_bucket_size) == (2, 1000)
    assert (cfg.adamw.beta2, cfg.adamw.eps, cfg.adamw.weight_decay, cfg.adamw.clip_grad) == \
        (0.95, 1e-6, 0.1, 0.5)
    assert (cfg.precision.params_dtype, cfg.precision.grads_dtype,
            cfg.precision.loss_scale_window) == ("fp16", "fp16", 50)
    assert cfg.offload.optimizer and cfg.offload.delayed_update
    assert not hasattr(cfg.zero, "clip_grad") and not hasattr(cfg.zero, "params_dtype")


@pytest.mark.parametrize("flags,speculate,error", [
    # on where it applies: the nvme optimizer tier under a pipeline
    (["--pipeline-model-parallel-size", "2", "--offload-optimizer", "nvme"], True, None),
    (["--pipeline-model-parallel-size", "2", "--offload-optimizer", "nvme",
      "--no-offload-speculative-step"], False, None),  # the A/B switch
    (["--offload-optimizer", "nvme"], False, None),  # PP 1: no stage waits for another
    (["--pipeline-model-parallel-size", "2", "--offload-optimizer", "cpu"], False, None),
    (["--pipeline-model-parallel-size", "2", "--offload-optimizer", "nvme",
      "--offload-delayed-update"], False, None),
    (["--pipeline-model-parallel-size", "2", "--offload-optimizer", "nvme",
      "--offload-delayed-update", "--offload-speculative-step"], None, "drop one"),
    (["--offload-optimizer", "cpu", "--offload-speculative-step"], None,
     "needs --offload-optimizer nvme"),
])
def test_the_speculative_host_step_is_on_where_it_applies(tmp_path, flags, speculate, error):
    """--offload-speculative-step (hybrid/zero/offload/host_step.py, [Note: what starts
    before the step]): on by default with the nvme optimizer tier under a pipeline,
    off elsewhere; asked for where it cannot run, one error naming why."""
    argv = ["--zero-stage", "1", *flags]
    if "nvme" in flags:
        argv += ["--offload-nvme-path", str(tmp_path)]
    if error is not None:
        with pytest.raises(ConfigError, match=error):
            _cfg(*argv, world=4, tp=1)
        return
    cfg = _cfg(*argv, world=4, tp=1)
    assert cfg.offload.speculative_step is speculate
