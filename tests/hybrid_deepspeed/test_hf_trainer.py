"""A ``transformers.Trainer`` script on hybrid's engine with its import the one change
(``from hybrid.deepspeed.hf import Trainer, TrainingArguments``), at 2 ranks: a tiny
BertForSequenceClassification (a hand-written BertConfig, no download) on synthetic
labels, ZeRO-3 with ``offload_optimizer: cpu``, every value the Trainer knows written
``"auto"``. Against the Trainer's own run without DeepSpeed (DDP over gloo, the same
initialization, batches and TrainingArguments), two ways: the config's ``optimizer``
(AdamW) and ``scheduler`` (WarmupLR) blocks, and no blocks (the Trainer's own AdamW and
schedule stepping the shards). Both log the plain run's losses, gradient norms, rates
and eval loss; the loss falls; ``save_model`` writes the plain run's weights, gathered;
a new Trainer resumed from ``checkpoint-5`` (with activation checkpointing) repeats the
last steps exactly; each rank holds about half the parameters and its optimizer states
on the host. Peak memory per rank (resident set) is measured for both runs and
reported. The refusals (a second ``train()``, a short accumulation window) and the
``"auto"`` rules on their own (no transformers) are here too.

The logged loss of this model is its cross-entropy times the process count and the
accumulation steps (transformers scales the loss of a model that takes loss keyword
arguments so, in both runs alike).

[Note: the tolerance] Both runs are fp32 and do the same arithmetic up to order (the
gradient average: DDP's bucketed all-reduce, the engine's reduce-scatter; clipping;
AdamW: torch's, the engine's host step), so they differ by rounding: over the 8 steps
by at most 1 ulp of a loss (9.5e-8 relative), 1.4e-7 relative in a gradient norm and
1.1e-7 in the eval loss. The bound, 1e-6 relative, is a few ulps over that; a routing
mistake moves them far more: a skipped, repeated or early optimizer step, or a wrong
rate, changes the next loss by 5e-3 or more (it falls by 0.006 to 0.3 a step here), a
gradient scaled twice doubles the logged norm. Two settings keep rounding from being
amplified: ``adam_epsilon`` 1e-3 (Adam divides each gradient element by sqrt(v) + eps,
so an element whose true gradient is zero, as an attention key bias's, turns a
last-bit difference into an update of about lr: tests/helpers/zero_reference.py says
the same) and no weight decay, the Trainer's default (with an ``optimizer`` block it
applies to every parameter, as under DeepSpeed; the plain Trainer exempts biases and
norms: docs/deepspeed.md).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from hybrid.deepspeed.hf import auto
from hybrid.errors import ConfigError
from tests.helpers.harness import run_ranks
from tests.helpers.launch import free_port

needs_trainer = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="the Trainer route needs transformers and accelerate (pip install -e '.[dev]')")

LR = 5e-3
VOCAB, SEQ = 64, 8
# A Trainer script's ds_config as Hugging Face's docs write one: every value the Trainer
# knows is "auto". The rate is constant (warmup from the peak to the peak), so the
# schedule is the plain run's lr_scheduler_type="constant" step for step.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": LR, "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


def _bert():
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=2 * SEQ, num_labels=2,
                        # no dropout: the comparison is of the engines, not of RNG streams
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


class Labelled(torch.utils.data.Dataset):
    """Random token rows, labelled by whether their first token is in the lower half of
    the vocabulary (what the pooled first position learns in a few steps)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.labels = (self.ids[:, 0] < VOCAB // 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def _settings(out: str) -> dict:
    """The TrainingArguments both runs share: 2 ranks x 4 samples x 2 micro-batches a
    step, 64 samples an epoch (4 steps), 2 epochs."""
    return dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_train_epochs=2, learning_rate=LR,
                adam_epsilon=1e-3, lr_scheduler_type="constant", logging_steps=1,
                save_strategy="no",
                per_device_eval_batch_size=8, report_to=[], disable_tqdm=True, seed=7)


