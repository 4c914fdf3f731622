"""A DeepSpeed ds_config.json drives hybrid: every key in the table is honored (the
config sections checked field by field), accepted with a named warning, or refused
by name; "auto" resolves as Hugging Face's integration does; the file and the
command line may not contradict each other; and a config written the way
DeepSpeed's docs show it trains exactly as the same run given as flags."""

import json

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.deepspeed import apply_ds_config
from hybrid.config.deepspeed_keys import KEYS, Custom, Flag, Hint, Refuse, kind_of, quiet
from hybrid.config.flags import Flags
from hybrid.config.lr_schedule import scheduled_lr
from hybrid.errors import ConfigError
from tests.helpers.launch import TINY, pretrain, read_json_log, script_module


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
    "checkpoint.writer.decoupled": (True, "async_save", True),
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
    "zero_optimization.ignore_unused_parameters": (False, "ignore_unused_parameters", False),
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


def _asking(rule):
    """A value of the rule's kind that asks for something (a knob set, a feature on)."""
    return {"bool": True not in quiet(rule), "int": 7, "number": 0.5, "string": "fp16",
            "object": {"enabled": True}}[rule.kind.base]


def test_every_hint_warns_by_name_and_every_refusal_stops_by_name():
    """... each checked against its type first; null, an empty or disabled section, and
    the rule's own values ask for nothing."""
    for key, rule in KEYS.items():
        nothing = (None, {}, {"enabled": False}) if kind_of(rule).base == "object" else (None,)
        if isinstance(rule, Hint):
            notes = apply_ds_config(Flags(), _nest(key, _asking(rule)), dp=1)
            assert notes == [f"{key}: no effect in hybrid ({rule.why})"], key
            for off in nothing + quiet(rule):
                assert apply_ds_config(Flags(), _nest(key, off), dp=1) == [], (key, off)
        elif isinstance(rule, Refuse):
            with pytest.raises(ConfigError, match=f"ds_config {key} .*{rule.why[:20]}"):
                apply_ds_config(Flags(), _nest(key, _asking(rule)), dp=1)
            for off in nothing + quiet(rule):
                assert apply_ds_config(Flags(), _nest(key, off), dp=1) == [], (key, off)
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
    with pytest.raises(ConfigError, match=r"^ds_config gradient_clipping must be >= 0, "
                                          r"got -1.0$"):  # its own key, nothing else's
        _cfg({"gradient_clipping": -1.0})
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
    # DeepSpeed's counting: the start for steps 1 and 2, step k at log(k - 1) / log(10)
    assert scheduled_lr(s, 1, 0) == scheduled_lr(s, 2, 0) == 1e-5
    assert scheduled_lr(s, 11, 0) == 3e-4 and scheduled_lr(s, 40, 0) == 3e-4
    assert scheduled_lr(s, 5, 0) == pytest.approx(1e-5 + (3e-4 - 1e-5) * 0.60206, rel=1e-4)
    # WarmupDecayLR: then linear down to warmup_min_lr at total_num_steps
    cfg = _cfg({"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear",
        "total_num_steps": 20}}}, "--train-iters", "20")
    s = cfg.lr_schedule
    assert (s.warmup_style, s.decay_style, s.decay, s.min_lr) == ("linear", "linear", 20, 0.0)
    assert scheduled_lr(s, 4, 0) == pytest.approx(5e-4) and scheduled_lr(s, 22, 0) == 0.0
    # WarmupCosineLR: ratios of the optimizer's lr
    cfg = _cfg({"optimizer": opt, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 30, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.01}}}, "--train-iters", "30")
    s = cfg.lr_schedule
    assert (s.warmup_init, s.min_lr, s.decay_style, s.decay) == (
        pytest.approx(1e-4), pytest.approx(1e-5), "cosine", 30)
    for bad, msg in ((({"type": "OneCycle"}), "hybrid runs WarmupLR"),
                     ({"type": "WarmupDecayLR", "params": {}},
                      r"scheduler.params.total_num_steps \(.*\) is required by WarmupDecayLR"),
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
    from pathlib import Path
    doc = (Path(__file__).parent / ".." / ".." / "docs" / "deepspeed.md").read_text(
        encoding="utf-8")
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


# -- values are checked against their type, not converted (hybrid/config/kinds.py) ----------
def _error(ds, *argv, world=2) -> str:
    """The one ConfigError ``ds`` gets, its file's path written as F."""
    path = _write(ds)
    with pytest.raises(ConfigError) as e:
        build_config(parse_args(["--deepspeed_config", path, *argv]), world)
    return str(e.value).replace(path, "F")


def test_every_key_has_a_type():
    """Declared in the table, or (a Flag without a conversion) its field's annotation."""
    for key, rule in KEYS.items():
        assert kind_of(rule).base in ("bool", "int", "number", "string", "object", "pair",
                                      "choice"), key
        if isinstance(rule, Flag) and rule.convert is not None:
            assert rule.kind is not None, f"{key} converts its value: declare the kind it takes"


WRONG_TYPES = [
    # switches: JSON true/false, not a quoted word or a number (Python's bool("false") is True)
    ({"fp16": {"enabled": "false"}},
     'ds_config fp16.enabled (F) must be true or false, got "false": write false without quotes'),
    ({"bf16": {"enabled": "yes"}},
     'ds_config bf16.enabled (F) must be true or false, got "yes": write true without quotes'),
    ({"fp16": {"enabled": 1}}, "ds_config fp16.enabled (F) must be true or false, got 1: "
                               "write true"),
    ({"wall_clock_breakdown": "True"}, 'ds_config wall_clock_breakdown (F) must be true or '
                                       'false, got "True": write true without quotes'),
    ({"zero_optimization": {"offload_optimizer": {"pin_memory": "no"}}},
     'ds_config zero_optimization.offload_optimizer.pin_memory (F) must be true or false, '
     'got "no": write false without quotes'),
    ({"compile": {"enabled": "false"}}, 'ds_config compile.enabled (F) must be true or false, '
                                        'got "false": write false without quotes'),
    # a knob and a refused feature are typed too: "false" is not refused as "on"
    ({"zero_optimization": {"contiguous_gradients": "true"}},
     'ds_config zero_optimization.contiguous_gradients (F) must be true or false, got "true": '
     'write true without quotes'),
    ({"prescale_gradients": "false"}, 'ds_config prescale_gradients (F) must be true or '
                                      'false, got "false": write false without quotes'),
    ({"wandb": {"enabled": "false"}}, 'ds_config wandb.enabled (F) must be true or false, '
                                      'got "false": write false without quotes'),
    # stages and counts: whole numbers
    ({"zero_optimization": {"stage": 2.7}},
     "ds_config zero_optimization.stage (F) must be a whole number, got 2.7"),
    ({"zero_optimization": {"stage": "2"}},
     'ds_config zero_optimization.stage (F) must be a whole number, got "2": write 2 without '
     'quotes'),
    ({"zero_optimization": {"stage": True}},
     "ds_config zero_optimization.stage (F) must be a whole number, got true"),
    ({"train_batch_size": 8.5}, "ds_config train_batch_size (F) must be a whole number, got 8.5"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10.5}}},
     "ds_config scheduler.params.warmup_num_steps (F) must be a whole number, got 10.5"),
    # rates: numbers (true is not one, nor a quoted number)
    ({"gradient_clipping": True}, "ds_config gradient_clipping (F) must be a number, got true"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}},
     'ds_config optimizer.params.lr (F) must be a number, got "1e-3": write 1e-3 without quotes'),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
     "ds_config optimizer.params.betas (F) must be two numbers ([a, b]), got [0.9]"),
    # names from a list
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     'ds_config zero_optimization.offload_optimizer.device (F) must be one of none, cpu, nvme, '
     'null, got "gpu"'),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
     'ds_config scheduler.params.warmup_type (F) must be one of log, linear, got "cosine"'),
]


