"""Megatron-compatible command-line flags -> :class:`TrainConfig`, validated in one place.

Every check that can reject a run lives in :meth:`TrainConfig.validate`, and
every message names the flag to change. This module imports no torch, so the
launcher can check a command line in a fraction of a second before it starts
any worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from hybrid.errors import ConfigError


def check_layout(world_size: int, tensor_model_parallel_size: int) -> int:
    """Return the data-parallel size, or raise ConfigError naming the flag."""
    tp = tensor_model_parallel_size
    if tp < 1:
        raise ConfigError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if world_size % tp != 0:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} does not divide the world size {world_size} "
            f"(nodes x processes per node): use one of {divisors}")
    return world_size // tp


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up to a multiple of ``divisible_by * tp`` (Megatron's rule)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass
class TrainConfig:
    # parallelism
    tensor_model_parallel_size: int = 1
    distributed_backend: str | None = None  # None: nccl with a GPU, gloo otherwise
    distributed_timeout_minutes: float = 10.0
    # model (defaults: a small GPT that trains on 2 CPU cores in minutes)
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    seq_length: int = 128
    max_position_embeddings: int | None = None  # default: seq_length
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # batch
    micro_batch_size: int = 8
    global_batch_size: int | None = None  # default: micro_batch_size x DP
    # optimizer and schedule
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    lr_decay_iters: int | None = None  # default: train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    train_iters: int = 200
    seed: int = 1234
    # data parallel communication
    ddp_bucket_size: int = 2_000_000  # elements per all-reduce bucket
    # data
    data_path: str | None = None  # a text file; default: the built-in corpus
    # logging
    log_interval: int = 10
    log_json: str | None = None

    # -- validation -----------------------------------------------------------
    def validate(self, world_size: int) -> "TrainConfig":
        """Check everything that can be checked before starting; fill derived defaults."""
        dp = check_layout(world_size, self.tensor_model_parallel_size)
        tp = self.tensor_model_parallel_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "micro_batch_size", "train_iters", "log_interval",
                     "make_vocab_size_divisible_by", "ddp_bucket_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}")
        if self.num_attention_heads % tp:
            raise ConfigError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}: each TP rank needs whole heads")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size % tp:
            raise ConfigError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(f"--seq-length {self.seq_length} exceeds "
                              f"--max-position-embeddings {self.max_position_embeddings}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        per_step = self.micro_batch_size * dp
        if self.global_batch_size is None:
            self.global_batch_size = per_step
        if self.global_batch_size < 1 or self.global_batch_size % per_step:
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not a multiple of "
                f"--micro-batch-size {self.micro_batch_size} x data-parallel size {dp} "
                f"(= {per_step})")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}), --lr > 0")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"--lr-decay-style must be constant, linear or cosine, "
                              f"got {self.lr_decay_style!r}")
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.train_iters
        if self.lr_warmup_iters < 0 or self.lr_decay_iters < 1:
            raise ConfigError("--lr-warmup-iters must be >= 0 and --lr-decay-iters >= 1")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ConfigError("--clip-grad and --weight-decay must be >= 0")
        if self.distributed_backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"--distributed-backend must be gloo or nccl, "
                              f"got {self.distributed_backend!r}")
        if self.distributed_timeout_minutes <= 0:
            raise ConfigError("--distributed-timeout-minutes must be > 0")
        return self

    def data_parallel_size(self, world_size: int) -> int:
        return check_layout(world_size, self.tensor_model_parallel_size)

    def num_micro_batches(self, world_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size *
                                          self.data_parallel_size(world_size))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")



def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, named as Megatron names it."""
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py", description="Pretrain a GPT with tensor x data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        kind = _field_type(f)
        if kind is bool:
            p.add_argument(_flag(f.name), dest=f.name, action="store_true", default=f.default)
        else:
            p.add_argument(_flag(f.name), dest=f.name, type=kind, default=f.default,
                           metavar=f.name.upper())
    return p


def _field_type(f: dataclasses.Field):
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if t.split(" ")[0] == name:
            return kind
    raise TypeError(f"unsupported config field type {f.type!r} for {f.name}")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse flags into a TrainConfig (not yet validated: that needs the world size)."""
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns))