def _peak_reset() -> None:
    """The resident-set peak (VmHWM) starts again from the current size (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return kib / 1024


def _quiet(trainer) -> None:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def _train_and_evaluate(trainer) -> dict:
    _peak_reset()
    trainer.train()
    evaluated = trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
            "lrs": [h["learning_rate"] for h in logs], "eval_loss": evaluated["eval_loss"],
            "peak_mib": _peak_mib()}


def _refused(run) -> str:
    from hybrid.errors import ConfigError
    try:
        run()
    except ConfigError as e:
        return str(e)
    return "not refused"


def _routes(ps, tmp):
    # what torchrun gives each worker: accelerate reads the job from these (the pooled
    # ranks' default group already exists, so neither run starts another)
    os.environ.update(RANK=str(ps.rank), WORLD_SIZE=str(ps.world_size),
                      LOCAL_RANK=str(ps.rank), LOCAL_WORLD_SIZE=str(ps.world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import transformers
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from hybrid.deepspeed.hf import Trainer, TrainingArguments
    train, dev = Labelled(64, seed=1), Labelled(32, seed=2)
    out = {}

    # the Trainer's own run without DeepSpeed: DDP over the CPU processes
    plain = transformers.Trainer(
        model=_bert(), train_dataset=train, eval_dataset=dev,
        args=transformers.TrainingArguments(use_cpu=True, **_settings(f"{tmp}/plain")))
    _quiet(plain)
    out["plain"] = _train_and_evaluate(plain)
    plain_weights = {k: v.detach().clone() for k, v in plain.model.state_dict().items()}
    del plain

    # the same script through hybrid.deepspeed.hf: TrainingArguments(deepspeed=...)
    args = TrainingArguments(deepspeed=DS_CONFIG, **{**_settings(f"{tmp}/hybrid"),
                                                     "save_strategy": "steps", "save_steps": 5})
    out["untouched"] = args.deepspeed is DS_CONFIG and DS_CONFIG["gradient_clipping"] == "auto"
    out["zero3_global"] = is_deepspeed_zero3_enabled()  # no DeepSpeed zero.Init on models
    model = _bert()
    numel = sum(p.numel() for p in model.parameters())
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev)
    _quiet(trainer)
    out["hybrid"] = _train_and_evaluate(trainer)
    engine = trainer.engine
    out["engine"] = {"stage": engine.zero_optimization_stage(), "steps": engine.global_steps,
                     "wrapped": trainer.model_wrapped is engine and trainer.deepspeed is engine,
                     "states": engine.zero.model_state_bytes(), "numel": numel,
                     "config": args.hybrid_ds_config}
    trainer.save_model(f"{tmp}/saved")  # collective: every rank gathers, rank 0 writes
    out["refit"] = _refused(trainer.train)
    torch.distributed.barrier()  # rank 0 has written the weights
    saved = type(model).from_pretrained(f"{tmp}/saved").state_dict()
    out["saved_diff"] = max((saved[k] - v).abs().max().item() for k, v in plain_weights.items())
    engine.close()
    del trainer, engine

    # a new Trainer resumes from the checkpoint saved at step 5, a window into the second
    # epoch (weights, optimizer and schedule from the engine's checkpoint; the step, the
    # batches to skip and the RNG from the Trainer's), with transformers' activation
    # checkpointing on: its recompute in backward runs under ZeRO-3's gathers
    again = Trainer(model=_bert(), train_dataset=train, eval_dataset=dev,
                    args=TrainingArguments(deepspeed=DS_CONFIG, activation_checkpointing=True,
                                           **_settings(f"{tmp}/again")))
    _quiet(again)
    again.train(resume_from_checkpoint=f"{tmp}/hybrid/checkpoint-5")
    # (the history up to step 5 comes back with the Trainer's state)
    out["resumed"] = [h["loss"] for h in again.state.log_history
                      if "loss" in h and "train_loss" not in h][5:]
    out["checkpoint"] = sorted(os.listdir(f"{tmp}/hybrid/checkpoint-5"))
    out["recomputes"] = again.model.is_activation_checkpointing
    again.engine.close()
    del again

    # no "optimizer" or "scheduler" block: the Trainer's own AdamW and schedule, which
    # transformers hands DeepSpeed as client objects, step the shards
    own = {k: v for k, v in DS_CONFIG.items() if k not in ("optimizer", "scheduler")}
    trainer = Trainer(model=_bert(), train_dataset=train, eval_dataset=dev,
                      args=TrainingArguments(deepspeed=own, **_settings(f"{tmp}/own")))
    _quiet(trainer)
    out["own"] = _train_and_evaluate(trainer)
    out["own_kinds"] = (type(trainer.engine.optimizer.client).__name__,
                        type(trainer.engine.lr_scheduler).__name__)
    trainer.engine.close()
    del trainer
    # the engine steps whole windows only: an epoch of 8 micro-batches in windows of 3
    # would end with a short one (refused at train(), alike on both ranks)
    short = Trainer(model=_bert(), train_dataset=train, args=TrainingArguments(
        deepspeed=DS_CONFIG, **{**_settings(f"{tmp}/short"), "gradient_accumulation_steps": 3}))
    out["short_window"] = _refused(short.train)
    return out


def _same_run(got: dict, want: dict, what: str) -> None:
    """``got`` logged what ``want`` did (module note: the tolerance)."""
    assert len(got["losses"]) == len(want["losses"]) == 8, (what, got, want)
    for name in ("losses", "grad_norms"):
        for a, b in zip(got[name], want[name], strict=True):
            assert math.isclose(a, b, rel_tol=1e-6), (what, name, got[name], want[name])
    assert got["lrs"] == want["lrs"] == [LR] * 8, (what, got["lrs"], want["lrs"])
    assert math.isclose(got["eval_loss"], want["eval_loss"], rel_tol=1e-6), (
        what, got["eval_loss"], want["eval_loss"])


@needs_trainer
@pytest.mark.timeout(120)
def test_a_trainer_script_trains_on_hybrids_zero3_as_the_trainer_without_deepspeed(
        tmp_path, record_property):
    out = run_ranks(_routes, world_size=2, args=(str(tmp_path),))
    for rank, got in enumerate(out):
        plain, hybrid = got["plain"], got["hybrid"]
        _same_run(hybrid, plain, f"rank {rank}, the config's optimizer and scheduler")
        _same_run(got["own"], plain, f"rank {rank}, the Trainer's own optimizer and schedule")
        assert got["own_kinds"] == ("AdamW", "LambdaLR"), got["own_kinds"]
        assert hybrid["losses"][-1] < hybrid["losses"][0] - 0.5, hybrid["losses"]  # it learns
        # the weights rank 0 saved are the plain run's, gathered from the shards
        assert got["saved_diff"] < 1e-6, got["saved_diff"]
        # the user's ds_config is as written, and transformers' global ZeRO-3 switch (which
        # would build models under DeepSpeed's zero.Init) stays off
        assert got["untouched"] and not got["zero3_global"]
        assert got["recomputes"] and got["resumed"] == hybrid["losses"][5:], (
            got["resumed"], hybrid["losses"])
        assert {"iter_0000005", "latest", "model.safetensors",
                "trainer_state.json"} <= set(got["checkpoint"]), got["checkpoint"]

        engine = got["engine"]
        assert engine["wrapped"] and engine["stage"] == 3 and engine["steps"] == 8
        cfg = engine["config"]  # every "auto" the Trainer fills
        assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
                cfg["train_batch_size"], cfg["gradient_clipping"]) == (4, 2, 16, 1.0)
        assert cfg["optimizer"]["params"] == {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-3,
                                              "weight_decay": 0.0}
        assert cfg["scheduler"]["params"] == {"warmup_min_lr": LR, "warmup_max_lr": LR,
                                              "warmup_num_steps": 1}
        assert cfg["fp16"] == {"enabled": False} and cfg["bf16"] == {"enabled": False}
        zero = cfg["zero_optimization"]
        assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
                zero["stage3_param_persistence_threshold"]) == (32 * 32, int(0.9 * 32 * 32), 320)
        # ZeRO-3: each rank holds about half the fp32 parameters (those under 320 elements
        # stay whole on every rank); the optimizer's states are in host memory
        states, full = engine["states"], 4 * engine["numel"]
        assert states["params"] < 0.6 * full, (states, full)
        assert states["host"] == states["optimizer"] > 0, states

        assert "not a multiple of gradient_accumulation_steps 3" in got["short_window"], got
        assert "a second time" in got["refit"], got["refit"]
    report = {"losses": out[0]["hybrid"]["losses"], "plain_losses": out[0]["plain"]["losses"],
              "eval_loss": [out[0]["hybrid"]["eval_loss"], out[0]["plain"]["eval_loss"]],
              "peak_rss_mib_per_rank": [round(o["hybrid"]["peak_mib"], 1) for o in out],
              "plain_peak_rss_mib_per_rank": [round(o["plain"]["peak_mib"], 1) for o in out],
              "model_state_bytes_per_rank": [o["engine"]["states"]["total"] for o in out],
              "parameter_share_per_rank": [round(o["engine"]["states"]["params"]
                                                 / (4 * o["engine"]["numel"]), 3) for o in out]}
    record_property("hf_trainer", report)
    print("hf_trainer", report)


# -- the "auto" rules alone (no transformers: TrainingArguments' fields as a namespace) ----
def _training_arguments(**changes):
    from types import SimpleNamespace
    fields = dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, world_size=4,
                  max_grad_norm=0.5, learning_rate=1e-3, adam_beta1=0.8, adam_beta2=0.9,
                  adam_epsilon=1e-6, weight_decay=0.1, fp16=False, fp16_full_eval=True,
                  bf16=False, bf16_full_eval=False,
                  get_warmup_steps=lambda steps: math.ceil(0.1 * steps))
    return SimpleNamespace(**{**fields, **changes})


def _model(**config):
    from types import SimpleNamespace
    return SimpleNamespace(config=SimpleNamespace(**config))


def test_auto_values_are_the_training_arguments_and_only_where_the_config_has_them():
    written = {"train_batch_size": "auto", "gradient_clipping": "auto",
               "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                         "eps": "auto", "weight_decay": 0.1}},
               "scheduler": {"type": "WarmupDecayLR",
                             "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                        "warmup_num_steps": "auto", "total_num_steps": "auto"}},
               "fp16": {"enabled": "auto"},
               "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto"}}
    config = auto.read(written)
    filler = auto.Filler(config)
    args = _training_arguments()
    auto.fill_from_arguments(filler, args)
    auto.fill_from_run(filler, args, _model(hidden_size=8), num_training_steps=25)
    assert written["optimizer"]["params"]["lr"] == "auto"  # the caller's dict as written
    assert config == {
        "train_batch_size": 4 * 2 * 3, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9],
                                                  "eps": 1e-6, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                 "warmup_num_steps": 3, "total_num_steps": 25}},
        "fp16": {"enabled": True},  # fp16_full_eval counts, as in transformers
        # stage 2: the stage-3 sizes stay "auto" (hybrid's own rule sizes them)
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 64,
                              "stage3_param_persistence_threshold": "auto"}}
    # no warmup is one step, never 0; the width from a text config or the widest stage
    for model, width in ((_model(text_config=_model(hidden_size=6).config), 6),
                         (_model(hidden_sizes=[4, 16, 8]), 16)):
        config = auto.read({"scheduler": {"type": "WarmupLR", "params": {
            "warmup_num_steps": "auto"}}, "zero_optimization": {
            "stage": 3, "stage3_prefetch_bucket_size": "auto"}})
        auto.fill_from_run(auto.Filler(config), _training_arguments(
            get_warmup_steps=lambda steps: 0), model, num_training_steps=5)
        assert config["scheduler"]["params"]["warmup_num_steps"] == 1
        assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(
            0.9 * width * width)
    # training in fp16 with no fp16 block: one is added, as accelerate's DeepSpeed plugin does
    config = auto.read({})
    auto.fill_from_arguments(auto.Filler(config), _training_arguments(fp16=True))
    assert config == {"fp16": {"enabled": True}}


def test_a_value_that_disagrees_with_the_training_arguments_is_named_with_both():
    filler = auto.Filler(auto.read({
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3,
        "optimizer": {"params": {"lr": 0.1, "betas": [0.8, 0.9]}},
        "scheduler": {"params": {"warmup_min_lr": 5.0, "total_num_steps": 7}},
        "bf16": {"enabled": True}}))
    auto.fill_from_arguments(filler, _training_arguments())
    with pytest.raises(ConfigError) as e:
        auto.fill_from_run(filler, _training_arguments(), _model(hidden_size=8), 25)
    message = str(e.value)
    for line in ("ds_config train_micro_batch_size_per_gpu is 8 but TrainingArguments gives "
                 "per_device_train_batch_size = 2",
                 "ds_config optimizer.params.lr is 0.1 but TrainingArguments gives "
                 "learning_rate = 0.001",
                 "ds_config scheduler.params.total_num_steps is 7",
                 "ds_config bf16.enabled is True but TrainingArguments gives bf16 or "
                 "bf16_full_eval = False", 'write "auto" for these keys'):
        assert line in message, message
    # equal values (accumulation 3, the betas) and warmup_min_lr (no field) are no mismatch
    assert "gradient_accumulation_steps" not in message and "betas" not in message
    assert "warmup_min_lr" not in message


def test_a_width_key_left_auto_needs_the_models_hidden_size():
    filler = auto.Filler(auto.read({"zero_optimization": {"stage": 3,
                                                          "reduce_bucket_size": "auto"}}))
    with pytest.raises(ConfigError, match=r"reduce_bucket_size: \"auto\" is sized from the "
                                          r"model config's hidden_size"):
        auto.fill_from_run(filler, _training_arguments(), _model(), 10)


# -- the logged learning rate, as under DeepSpeed -------------------------------------------
# A linear WarmupLR over 4 steps, 6 steps: what transformers 5.24's Trainer logged as
# learning_rate on DeepSpeed 0.19.8 (one CPU rank, DeepSpeed's launcher, this script's
# _warmup_lrs with deepspeed's own Trainer; the peer test below runs it again). DeepSpeed's
# first two steps run at the warmup's start, and the Trainer logs each step's rate after
# the engine stepped the schedule: the next step's.
DEEPSPEED_WARMUP_LRS = [0.0, 0.00025, 0.0005, 0.00075, 0.001, 0.001]
WARMUP_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True,
                                              "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "warmup_type": "linear"}},
    "zero_optimization": {"stage": 0}}


def _warmup_lrs(ps, out: str, ours: bool = True):
    """The logged rates (and, on hybrid, the kernel cache the engine was built with)."""
    if ours:
        from hybrid.deepspeed.hf import Trainer, TrainingArguments
        from hybrid.kernels import settings
        before = settings.current()
        extra = {"kernel_cache_dir": os.path.join(out, "kernels")}
    else:
        from transformers import Trainer, TrainingArguments
        extra = {}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=6,
                             logging_steps=1, learning_rate=1e-3, warmup_steps=4,
                             deepspeed=WARMUP_CONFIG, use_cpu=True, report_to=[],
                             save_strategy="no", disable_tqdm=True, **extra)
    trainer = Trainer(model=_bert(), args=args, train_dataset=Labelled(32, 0))
    _quiet(trainer)
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    if not ours:
        return lrs
    trainer.engine.close()
    cache = settings.current().cache_dir
    settings.configure(before)  # (a pooled worker goes on to other tests)
    return lrs, cache


@needs_trainer
def test_the_logged_learning_rate_is_deepspeed_s(tmp_path):
    """Under a ds_config scheduler the Trainer logs DeepSpeed's numbers: the next step's
    rate (one step ahead of the rate the step ran at, which a Trainer without DeepSpeed
    logs). And hybrid's own argument, kernel_cache_dir, reaches the kernels."""
    ((got, cache),) = run_ranks(_warmup_lrs, world_size=1, args=(str(tmp_path),))
    assert got == pytest.approx(DEEPSPEED_WARMUP_LRS, abs=1e-12), got
    # TrainingArguments(kernel_cache_dir=...) is the cache the engine's kernels use
    assert cache == str(tmp_path / "kernels")


@pytest.mark.peer("deepspeed")
def test_deepspeed_s_trainer_logs_the_recorded_rates(tmp_path):
    """The recorded numbers are DeepSpeed's: transformers' own Trainer on DeepSpeed."""
    script = tmp_path / "warmup.py"
    script.write_text("import json, sys\n"
                      "from tests.hybrid_deepspeed.test_hf_trainer import _warmup_lrs\n"
                      f"print('LRS', json.dumps(_warmup_lrs(None, {str(tmp_path / 'o')!r}, "
                      "ours=False)))\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1",
                           "--master_port", str(free_port()), str(script)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LRS "))
    assert json.loads(line[4:]) == pytest.approx(DEEPSPEED_WARMUP_LRS, abs=1e-12)
