"""Hugging Face's ``"auto"`` in a ds_config, filled from ``TrainingArguments`` and the run.

A Trainer script writes ``"auto"`` where the value is the TrainingArguments' (or the
run's: its step count, the model's width). transformers fills them before DeepSpeed
reads the config; these are the same rules, applied to a copy of the config without
DeepSpeed installed, so hybrid's engine reads the numbers the Trainer runs with:

=============================================  =============================================
ds_config key                                  value
=============================================  =============================================
``train_micro_batch_size_per_gpu``             ``per_device_train_batch_size``
``gradient_accumulation_steps``                ``gradient_accumulation_steps``
``train_batch_size``                           world size x the two above
``gradient_clipping``                          ``max_grad_norm``
``optimizer.params.lr``                        ``learning_rate``
``optimizer.params.betas``                     ``[adam_beta1, adam_beta2]``
``optimizer.params.eps``                       ``adam_epsilon``
``optimizer.params.weight_decay``              ``weight_decay``
``scheduler.params.warmup_min_lr``             0 (no TrainingArguments field: never checked)
``scheduler.params.warmup_max_lr``             ``learning_rate``
``fp16.enabled``                               ``fp16 or fp16_full_eval``
``bf16.enabled``                               ``bf16 or bf16_full_eval``
``fp16`` / ``bf16`` (no such block)            ``{"enabled": true}`` when training in it
-- once the run is known (:func:`fill_from_run`) --
``scheduler.params.total_num_steps``           the run's optimizer steps (``max_steps``)
``scheduler.params.warmup_num_steps``          ``args.get_warmup_steps(steps)``, at least 1
``zero_optimization.reduce_bucket_size``       h^2 (h: the model config's ``hidden_size``)
``..stage3_prefetch_bucket_size`` (stage 3)    int(0.9 h^2)
``..stage3_param_persistence_threshold`` (3)   10 h
=============================================  =============================================

A key is filled only where the config has it (but for the dtype block above). A
value the config gives itself (not ``"auto"``) that differs from the
TrainingArguments' is a mismatch, except for ``warmup_min_lr`` and the three sizes
(no TrainingArguments field says them); the mismatches are one ConfigError, raised
when the engine is built, as transformers raises them when DeepSpeed starts.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hybrid.config.deepspeed import load_ds_config
from hybrid.errors import ConfigError

if TYPE_CHECKING:
    import transformers

AUTO = "auto"


def read(source: str | os.PathLike | Mapping) -> dict:
    """A deep copy of the ds_config ``source`` (a path to a JSON file, or a dict): the
    fills write into it, and the caller's ``TrainingArguments(deepspeed=...)`` stays as
    it was written."""
    return copy.deepcopy(load_ds_config(source))


class Filler:
    """Fills ``config`` in place and collects the mismatches (module docstring)."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict | None, str]:
        """(the dict holding ``key``'s last part, that part); None when a parent is missing."""
        *parents, last = key.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, last
        return (node if isinstance(node, dict) else None), last

    def fill(self, key: str, value: object, field: str | None) -> None:
        """``"auto"`` at ``key`` becomes ``value``; another value there that differs is a
        mismatch with the TrainingArguments' ``field`` (None: nothing to check against)."""
        node, last = self._node(key)
        if node is None or last not in node:
            return
        if node[last] == AUTO:
            node[last] = value
        elif field is not None and node[last] != value:
            self.mismatches.append(f"ds_config {key} is {node[last]!r} but TrainingArguments "
                                   f"gives {field} = {value!r}")

    def is_auto(self, key: str) -> bool:
        node, last = self._node(key)
        return node is not None and node.get(last) == AUTO

    def zero_stage(self) -> int:
        zero = self.config.get("zero_optimization")
        if isinstance(zero, dict):
            stage = zero.get("stage", 0)
            return stage if isinstance(stage, int) else 0
        return 1 if zero is True else 0


def fill_from_arguments(filler: Filler, args: transformers.TrainingArguments) -> None:
    """The values TrainingArguments ``args`` decides (the table's first part)."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    filler.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    filler.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    filler.fill("train_batch_size", args.world_size * micro * accumulation,
                "train_batch_size (world size x per_device_train_batch_size x "
                "gradient_accumulation_steps)")
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2],
                "[adam_beta1, adam_beta2]")
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0, None)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filler.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16 or fp16_full_eval")
    filler.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16 or bf16_full_eval")
    # training in fp16 or bf16 with no block for it: transformers' run through accelerate's
    # DeepSpeed plugin adds one, so the engine trains in that dtype
    for dtype in ("fp16", "bf16"):
        if getattr(args, dtype) and dtype not in filler.config:
            filler.config[dtype] = {"enabled": True}


def hidden_size(model: object) -> int | None:
    """The width the bucket sizes scale with: the model config's ``hidden_size`` (the
    largest of ``hidden_sizes``), or its text config's; None when it has none."""
    top = getattr(model, "config", None)
    for config in (top, getattr(top, "text_config", None)):
        if config is None:
            continue
        if getattr(config, "hidden_size", None) is not None:
            return int(config.hidden_size)
        if getattr(config, "hidden_sizes", None):
            return int(max(config.hidden_sizes))
    return None


_WIDTH_KEYS = ("zero_optimization.reduce_bucket_size",
               "zero_optimization.stage3_prefetch_bucket_size",
               "zero_optimization.stage3_param_persistence_threshold")


def fill_from_run(filler: Filler, args: transformers.TrainingArguments, model: object,
                  num_training_steps: int) -> None:
    """The values known once training starts (the table's second part), then the
    mismatches collected so far as one ConfigError."""
    if any(filler.is_auto(k) for k in _WIDTH_KEYS):
        h = hidden_size(model)
        if h is None:
            raise ConfigError(
                f"ds_config {', '.join(k for k in _WIDTH_KEYS if filler.is_auto(k))}: \"auto\" "
                f"is sized from the model config's hidden_size, and "
                f"{type(model).__name__}'s config has none; write a number instead")
        filler.fill("zero_optimization.reduce_bucket_size", h * h, None)
        if filler.zero_stage() == 3:
            filler.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h), None)
            filler.fill("zero_optimization.stage3_param_persistence_threshold", 10 * h, None)
    filler.fill("scheduler.params.total_num_steps", num_training_steps,
                "the run's optimizer steps (max_steps or the epochs')")
    filler.fill("scheduler.params.warmup_num_steps",
                max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    if filler.mismatches:
        raise ConfigError("the ds_config disagrees with TrainingArguments:\n  "
                          + "\n  ".join(filler.mismatches)
                          + "\nwrite \"auto\" for these keys (or make the values equal)")