@pytest.mark.parametrize("ds,message", WRONG_TYPES, ids=[m.split()[1] for _, m in WRONG_TYPES])
def test_a_value_of_the_wrong_type_is_one_error_naming_the_key(ds, message):
    assert _error(ds) == message


def test_whole_numbers_may_be_written_as_json_writes_them():
    """JSON has one number type: 2.0 is the stage 2, and 5e8 (a float to Python) a size."""
    cfg = _cfg({"zero_optimization": {"stage": 2.0, "reduce_bucket_size": 5e8}})
    assert cfg.zero.stage == 2 and type(cfg.zero.stage) is int
    assert cfg.zero.reduce_bucket_size == 500_000_000 and type(cfg.zero.reduce_bucket_size) is int
    assert _cfg({"fp16": {"enabled": False}, "gradient_clipping": 1}).adamw.clip_grad == 1.0


@pytest.mark.parametrize("ds,message", [
    ({"zero_optimization": 3}, 'ds_config zero_optimization (F) must be an object ({"key": '
                               'value, ...}), got 3'),
    ({"zero_optimization": None}, 'ds_config zero_optimization (F) must be an object ({"key": '
                                  'value, ...}), got null: leave it out, or write {}'),
    ({"fp16": True}, 'ds_config fp16 (F) must be an object ({"key": value, ...}), got true'),
    ({"optimizer": "AdamW"}, 'ds_config optimizer (F) must be an object ({"key": value, ...}), '
                             'got "AdamW"'),
    ({"scheduler": {"type": "WarmupLR", "params": None}},
     'ds_config scheduler.params (F) must be an object ({"key": value, ...}), got null: leave '
     'it out, or write {}'),
])
def test_a_known_section_of_the_wrong_type_says_so(ds, message):
    """... instead of "not a key hybrid knows" (or a crash on 'int' object has no 'get')."""
    assert _error(ds) == message


