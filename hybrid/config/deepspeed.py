"""DeepSpeed's ds_config.json -> hybrid's flags, checked against the command line.

    flags = parse_args([... "--deepspeed_config", "ds_config.json"])
    cfg = build_config(flags, world_size)      # calls apply_ds_config first

Each key sets the :class:`Flags` field of the same meaning (the table in
:mod:`hybrid.config.deepspeed_keys`), so a run given a ds_config is the run
given those flags -- the same checks, sections and messages afterwards.

[Note: the file and the command line]
A key and a flag given on the command line that say different things are one
error naming both (DeepSpeed users move scripts that pass both). A flag left
at its default yields to the file. ``"auto"`` (Hugging Face's convention)
leaves a value to the command line, except three sizes it derives from the
width h: ``reduce_bucket_size`` h^2, ``stage3_prefetch_bucket_size`` 0.9 h^2,
``stage3_param_persistence_threshold`` 10 h.

[Note: batch sizes]
DeepSpeed's train_batch_size = micro x gradient_accumulation_steps x DP. Any two
give the third (one alone: accumulation 1); all three must agree. hybrid then
holds micro-batch size and global batch size, as Megatron does.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping

from hybrid.config.deepspeed_keys import KEYS, SECTIONS, Custom, Flag, Hint, Refuse
from hybrid.config.flags import Flags, flag_name
from hybrid.errors import ConfigError

_AUTO_FROM_WIDTH = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


def load_ds_config(source: str | Mapping) -> dict:
    """The config as a dict, from a path or a dict (the API's ``config=``)."""
    if isinstance(source, Mapping):
        return dict(source)
    if not os.path.isfile(source):
        raise ConfigError(f"--deepspeed_config {source}: no such file")
    try:
        with open(source, encoding="utf-8") as fh:
            ds = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--deepspeed_config {source}: not readable JSON ({e})") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed_config {source}: the file must hold one JSON object, "
                          f"got {type(ds).__name__}")
    return ds


class _Apply:
    """One pass over a ds_config, writing into ``f`` (see the module notes)."""

    def __init__(self, f: Flags, source: str, dp: int):
        self.f, self.source, self.dp = f, source, dp
        self.explicit = set(f.explicit_flags)
        self.notes: list[str] = []
        self.origin: dict[str, str] = {}  # flag field -> the key that set it

    def where(self, key: str) -> str:
        return f"ds_config {key} ({self.source})"

    def set(self, key: str, field: str, value) -> None:
        """``field`` <- ``value`` for ``key``, unless the command line or another key said
        otherwise."""
        current = getattr(self.f, field)
        if field in self.explicit and current != value:
            raise ConfigError(f"{self.where(key)} is {value!r} but the command line gives "
                              f"{flag_name(field)} {current!r}: drop one or make them equal")
        if field in self.origin and self.origin[field] != key and current != value:
            raise ConfigError(f"{self.where(key)} is {value!r} but {self.origin[field]} "
                              f"gives {current!r}: drop one or make them equal")
        setattr(self.f, field, value)
        self.origin[field] = key

    def walk(self, ds: Mapping, prefix: str = "") -> None:
        for name, value in ds.items():
            key = prefix + name
            rule = KEYS.get(key)
            if rule is None and key in SECTIONS and isinstance(value, Mapping):
                self.walk(value, key + ".")
            elif rule is None:
                raise ConfigError(_unknown(key, self.source))
            else:
                self.rule(key, rule, value)

    def rule(self, key: str, rule, value) -> None:
        if isinstance(rule, Custom):
            return  # read by its own handler
        if isinstance(rule, Refuse):
            if value in rule.ok or value == {}:
                return
            raise ConfigError(f"{self.where(key)}: hybrid does not implement it: {rule.why}")
        if isinstance(rule, Hint):
            if value in rule.same:
                return
            self.notes.append(f"{key}: no effect in hybrid ({rule.why})")
            return
        assert isinstance(rule, Flag)
        if value == "auto":
            derive = _AUTO_FROM_WIDTH.get(key)
            if derive is None:
                return  # the command line's (or the default) stands
            value = derive(self.f.hidden_size)
        try:
            value = rule.convert(value) if rule.convert else value
        except (TypeError, ValueError, KeyError):
            raise ConfigError(f"{self.where(key)}: {value!r} is not a valid value") from None
        self.set(key, rule.field, value)


def apply_ds_config(f: Flags, ds: Mapping, dp: int, source: str = "<dict>") -> list[str]:
    """Set ``f``'s fields from ``ds`` for a run of ``dp`` data-parallel ranks; returns the
    notes on keys accepted without effect (to log once). Raises ConfigError naming the
    key for an unknown or refused key, a bad value, or a contradiction."""
    ds = dict(ds)
    if "bfloat16" in ds:  # DeepSpeed's older name of the bf16 block
        ds.setdefault("bf16", ds.pop("bfloat16"))
    run = _Apply(f, source, dp)
    run.walk(ds)
    _batch(run, ds)
    _optimizer(run, ds.get("optimizer"))
    _scheduler(run, ds.get("scheduler"))
    _tensorboard(run, ds.get("tensorboard"))
    if isinstance(ds.get("compile"), Mapping):
        run.set("compile.enabled", "compile", bool(ds["compile"].get("enabled", False)))
    _checkpointing_applies(run)
    return run.notes


