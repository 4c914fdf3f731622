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
give the third (one alone: accumulation 1); all three must agree. A size the file
leaves out may come from its flag (``--global-batch-size``, ``--micro-batch-size``),
and a message names each size as the user gave it, never one derived from the
others. hybrid then holds micro-batch size and global batch size, as Megatron does.

[Note: types]
Every value is checked against the type its key declares
(:mod:`hybrid.config.deepspeed_keys`) in one place, :meth:`_Apply.typed`, before its
rule reads it: ``{"enabled": "false"}`` is an error naming ``fp16.enabled``, not
fp16 on (:mod:`hybrid.config.kinds`).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from typing import Any

from hybrid.config.deepspeed_keys import KEYS, SECTIONS, Custom, Flag, Hint, Refuse, kind_of, quiet
from hybrid.config.flags import Flags, flag_name
from hybrid.config.kinds import BOOL, OBJECT, Kind, show, typed
from hybrid.errors import ConfigError

_AUTO_FROM_WIDTH = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


def load_ds_config(source) -> dict:
    """The config as a dict, from a path or a dict (the API's ``config=``)."""
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"the ds_config must be a path to a JSON file or a dict, got "
                          f"{type(source).__name__} {show(source)}")
    source = os.fspath(source)
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
        # a Custom rule's key -> its value, checked against the rule's Kind when read in
        # (a number, or a JSON object): its handler knows which
        self.custom: dict[str, Any] = {}

    def where(self, key: str) -> str:
        return f"ds_config {key} ({self.source})"

    def typed(self, key: str, value, kind: Kind):
        """``value`` of ``key`` checked against ``kind`` (:func:`hybrid.config.kinds.typed`,
        the one place a value meets its type). ``"auto"`` passes for any key but a
        section: the rule decides what it leaves to the command line."""
        if isinstance(value, str) and value == "auto" and kind.base != "object":
            return value
        return typed(value, kind, self.where(key))

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
        """Every key of ``ds`` (under ``prefix``): its value checked against its kind, then
        applied by its rule (a Custom block is kept for its handler)."""
        for name, value in ds.items():
            key = f"{prefix}{name}"
            rule = KEYS.get(key)
            if key in SECTIONS:
                self.walk(self.typed(key, value, OBJECT), key + ".")
            elif rule is None:
                raise ConfigError(_unknown(key, self.source))
            elif isinstance(rule, Custom):
                self.custom[key] = self.block(key, self.typed(key, value, rule.kind),
                                              rule.fields)
            else:
                self.rule(key, rule, self.typed(key, value, kind_of(rule)))

    def block(self, key: str, value, fields: dict, below: str = ""):
        """A Custom block's value with each key ``fields`` types checked (recursing into
        the objects it names); keys it does not name are left for the block's handler."""
        if not isinstance(value, Mapping):
            return value
        out = {}
        for name, v in value.items():
            path = f"{below}{name}"
            kind = fields.get(path)
            checked = v
            if kind is not None:
                checked = self.typed(f"{key}.{path}", v, kind)
                if kind.base == "object":
                    checked = self.block(key, checked, fields, path + ".")
            out[name] = checked
        return out

    def rule(self, key: str, rule, value) -> None:
        if isinstance(rule, (Hint, Refuse)):
            if self.switched_off(key, rule, value):
                return
            if isinstance(rule, Refuse):
                raise ConfigError(f"{self.where(key)}: hybrid does not implement it: {rule.why}")
            self.notes.append(f"{key}: no effect in hybrid ({rule.why})")
            return
        assert isinstance(rule, Flag)
        if value == "auto":
            derive = _AUTO_FROM_WIDTH.get(key)
            if derive is None:
                return  # the command line's (or the default) stands
            value = derive(self.f.hidden_size)
        elif rule.convert is not None:
            try:
                value = rule.convert(value)
            except (TypeError, ValueError, KeyError, OverflowError):
                raise ConfigError(f"{self.where(key)}: {show(value)} is not a valid "
                                  f"value") from None
        self.set(key, rule.field, value)

    def switched_off(self, key: str, rule, value) -> bool:
        """``value`` asks for nothing hybrid lacks: null, an empty section or one whose
        ``enabled`` is false, or one of the rule's own such values (compared with their
        type: 0 is not false here, as it is to Python)."""
        if isinstance(value, Mapping):
            enabled = self.typed(f"{key}.enabled", value.get("enabled"), BOOL.or_null())
            return not value or enabled is False
        return value is None or any(type(q) is type(value) and q == value for q in quiet(rule))