def test_a_check_names_the_key_that_set_the_value():
    """The range checks speak in flags; a value the file gave is named by its key."""
    assert _error({"zero_optimization": {"stage": 5}}) == (
        "ds_config zero_optimization.stage must be 0, 1, 2 or 3, got 5")
    assert _error({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == (
        "ds_config bf16.enabled and ds_config fp16.enabled are exclusive: pick one")
    assert _error({"steps_per_print": 0}) == "ds_config steps_per_print must be >= 1, got 0"
    # a scheduler's default is named as one: here it outlasts the scheduler's own decay
    assert _error({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}
                  ) == ("ds_config scheduler.params.warmup_num_steps (WarmupDecayLR's default) "
                        "1000 exceeds ds_config scheduler.params.total_num_steps 100 (the decay "
                        "length; --train-iters by default): warm up for fewer, or decay over more")
    # the flag still, where the command line gave the value
    assert _error({"gradient_clipping": 1.0}, "--zero-stage", "5") == (
        "--zero-stage must be 0, 1, 2 or 3, got 5")


def test_a_batch_size_clash_names_the_sizes_the_user_gave():
    """Each size from its key, or from its flag where the file leaves it out; never a
    size the file did not give (a derived train_micro_batch_size_per_gpu)."""
    message = _error({"train_batch_size": 8}, "--global-batch-size", "4",
                     "--micro-batch-size", "2")
    assert message == ("ds_config train_batch_size (F) is 8 but the command line gives "
                       "--global-batch-size 4: drop one or make them equal")
    assert _error({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
                  "--global-batch-size", "4") == (
        "--global-batch-size 4 != train_micro_batch_size_per_gpu 2 x "
        "gradient_accumulation_steps 2 x data-parallel size 2 (ds_config F)")
    assert _error({"train_batch_size": 8}, "--micro-batch-size", "3") == (
        "train_batch_size 8 is not a multiple of --micro-batch-size 3 x data-parallel size 2 "
        "(ds_config F)")
    # two given on either side give the third
    cfg = _cfg({"train_batch_size": 8}, "--micro-batch-size", "2")
    assert (cfg.loop.micro_batch_size, cfg.num_micro_batches) == (2, 2)
    cfg = _cfg({"gradient_accumulation_steps": 2}, "--global-batch-size", "4")
    assert (cfg.loop.micro_batch_size, cfg.loop.global_batch_size) == (1, 4)


@pytest.mark.parametrize("ds,message", [
    ({"fp16": {"enabled": "false"}}, "ds_config fp16.enabled ({path}) must be true or false, "
                                     "got \"false\": write false without quotes"),
    ({"zero_optimization": {"stage": 2.7}},
     "ds_config zero_optimization.stage ({path}) must be a whole number, got 2.7"),
])
def test_the_launcher_preflight_refuses_it_in_one_line(ds, message, capsys, monkeypatch):
    """scripts/pretrain_gpt.py --check-config (what pretrain_gpt.sh runs before any worker):
    exit 2, one line naming the key."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    path = _write(ds)
    rc = script_module("pretrain_gpt").main(["--check-config", "--deepspeed_config", path])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.splitlines() == ["pretrain_gpt.py: error: " + message.format(path=path)]
