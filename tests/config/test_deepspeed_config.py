"""A DeepSpeed ds_config.json drives hybrid: every key in the table is honored (the
config sections checked field by field), accepted with a named warning, or refused
by name; "auto" resolves as Hugging Face's integration does; the file and the
command line may not contradict each other; and a config written the way
DeepSpeed's docs show it trains exactly as the same run given as flags."""

import json

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.deepspeed import apply_ds_config
from hybrid.config.deepspeed_keys import KEYS, Custom, Flag, Hint, Refuse
from hybrid.config.flags import Flags
from hybrid.errors import ConfigError
from hybrid.train.lr_schedule import scheduled_lr

from launch import TINY, pretrain, read_json_log


def _cfg(ds, *argv, world=2):
    return build_config(parse_args(["--deepspeed_config", _write(ds), *argv]), world)


_TMP = {}


def _write(ds) -> str:
    """ds -> a file under the session's tmp dir (set by the fixture below)."""
    path = _TMP["dir"] / f"ds{len(_TMP)}.json"
    _TMP[path] = True
    path.write_text(json.dumps(ds))
    return str(path)


@pytest.fixture(autouse=True)
def _tmpdir(tmp_path):
    _TMP.clear()
    _TMP["dir"] = tmp_path


def _nest(key: str, value) -> dict:
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


# key -> (a value, the Flags field it sets, what the field then holds)
FLAG_VALUES = {
    "gradient_clipping": (0.5, "clip_grad", 0.5), "steps_per_print": (7, "log_interval", 7),
    "wall_clock_breakdown": (True, "timing_breakdown", True),
    "data_types.grad_accum_dtype": ("fp32", "accumulate_allreduce_grads_in_fp32", True),
    "fp16.enabled": (True, "fp16", True), "fp16.loss_scale": (128, "loss_scale", 128.0),
    "fp16.initial_scale_power": (12, "initial_loss_scale", 4096.0),
    "fp16.loss_scale_window": (500, "loss_scale_window", 500),
    "fp16.hysteresis": (3, "hysteresis", 3), "fp16.min_loss_scale": (2, "min_loss_scale", 2.0),
    "bf16.enabled": (True, "bf16", True),
    "zero_optimization.stage": (2, "zero_stage", 2),
    "zero_optimization.overlap_comm": (True, "overlap_comm", True),
    "zero_optimization.reduce_bucket_size": (5e8, "reduce_bucket_size", 500_000_000),
    "zero_optimization.allgather_bucket_size": (2e8, "allgather_bucket_size", 200_000_000),
    "zero_optimization.stage3_param_persistence_threshold": (
        1e4, "zero_param_persistence_threshold", 10_000),
    "zero_optimization.cpu_offload": (True, "offload_optimizer", "cpu"),
    "zero_optimization.cpu_offload_use_pin_memory": (True, "offload_pin_memory", True),
    "zero_optimization.cpu_offload_params": (True, "offload_param", "cpu"),
    "zero_optimization.offload_optimizer.device": ("nvme", "offload_optimizer", "nvme"),
    "zero_optimization.offload_optimizer.nvme_path": ("/swap", "offload_nvme_path", "/swap"),
    "zero_optimization.offload_optimizer.pin_memory": (True, "offload_pin_memory", True),
    "zero_optimization.offload_optimizer.buffer_count": (6, "offload_buffer_count", 6),
    "zero_optimization.offload_param.device": ("cpu", "offload_param", "cpu"),
    "zero_optimization.offload_param.nvme_path": ("/swap", "offload_nvme_path", "/swap"),
    "zero_optimization.offload_param.pin_memory": (False, "offload_pin_memory", False),
    "aio.use_gds": (True, "offload_gds", True),
    "activation_checkpointing.partition_activations": (True, "partition_activations", True),
    "activation_checkpointing.cpu_checkpointing": (True, "cpu_checkpointing", True),
    "activation_checkpointing.contiguous_memory_optimization": (
        True, "contiguous_checkpointing", True),
}


def test_the_table_is_covered():
    """Every Flag rule has a case here, so a new key cannot land untested."""
    flags = {k for k, r in KEYS.items() if isinstance(r, Flag)}
    assert flags == set(FLAG_VALUES)