def apply_ds_config(f: Flags, ds: Mapping, dp: int, source: str = "<dict>") -> list[str]:
    """Set ``f``'s fields from ``ds`` for a run of ``dp`` data-parallel ranks; returns the
    notes on keys accepted without effect (to log once). Raises ConfigError naming the
    key for an unknown or refused key, a value of the wrong type, a bad value, or a
    contradiction. ``f.given_as`` then names, for each field the file set, the key
    that set it (the checks' messages say the key: :func:`hybrid.config.build_config`)."""
    ds = dict(ds)
    if "bfloat16" in ds:  # DeepSpeed's older name of the bf16 block
        ds.setdefault("bf16", ds.pop("bfloat16"))
    if type(ds.get("zero_optimization")) is bool:  # the legacy switch: true is stage 1
        ds["zero_optimization"] = {"stage": 1 if ds["zero_optimization"] else 0}
    run = _Apply(f, source, dp)
    run.walk(ds)
    _batch(run)
    _optimizer(run)
    _scheduler(run)
    _tensorboard(run)
    compile_block = run.custom.get("compile")
    if compile_block is not None and compile_block.get("enabled", False) != "auto":
        run.set("compile.enabled", "compile", compile_block.get("enabled", False))
    _checkpointing_applies(run)
    f.given_as = {**f.given_as, **{field: f"ds_config {key}" for field, key in run.origin.items()}}
    return run.notes


def _checkpointing_applies(run: _Apply) -> None:
    """The activation_checkpointing section configures whole-layer recompute; without
    it (no --checkpoint-activations / --recompute-granularity full) it has nothing to
    configure, as in Megatron-DeepSpeed: its keys are then noted, not applied, in the
    file's order."""
    f = run.f
    if f.recompute_granularity == "full" or f.checkpoint_activations:
        return
    for field, key in list(run.origin.items()):
        if key.startswith("activation_checkpointing.") and getattr(f, field):
            setattr(f, field, False)
            del run.origin[field]
            run.notes.append(f"{key}: no effect without whole-layer recompute "
                             f"(--checkpoint-activations or --recompute-granularity full)")


def _unknown(key: str, source: str) -> str:
    close = difflib.get_close_matches(key, list(KEYS), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"ds_config {key} ({source}) is not a DeepSpeed key hybrid knows (README: "
            f"'Coming from DeepSpeed'){hint}")


# The three batch sizes: (ds_config key, the Flags field of the same meaning, if any).
_BATCH = (("train_batch_size", "global_batch_size"),
          ("train_micro_batch_size_per_gpu", "micro_batch_size"),
          ("gradient_accumulation_steps", None))