def _checkpointing_applies(run: _Apply) -> None:
    """The activation_checkpointing section configures whole-layer recompute; without
    it (no --checkpoint-activations / --recompute-granularity full) it has nothing to
    configure, as in Megatron-DeepSpeed: its keys are then noted, not applied."""
    f = run.f
    if f.recompute_granularity == "full" or f.checkpoint_activations:
        return
    for field in ("partition_activations", "cpu_checkpointing", "contiguous_checkpointing"):
        key = run.origin.get(field, "")
        if key.startswith("activation_checkpointing.") and getattr(f, field):
            setattr(f, field, False)
            run.notes.append(f"{key}: no effect without whole-layer recompute "
                             f"(--checkpoint-activations or --recompute-granularity full)")


def _unknown(key: str, source: str) -> str:
    close = difflib.get_close_matches(key, list(KEYS), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"ds_config {key} ({source}) is not a DeepSpeed key hybrid knows (README: "
            f"'Coming from DeepSpeed'){hint}")


def _int_or_auto(run: _Apply, ds: Mapping, key: str) -> int | None:
    v = ds.get(key)
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{run.where(key)}: {v!r} is not a positive whole number")
    return v


def _batch(run: _Apply, ds: Mapping) -> None:
    """train = micro x accumulation x DP (the module note)."""
    train = _int_or_auto(run, ds, "train_batch_size")
    micro = _int_or_auto(run, ds, "train_micro_batch_size_per_gpu")
    accum = _int_or_auto(run, ds, "gradient_accumulation_steps")
    if micro is None and train is not None:
        per = (accum or 1) * run.dp
        if train % per:
            raise ConfigError(f"ds_config train_batch_size {train} is not a multiple of "
                              f"gradient_accumulation_steps {accum or 1} x data-parallel size "
                              f"{run.dp} ({run.source})")
        micro = train // per
    if micro is not None:
        run.set("train_micro_batch_size_per_gpu", "micro_batch_size", micro)
    if train is None and accum is not None:
        train = run.f.micro_batch_size * accum * run.dp
    if train is not None:
        per = run.f.micro_batch_size * run.dp
        if accum is None and train % per:
            raise ConfigError(
                f"ds_config train_batch_size {train} is not a multiple of "
                f"train_micro_batch_size_per_gpu {run.f.micro_batch_size} x data-parallel size "
                f"{run.dp} ({run.source})")
        if accum is not None and train != run.f.micro_batch_size * accum * run.dp:
            raise ConfigError(
                f"ds_config train_batch_size {train} != train_micro_batch_size_per_gpu "
                f"{run.f.micro_batch_size} x gradient_accumulation_steps {accum} x "
                f"data-parallel size {run.dp} ({run.source})")
        run.set("train_batch_size", "global_batch_size", train)


def _optimizer(run: _Apply, block) -> None:
    """Adam/AdamW with decoupled weight decay: hybrid's AdamW."""
    if block is None:
        return
    kind = str(block.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"{run.where('optimizer.type')} is {block.get('type')!r}: hybrid "
                          f"trains with AdamW; use \"Adam\" or \"AdamW\"")
    for name in block:
        if name not in ("type", "params"):
            raise ConfigError(_unknown(f"optimizer.{name}", run.source))
    p = dict(block.get("params", {}))
    if p.pop("adam_w_mode", True) is not True:
        raise ConfigError(f"{run.where('optimizer.params.adam_w_mode')}: hybrid's AdamW "
                          f"decays weights decoupled from the gradient (adam_w_mode true)")
    for name, ok in (("bias_correction", True), ("amsgrad", False)):
        if p.pop(name, ok) != ok:
            raise ConfigError(f"{run.where('optimizer.params.' + name)}: hybrid's AdamW "
                              f"runs with {name} {str(ok).lower()}")
    if p.pop("torch_adam", None) is not None:
        run.notes.append("optimizer.params.torch_adam: no effect in hybrid (its AdamW is "
                         "its own fused step)")
    setters = {"lr": ("lr", float), "eps": ("adam_eps", float),
               "weight_decay": ("weight_decay", float)}
    for name, value in p.items():
        key = f"optimizer.params.{name}"
        if name == "betas" and value != "auto":
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                raise ConfigError(f"{run.where(key)}: betas takes two numbers, got {value!r}")
            run.set(key, "adam_beta1", float(value[0]))
            run.set(key, "adam_beta2", float(value[1]))
        elif name in setters and value != "auto":
            field, convert = setters[name]
            run.set(key, field, convert(value))
        elif name not in setters and name != "betas":
            raise ConfigError(_unknown(key, run.source))


def _scheduler(run: _Apply, block) -> None:
    """WarmupLR, WarmupDecayLR, WarmupCosineLR as hybrid's warmup + decay schedule."""
    if block is None:
        return
    from hybrid.config.deepspeed_schedule import schedule_flags
    for field, key, value in schedule_flags(block, run.f.lr, run.where("scheduler")):
        if field == "lr" and run.origin.get("lr") == "optimizer.params.lr":
            del run.origin["lr"]  # DeepSpeed's scheduler sets the rate the optimizer runs at
        run.set(key, field, value)


def _tensorboard(run: _Apply, block) -> None:
    if not block or not block.get("enabled", False):
        return
    for name in block:
        if name not in ("enabled", "output_path", "job_name"):
            raise ConfigError(_unknown(f"tensorboard.{name}", run.source))
    path = os.path.join(block.get("output_path") or "runs",
                        block.get("job_name") or "DeepSpeedJobName")
    run.set("tensorboard.output_path", "tensorboard_dir", path)