@pytest.mark.parametrize("key", sorted(FLAG_VALUES))
def test_each_flag_key_sets_its_field(key):
    value, field, want = FLAG_VALUES[key]
    f = Flags(checkpoint_activations=True)  # (activation_checkpointing needs recompute)
    notes = apply_ds_config(f, _nest(key, value), dp=2)
    assert getattr(f, field) == want and notes == []


def test_every_hint_warns_by_name_and_every_refusal_stops_by_name():
    for key, rule in KEYS.items():
        if isinstance(rule, Hint):
            notes = apply_ds_config(Flags(), _nest(key, 7), dp=1)
            assert notes == [f"{key}: no effect in hybrid ({rule.why})"], key
            assert apply_ds_config(Flags(), _nest(key, rule.same[0]), dp=1) == [], key
        elif isinstance(rule, Refuse):
            with pytest.raises(ConfigError, match=f"ds_config {key} .*{rule.why[:20]}"):
                apply_ds_config(Flags(), _nest(key, "on"), dp=1)
            assert apply_ds_config(Flags(), _nest(key, rule.ok[0]), dp=1) == [], key
        else:
            assert isinstance(rule, (Flag, Custom)), key


def test_unknown_keys_are_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="ds_config zero_optimization.stagee .* did you mean "
                                          "zero_optimization.stage"):
        apply_ds_config(Flags(), {"zero_optimization": {"stagee": 2}}, dp=1)
    with pytest.raises(ConfigError, match="ds_config optimizer.params.momentum"):
        apply_ds_config(Flags(), {"optimizer": {"type": "Adam", "params": {"momentum": 1}}},
                        dp=1)
    with pytest.raises(ConfigError, match="is 'Lamb': hybrid trains with AdamW"):
        apply_ds_config(Flags(), {"optimizer": {"type": "Lamb"}}, dp=1)
    with pytest.raises(ConfigError, match="adam_w_mode"):
        apply_ds_config(Flags(), {"optimizer": {"type": "Adam",
                                                "params": {"adam_w_mode": False}}}, dp=1)


def test_bad_files_are_one_error_naming_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    for path, what in ((bad, "not readable JSON"), (tmp_path / "none.json", "no such file")):
        with pytest.raises(ConfigError, match=f"--deepspeed_config {path}: {what}"):
            build_config(parse_args(["--deepspeed_config", str(path)]), 1)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="one JSON object, got list"):
        build_config(parse_args(["--deepspeed_config", str(bad)]), 1)


def test_batch_sizes_any_two_give_the_third():
    cfg = _cfg({"train_batch_size": 16, "gradient_accumulation_steps": 2})
    assert (cfg.loop.micro_batch_size, cfg.loop.global_batch_size) == (4, 16)
    assert cfg.num_micro_batches == 2
    cfg = _cfg({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4})
    assert (cfg.loop.micro_batch_size, cfg.loop.global_batch_size) == (3, 24)
    cfg = _cfg({"train_batch_size": 8})  # alone: accumulation 1
    assert (cfg.loop.micro_batch_size, cfg.loop.global_batch_size) == (4, 8)
    with pytest.raises(ConfigError, match=r"train_batch_size 16 != train_micro_batch_size_per"
                                          r"_gpu 4 x gradient_accumulation_steps 3 x "
                                          r"data-parallel size 2"):
        _cfg({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match=r"train_batch_size 10 is not a multiple of "
                                          r"train_micro_batch_size_per_gpu 4 x data-parallel "
                                          r"size 2"):
        _cfg({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})


def test_the_file_and_the_command_line_may_not_disagree():
    ds = {"train_batch_size": 16, "gradient_clipping": 1.0}
    with pytest.raises(ConfigError, match=r"train_batch_size \(.*\) is 16 but the command "
                                          r"line gives --global-batch-size 32"):
        _cfg(ds, "--global-batch-size", "32")
    with pytest.raises(ConfigError, match="gradient_clipping .* --clip-grad 0.5"):
        _cfg(ds, "--clip-grad", "0.5")
    cfg = _cfg(ds, "--global-batch-size", "16", "--clip-grad", "1.0")  # agreeing is fine
    assert cfg.loop.global_batch_size == 16
    # a flag at its default yields to the file
    assert _cfg({"zero_optimization": {"stage": 2}}).zero.stage == 2
    with pytest.raises(ConfigError, match="zero_optimization.stage .* --zero-stage 1"):
        _cfg({"zero_optimization": {"stage": 2}}, "--zero-stage", "1")


def test_auto_takes_the_command_line_or_the_width():
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}}
    cfg = _cfg(ds, "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size",
               "3", "--global-batch-size", "12", "--clip-grad", "0.7", "--bf16", "--lr", "2e-4")
    assert (cfg.loop.micro_batch_size, cfg.loop.global_batch_size) == (3, 12)
    assert cfg.adamw.clip_grad == 0.7 and cfg.precision.params_dtype == "bf16"
    assert cfg.zero.reduce_bucket_size == 64 * 64
    assert cfg.zero.param_persistence_threshold == 640
    assert cfg.lr_schedule.lr == 2e-4 and cfg.adamw.beta2 == Flags.adam_beta2


