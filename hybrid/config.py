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
from dataclasses import dataclass, field

from hybrid.config_kernels import kernel_config_from_env, parse_kernel_choice  # re-exported
from hybrid.config_sections import KERNEL_PATHS, KernelConfig, RecomputeConfig, ZeroConfig
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


def opt(default, help: str, alias: str | None = None):
    """A config field with its --help text (and an optional alias flag)."""
    return field(default=default, metadata={"help": help, "alias": alias})


@dataclass
class TrainConfig:
    # parallelism
    tensor_model_parallel_size: int = opt(1, "TP degree: ranks splitting each layer")
    sequence_parallel: bool = opt(False, "split norms, dropout and residuals along the "
                                         "sequence over TP (needs TP > 1)")
    distributed_backend: str | None = opt(None, "gloo or nccl (default: nccl with a GPU)")
    distributed_timeout_minutes: float = opt(10.0, "timeout of every collective")
    # model (defaults: a small GPT that trains on 2 CPU cores in minutes)
    num_layers: int = opt(4, "transformer layers")
    hidden_size: int = opt(256, "model width")
    num_attention_heads: int = opt(4, "attention heads (divisible by TP)")
    ffn_hidden_size: int | None = opt(None, "MLP width (default 4 x hidden)")
    seq_length: int = opt(128, "tokens per sample")
    max_position_embeddings: int | None = opt(None, "positions (default: seq length)")
    make_vocab_size_divisible_by: int = opt(128, "pad vocab to a multiple of this x TP")
    hidden_dropout: float = opt(0.1, "dropout on the residual stream")
    attention_dropout: float = opt(0.1, "dropout on attention probabilities")
    init_method_std: float = opt(0.02, "std of the normal weight init")
    # batch
    micro_batch_size: int = opt(8, "samples per rank per forward/backward")
    global_batch_size: int | None = opt(None, "samples per step (default micro x DP)")
    # optimizer and schedule
    lr: float = opt(1e-3, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of decay")
    lr_warmup_iters: int = opt(0, "linear warmup iterations")
    lr_decay_style: str = opt("constant", "constant, linear or cosine")
    lr_decay_iters: int | None = opt(None, "decay length (default: train iters)")
    weight_decay: float = opt(0.01, "AdamW decay (not on biases and norms)")
    adam_beta1: float = opt(0.9, "Adam beta1")
    adam_beta2: float = opt(0.999, "Adam beta2")
    adam_eps: float = opt(1e-8, "Adam epsilon")
    clip_grad: float = opt(1.0, "clip the global grad norm to this (0: off)")
    train_iters: int = opt(200, "optimizer steps")
    seed: int = opt(1234, "fixes init, data order and dropout")
    # ZeRO data parallelism
    zero_stage: int = opt(0, "0: all-reduce DP, 1: shard optimizer states, 2: +grads, "
                             "3: +params")
    reduce_bucket_size: int = opt(50_000_000, "elements per gradient reduce bucket")
    allgather_bucket_size: int = opt(50_000_000, "elements per parameter all-gather bucket")
    overlap_comm: bool = opt(False, "launch bucket collectives during backward")
    zero_param_persistence_threshold: int = opt(100_000, "stage 3: params with fewer "
                                                         "elements stay unpartitioned")
    offload_optimizer: bool = opt(False, "keep fp32 master shard and Adam states on the CPU")
    # mixed precision
    bf16: bool = opt(False, "bf16 params and grads, fp32 master weights")
    fp16: bool = opt(False, "fp16 params and grads, fp32 master weights, loss scaling")
    accumulate_allreduce_grads_in_fp32: bool | None = opt(
        None, "accumulate micro-batch gradients and reduce them over DP in fp32 "
              "(default: on with --bf16, as in Megatron)")
    loss_scale: float | None = opt(None, "static loss scale (default: dynamic)")
    initial_loss_scale: float = opt(2.0 ** 16, "dynamic loss scale to start from")
    min_loss_scale: float = opt(1.0, "dynamic loss scale floor")
    loss_scale_window: int = opt(1000, "clean steps before the scale doubles")
    hysteresis: int = opt(2, "overflows tolerated before the scale halves")
    # activation checkpointing (ZeRO-R)
    recompute_granularity: str | None = opt(
        None, "full: keep only each layer's input and rerun the layer in backward (ZeRO-R); "
              "selective: rerun only the attention core (scores, softmax, dropout)")
    recompute_method: str | None = opt(None, "with full: uniform (every layer, in groups of "
                                             "--recompute-num-layers that each store one "
                                             "input) or block (only the first "
                                             "--recompute-num-layers layers, each on its own)")
    recompute_num_layers: int | None = opt(None, "with full: layers per checkpoint group "
                                                 "(uniform, default 1) or layers "
                                                 "checkpointed (block)")
    recompute_activations: bool = opt(False, "Megatron's shorthand for "
                                             "--recompute-granularity selective")
    checkpoint_activations: bool = opt(False, "older Megatron name for "
                                              "--recompute-granularity full")
    partition_activations: bool = opt(False, "each TP rank stores 1/TP of each checkpoint",
                                      alias="--distribute-saved-activations")
    cpu_checkpointing: bool = opt(False, "keep the checkpoints in host memory")
    contiguous_checkpointing: bool = opt(False, "store checkpoints in one preallocated buffer")
    # data
    data_path: list[str] | None = opt(None, "text file, or [weight] prefix ... of "
                                            "preprocessed data (default: built-in corpus)")
    split: str = opt("949,50,1", "train,valid,test proportions")
    tokenizer_type: str = opt("byte", "byte, gpt2bpe (--vocab-file/--merge-file) or "
                                      "hf (--tokenizer-file)")
    vocab_file: str | None = opt(None, "GPT-2 vocab.json")
    merge_file: str | None = opt(None, "GPT-2 merges.txt")
    tokenizer_file: str | None = opt(None, "a tokenizers-library tokenizer.json")
    data_cache_path: str | None = opt(None, "where sample indices are cached "
                                            "(default: next to the data)")
    # checkpoints
    save: str | None = opt(None, "save checkpoints in this directory")
    load: str | None = opt(None, "resume from the newest checkpoint in this directory")
    save_interval: int | None = opt(None, "save every N iterations (and at the end)")
    keep_last: int | None = opt(None, "after a save, keep only the newest N checkpoints")
    exit_on_nan_iterations: int = opt(10, "stop with an error after N consecutive skipped "
                                          "steps with non-finite gradients")
    # evaluation and logging
    eval_interval: int = opt(1000, "validate every N iterations")
    eval_iters: int = opt(10, "iterations per validation")
    log_interval: int = opt(10, "iterations per console line")
    log_json: str | None = opt(None, "write one JSON object per logged iteration here")
    tensorboard_dir: str | None = opt(None, "write TensorBoard scalars here")
    # --- kernels (hybrid.kernels; defaults from HYBRID_* variables, see kernel_config_from_env)
    no_kernels: bool = opt(False, "never build or load the csrc/ kernels: PyTorch fallbacks "
                                  "only (also on with HYBRID_NO_KERNELS=1)")
    kernel_cache_dir: str | None = opt(None, "where compiled kernels are cached (default: "
                                             "$HYBRID_KERNEL_CACHE, else $XDG_CACHE_HOME or "
                                             "~/.cache, /hybrid/kernels)")
    kernel_choice: str | None = opt(None, "op=path,... the path an op takes, overriding the "
                                          "measured default (ops: " + ", ".join(KERNEL_PATHS)
                                    + ", all; e.g. layer_norm=fused,linear=fp32; "
                                      "default: $HYBRID_KERNEL_CHOICE)")

    # -- validation -----------------------------------------------------------
    def validate(self, world_size: int) -> "TrainConfig":
        """Check everything that can be checked before starting; fill derived defaults."""
        dp = check_layout(world_size, self.tensor_model_parallel_size)
        tp = self.tensor_model_parallel_size
        for f in dataclasses.fields(self):  # nan and inf pass argparse's float()
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{_flag(f.name)} must be a finite number, got {value}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "micro_batch_size", "train_iters", "log_interval",
                     "make_vocab_size_divisible_by", "reduce_bucket_size",
                     "allgather_bucket_size", "eval_interval", "loss_scale_window"):
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
        if self.sequence_parallel and tp == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 "
                              "(it splits the sequence over the TP group): drop it or raise TP")
        if self.sequence_parallel and self.seq_length % tp:
            raise ConfigError(f"--sequence-parallel splits --seq-length {self.seq_length} over "
                              f"--tensor-model-parallel-size {tp}: use a multiple of {tp}")
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
        self._validate_zero()
        self._validate_recompute()
        self._validate_data()
        self._validate_checkpoint()
        self._validate_kernels()
        return self

    def _validate_kernels(self) -> None:
        """Fill the kernel flags left unset from the environment, check --kernel-choice."""
        env = kernel_config_from_env()
        self.no_kernels = bool(self.no_kernels or env.no_kernels)
        if self.kernel_cache_dir is None:
            self.kernel_cache_dir = env.cache_dir
        if self.kernel_choice is None:
            self.kernel_choice = ",".join(f"{op}={path}" for op, path in env.choice) or None
        else:
            parse_kernel_choice(self.kernel_choice, "--kernel-choice")

    def _validate_checkpoint(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError(f"--save-interval must be >= 1, got {self.save_interval}")
        if self.save_interval is not None and not self.save:
            raise ConfigError("--save-interval needs --save DIR")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"--keep-last must be >= 1, got {self.keep_last}")
        if self.exit_on_nan_iterations < 1:
            raise ConfigError("--exit-on-nan-iterations must be >= 1")

    def _validate_zero(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are exclusive: pick one")
        if self.zero_param_persistence_threshold < 0:
            raise ConfigError("--zero-param-persistence-threshold must be >= 0")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError("--offload-optimizer needs --zero-stage 1, 2 or 3")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0 or self.hysteresis < 1:
            raise ConfigError("--initial-loss-scale and --min-loss-scale must be > 0, "
                              "--hysteresis >= 1")
        if self.accumulate_allreduce_grads_in_fp32 is None:
            self.accumulate_allreduce_grads_in_fp32 = self.bf16

    def _validate_recompute(self) -> None:
        """Resolve Megatron's recompute flags into granularity + method + layers."""
        g = self.recompute_granularity
        if g not in (None, "full", "selective"):
            raise ConfigError(f"--recompute-granularity must be full or selective, got {g!r}")
        for flag, implied in (("recompute_activations", "selective"),
                              ("checkpoint_activations", "full")):
            if getattr(self, flag):
                if g not in (None, implied):
                    raise ConfigError(f"{_flag(flag)} means --recompute-granularity {implied}, "
                                      f"but --recompute-granularity {g} is given: keep one")
                g = implied
        self.recompute_granularity = g
        if self.recompute_method not in (None, "uniform", "block"):
            raise ConfigError(f"--recompute-method must be uniform or block, "
                              f"got {self.recompute_method!r}")
        if g != "full" and (self.recompute_method or self.recompute_num_layers is not None):
            raise ConfigError("--recompute-method and --recompute-num-layers need "
                              "--recompute-granularity full")
        if self.recompute_num_layers is not None:
            if not 1 <= self.recompute_num_layers <= self.num_layers:
                raise ConfigError(f"--recompute-num-layers must be in [1, --num-layers "
                                  f"{self.num_layers}], got {self.recompute_num_layers}")
        if g == "full" and self.recompute_method is None:
            self.recompute_method = "block" if self.recompute_num_layers else "uniform"
        for name in ("partition_activations", "cpu_checkpointing", "contiguous_checkpointing"):
            if getattr(self, name) and g != "full":
                raise ConfigError(f"{_flag(name)} needs --recompute-granularity full (it "
                                  f"handles whole-layer checkpoints)")

    def _validate_data(self) -> None:
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(x) for x in parts]
        except ValueError:
            weights = []
        if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"--split {self.split!r} must be three non-negative numbers "
                              f"train,valid,test (e.g. 949,50,1)")
        if self.tokenizer_type not in ("byte", "gpt2bpe", "hf"):
            raise ConfigError(f"--tokenizer-type must be byte, gpt2bpe or hf, "
                              f"got {self.tokenizer_type!r}")
        if self.tokenizer_type == "gpt2bpe" and not (self.vocab_file and self.merge_file):
            raise ConfigError("--tokenizer-type gpt2bpe needs --vocab-file and --merge-file")
        if self.tokenizer_type == "hf" and not self.tokenizer_file:
            raise ConfigError("--tokenizer-type hf needs --tokenizer-file")
        if self.eval_iters < 0:
            raise ConfigError("--eval-iters must be >= 0")

    def data_parallel_size(self, world_size: int) -> int:
        return check_layout(world_size, self.tensor_model_parallel_size)

    def num_micro_batches(self, world_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size *
                                          self.data_parallel_size(world_size))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # -- the sections components take ------------------------------------------
    @property
    def zero(self) -> ZeroConfig:
        return ZeroConfig(
            stage=self.zero_stage, reduce_bucket_size=self.reduce_bucket_size,
            allgather_bucket_size=self.allgather_bucket_size, overlap_comm=self.overlap_comm,
            param_persistence_threshold=self.zero_param_persistence_threshold,
            offload_optimizer=self.offload_optimizer,
            params_dtype="bf16" if self.bf16 else "fp16" if self.fp16 else "fp32",
            grads_in_fp32=bool(self.accumulate_allreduce_grads_in_fp32),
            clip_grad=self.clip_grad, adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2,
            adam_eps=self.adam_eps, weight_decay=self.weight_decay,
            loss_scale=self.loss_scale, initial_loss_scale=self.initial_loss_scale,
            min_loss_scale=self.min_loss_scale, loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis)

    @property
    def recompute(self) -> RecomputeConfig:
        return RecomputeConfig(
            granularity=self.recompute_granularity,
            num_layers=self.recompute_num_layers if self.recompute_method == "block" else None,
            layers_per_checkpoint=(self.recompute_num_layers or 1
                                   if self.recompute_method == "uniform" else 1),
            # With SP a block's input is already this rank's 1/TP of the sequence:
            # nothing replicated is left to partition (see README, "Sequence parallelism").
            partition_activations=self.partition_activations and not self.sequence_parallel,
            cpu_checkpointing=self.cpu_checkpointing,
            contiguous_checkpointing=self.contiguous_checkpointing)


    @property
    def kernels(self) -> KernelConfig:
        env = kernel_config_from_env()
        return KernelConfig(no_kernels=bool(self.no_kernels), cache_dir=self.kernel_cache_dir,
                            choice=parse_kernel_choice(self.kernel_choice or "",
                                                       "--kernel-choice"),
                            cuda_arch_list=env.cuda_arch_list)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, named as Megatron names it."""
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py", description="Pretrain a GPT with tensor x data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        names = [_flag(f.name)] + ([f.metadata["alias"]] if f.metadata.get("alias") else [])
        kind, many = _field_type(f)
        kw = dict(dest=f.name, default=f.default, help=f.metadata.get("help"))
        if kind is bool and f.default is None:  # tri-state: --x / --no-x / derived default
            p.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif kind is bool:
            p.add_argument(*names, action="store_true", **kw)
        else:
            p.add_argument(*names, type=kind, nargs="+" if many else None,
                           metavar=f.name.split("_")[-1].upper(), **kw)
    return p


def _field_type(f: dataclasses.Field) -> tuple[type, bool]:
    """(element type, is a list) of a field annotated like 'int', 'str | None', 'list[str]'."""
    t = str(f.type).replace("typing.", "")
    many = t.startswith("list[")
    head = t[5:].split("]")[0] if many else t.split(" ")[0]
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if head == name:
            return kind, many
    raise TypeError(f"unsupported config field type {f.type!r} for {f.name}")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse flags into a TrainConfig (not yet validated: that needs the world size)."""
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns))