def _batch(run: _Apply) -> None:
    """train = micro x accumulation x DP (the module note). Each size comes from its key,
    or where the file leaves it out (or says "auto") from its flag on the command line;
    any two give the third, and a clash names the sizes as the user gave them."""
    given: dict[str, tuple[str, int]] = {}  # key -> (the name the user gave it by, value)
    for key, field in _BATCH:
        v = run.custom.get(key)
        if v is not None and v != "auto":
            if v < 1:
                raise ConfigError(f"{run.where(key)} must be >= 1, got {v}")
            if field is not None:
                run.set(key, field, v)  # a flag saying otherwise is one error naming both
            given[key] = (key, v)
        elif field is not None and field in run.explicit and getattr(run.f, field) is not None:
            given[key] = (flag_name(field), getattr(run.f, field))
    if not any(name == key for key, (name, _) in given.items()):
        return  # the file gives no size: the command line's checks alone
    train, micro, accum = (given.get(key) for key, _ in _BATCH)
    dp, where = run.dp, f"(ds_config {run.source})"

    def said(size: tuple[str, int]) -> str:
        return f"{size[0]} {size[1]}"

    if train and micro and accum:
        if train[1] != micro[1] * accum[1] * dp:
            raise ConfigError(f"{said(train)} != {said(micro)} x {said(accum)} x "
                              f"data-parallel size {dp} {where}")
    elif train and (per := micro or accum):
        if train[1] % (per[1] * dp):
            raise ConfigError(f"{said(train)} is not a multiple of {said(per)} x "
                              f"data-parallel size {dp} {where}")
        if accum:
            run.f.micro_batch_size = train[1] // (accum[1] * dp)
    elif train:  # alone: accumulation 1
        if train[1] % dp:
            raise ConfigError(f"{said(train)} is not a multiple of the data-parallel size "
                              f"{dp} {where}")
        run.f.micro_batch_size = train[1] // dp
    elif accum:  # the micro-batch given or the default, accumulated
        run.f.global_batch_size = run.f.micro_batch_size * accum[1] * dp


def _optimizer(run: _Apply) -> None:
    """Adam/AdamW with decoupled weight decay: hybrid's AdamW."""
    block = run.custom.get("optimizer")
    if block is None:
        return
    if str(block.get("type", "")).lower() not in ("adam", "adamw"):
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
    torch_adam = p.pop("torch_adam", None)
    if torch_adam is not None:
        run.notes.append("optimizer.params.torch_adam: no effect in hybrid (its AdamW is "
                         "its own fused step)")
    if "weight_decay" not in p and "weight_decay" not in run.explicit:
        # DeepSpeed's default is its optimizer's: FusedAdam's and DeepSpeedCPUAdam's 0, or
        # torch's AdamW's 0.01 under torch_adam; never hybrid's --weight-decay default
        run.set("optimizer.params.weight_decay (DeepSpeed's default)", "weight_decay",
                0.01 if torch_adam is True else 0.0)
    fields = {"lr": ("lr",), "eps": ("adam_eps",), "weight_decay": ("weight_decay",),
              "betas": ("adam_beta1", "adam_beta2")}
    for name, value in p.items():
        key = f"optimizer.params.{name}"
        if name not in fields:
            raise ConfigError(_unknown(key, run.source))
        if value != "auto":  # (checked: a number, or two for betas)
            for field, v in zip(fields[name], value if name == "betas" else (value,)):
                run.set(key, field, v)


def _scheduler(run: _Apply) -> None:
    """WarmupLR, WarmupDecayLR, WarmupCosineLR as hybrid's warmup + decay schedule."""
    block = run.custom.get("scheduler")
    if block is None:
        return
    from hybrid.config.deepspeed_schedule import schedule_flags
    for field, key, value in schedule_flags(block, run.f.lr, run.where):
        if field == "lr" and run.origin.get("lr") == "optimizer.params.lr":
            del run.origin["lr"]  # DeepSpeed's scheduler sets the rate the optimizer runs at
        if (field == "lr_decay_iters" and key.startswith("scheduler.params.warmup_num_steps")
                and ("lr_decay_iters" in run.explicit or run.f.train_samples is not None)):
            # WarmupLR: the warmup's own length (the rest is constant), never the
            # --train-iters default, which capped the warmup at 200 steps; a decay
            # length the command line gives stands
            continue
        run.set(key, field, value)


def _tensorboard(run: _Apply) -> None:
    block = run.custom.get("tensorboard")
    if not block or not block.get("enabled", False):
        return
    for name in block:
        if name not in ("enabled", "output_path", "job_name"):
            raise ConfigError(_unknown(f"tensorboard.{name}", run.source))
    path = os.path.join(block.get("output_path") or "runs",
                        block.get("job_name") or "DeepSpeedJobName")
    run.set("tensorboard.output_path", "tensorboard_dir", path)