def test_optimizer_and_schedulers():
    opt = {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9], "eps": 1e-6,
                                      "weight_decay": 0.05}}
    cfg = _cfg({"optimizer": opt}, "--train-iters", "50")
    a = cfg.adamw
    assert (a.beta1, a.beta2, a.eps, a.weight_decay, cfg.lr_schedule.lr) == (
        0.8, 0.9, 1e-6, 0.05, 1e-3)
    # WarmupLR: log warmup from warmup_min_lr, then constant at warmup_max_lr (which
    # sets the rate, as DeepSpeed's scheduler does over the optimizer's lr)
    cfg = _cfg({"optimizer": opt, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}}},
        "--train-iters", "50")
    s = cfg.lr_schedule
    assert (s.lr, s.warmup_init, s.warmup, s.warmup_style, s.decay_style) == (
        3e-4, 1e-5, 10, "log", "constant")
    assert scheduled_lr(s, 1, 0) == 1e-5 and scheduled_lr(s, 10, 0) == 3e-4
    assert scheduled_lr(s, 5, 0) == pytest.approx(1e-5 + (3e-4 - 1e-5) * 0.69897, rel=1e-4)
    assert scheduled_lr(s, 40, 0) == 3e-4
    # WarmupDecayLR: then linear down to warmup_min_lr at total_num_steps
    cfg = _cfg({"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear",
        "total_num_steps": 20}}}, "--train-iters", "20")
    s = cfg.lr_schedule
    assert (s.warmup_style, s.decay_style, s.decay, s.min_lr) == ("linear", "linear", 20, 0.0)
    assert scheduled_lr(s, 2, 0) == pytest.approx(5e-4) and scheduled_lr(s, 20, 0) == 0.0
    # WarmupCosineLR: ratios of the optimizer's lr
    cfg = _cfg({"optimizer": opt, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 30, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.01}}}, "--train-iters", "30")
    s = cfg.lr_schedule
    assert (s.warmup_init, s.min_lr, s.decay_style, s.decay) == (
        pytest.approx(1e-4), pytest.approx(1e-5), "cosine", 30)
    for bad, msg in ((({"type": "OneCycle"}), "hybrid runs WarmupLR"),
                     ({"type": "WarmupDecayLR", "params": {}}, "total_num_steps is required"),
                     ({"type": "WarmupLR", "params": {"gamma": 1}}, "not a parameter of "
                                                                    "WarmupLR")):
        with pytest.raises(ConfigError, match=msg):
            _cfg({"scheduler": bad})


def test_tensorboard_and_megatron_deepspeed_flags(tmp_path):
    cfg = _cfg({"tensorboard": {"enabled": True, "output_path": str(tmp_path),
                                "job_name": "run1"}})
    assert cfg.logging.tensorboard_dir == str(tmp_path / "run1")
    # Megatron-DeepSpeed's command line: --deepspeed marker, their spellings
    ds = _write({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    f = parse_args(["--deepspeed", "--deepspeed_config", ds, "--zero-stage", "1",
                    "--deepspeed-activation-checkpointing", "--checkpoint-activations",
                    "--partition-activations", "--contigious-checkpointing",
                    "--checkpoint-in-cpu", "--synchronize-each-layer", "--remote-device",
                    "none", "--cpu-optimizer", "--use-pin-memory"])
    cfg = build_config(f, 2)
    r = cfg.recompute
    assert (r.granularity, r.partition_activations, r.contiguous_checkpointing,
            r.cpu_checkpointing) == ("full", True, True, True)
    assert cfg.offload.optimizer == "cpu" and cfg.offload.pin_memory is True
    assert "--synchronize-each-layer" in f.ignored_megatron_flags
    # Hugging Face's Trainer spelling: --deepspeed FILE
    assert build_config(parse_args(["--deepspeed", ds]), 2).zero.stage == 1


DOCS_STYLE = {  # as DeepSpeed's ZeRO tutorial writes one (shrunk to the tiny model)
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 1,
    "wall_clock_breakdown": True,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 3, "contiguous_gradients": True, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "allgather_bucket_size": 5e8,
                          "offload_optimizer": {"device": "cpu"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999],
                                              "eps": 1e-8, "weight_decay": 0.01}},
}
AS_FLAGS = ["--global-batch-size", "8", "--micro-batch-size", "2", "--clip-grad", "1.0",
            "--log-interval", "1", "--timing-breakdown", "--fp16", "--initial-loss-scale", "4096",
            "--loss-scale-window", "1000", "--hysteresis", "2", "--min-loss-scale", "1",
            "--zero-stage", "3", "--overlap-comm", "--reduce-bucket-size", "500000000",
            "--allgather-bucket-size", "500000000", "--offload-optimizer", "cpu", "--lr",
            "1e-3", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
            "--weight-decay", "0.01"]


def test_a_docs_style_config_trains_as_its_flags_bit_for_bit(tmp_path):
    """DP 2 through the training script: the ds_config run and the flags run log the same
    losses and gradient norms, to the last bit."""
    drop = {"--micro-batch-size", "--log-interval"}  # the file sets them
    base = [v for i, v in enumerate(TINY) if v not in drop and TINY[i - 1] not in drop]
    base += ["--train-iters", "3", "--eval-iters", "0"]
    logs = []
    for name, extra in (("ds", ["--deepspeed", "--deepspeed_config", _write(DOCS_STYLE)]),
                        ("flags", AS_FLAGS)):
        log = str(tmp_path / f"{name}.jsonl")
        r = pretrain(2, base + extra + ["--log-json", log])
        assert r.returncode == 0, r.stderr[-3000:]
        logs.append(read_json_log(log))
    ds, flags = logs
    assert len(ds) == len(flags) == 3
    assert [m["loss"] for m in ds] == [m["loss"] for m in flags]
    assert [m["grad_norm"] for m in ds] == [m["grad_norm"] for m in flags]
    assert ds[-1]["loss_scale"] == flags[-1]["loss_scale"]
    for m in ds + flags:  # wall_clock_breakdown: each phase timed, every log line
        assert set(m["time_breakdown_s"]) == {"forward", "backward", "optimizer"}
        assert all(v > 0 for v in m["time_breakdown_s"].values())


def test_the_docs_table_lists_every_key():
    import os
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "deepspeed.md"),
               encoding="utf-8").read()
    missing = [k for k in KEYS if f"| `{k}` |" not in doc]
    assert not missing, missing


def test_activation_checkpointing_keys_wait_for_recompute():
    """Without whole-layer recompute the section has nothing to configure (as in
    Megatron-DeepSpeed): noted by name, not applied, not an error."""
    cfg = _cfg({"activation_checkpointing": {"partition_activations": True,
                                             "cpu_checkpointing": True}})
    assert not cfg.recompute.partition_activations and not cfg.recompute.cpu_checkpointing
    assert len(cfg.flags.ds_config_notes) == 2
    assert cfg.flags.ds_config_notes[0].startswith(
        "activation_checkpointing.partition_activations: no effect without whole-layer")
    cfg = _cfg({"activation_checkpointing": {"partition_activations": True}},
               "--recompute-granularity", "full")
    assert cfg.recompute.partition_activations
