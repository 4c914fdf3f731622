"""The flags no section takes as they are: inputs of fields derived from several flags
(:mod:`hybrid.config.build`), Megatron's other names for an option, and the switches that
say where the rest comes from (a ds_config file, the kernels' environment).

Each class is one group of ``--help``; each field declares its flag with
:func:`hybrid.config.options.opt` (the module note there), as a section field does. The
flat :class:`hybrid.config.flags.Flags` is generated from these and the sections.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.config.options import opt
from hybrid.config.sections import KERNEL_PATHS, TOKENIZER_TYPES


@dataclass(frozen=True)
class LRLengthFlags:
    """Warmup and decay lengths, in iterations or samples: ``LRScheduleConfig`` takes them
    in the run's one unit (:func:`hybrid.config.build._lr_lengths`)."""

    lr_warmup_iters: int = opt(0, "linear warmup iterations", at_least=0)
    lr_warmup_fraction: float | None = opt(
        None, "warmup as a fraction of the decay length", at_least=0, at_most=1)
    lr_warmup_samples: int = opt(0, "linear warmup samples (with --train-samples)", at_least=0)
    lr_decay_iters: int | None = opt(None, "decay length (default: train iters)", at_least=1)
    lr_decay_samples: int | None = opt(
        None, "decay length in samples (with --train-samples; default: train samples)", at_least=1)


@dataclass(frozen=True)
class MegatronZeroFlags:
    """Megatron's names for ZeRO options (:func:`hybrid.config.checks.check_zero`)."""

    use_distributed_optimizer: bool = opt(
        False, "Megatron's sharded optimizer: ZeRO-1 (unless --zero-stage says more)")
    overlap_grad_reduce: bool = opt(False, "Megatron's name for --overlap-comm (gradients)")
    overlap_param_gather: bool = opt(False, "Megatron's name for --overlap-comm (parameters)")


@dataclass(frozen=True)
class DtypeFlags:
    """The training dtype: ``PrecisionConfig.params_dtype`` is derived from these."""

    bf16: bool = opt(False, "bf16 params and grads, fp32 master weights", ds="bf16.enabled")
    fp16: bool = opt(
        False, "fp16 params and grads, fp32 master weights, loss scaling", ds="fp16.enabled")


@dataclass(frozen=True)
class RecomputeFlags:
    """Megatron's recompute method, its older switches, and the partitioning that
    sequence parallelism makes moot: ``RecomputeConfig``'s layer fields derive from them."""

    recompute_method: str | None = opt(
        None, "with full: uniform (every layer, in groups of --recompute-num-layers that each "
        "store one input) or block (only the first --recompute-num-layers layers, each on its "
        "own)", choices=("uniform", "block"))
    recompute_num_layers: int | None = opt(
        None, "with full: layers per checkpoint group (uniform, default 1) or layers checkpointed "
        "(block)")
    recompute_activations: bool = opt(
        False, "Megatron's shorthand for --recompute-granularity selective")
    checkpoint_activations: bool = opt(
        False, "older Megatron name for --recompute-granularity full")
    partition_activations: bool = opt(
        False, "each TP rank stores 1/TP of each checkpoint",
        alias="--distribute-saved-activations", ds="activation_checkpointing.partition_activations")
    deepspeed_activation_checkpointing: bool = opt(
        False, "Megatron-DeepSpeed's switch to DeepSpeed's activation checkpointing: hybrid's "
        "ZeRO-R is that, and the ds_config's activation_checkpointing section applies whenever "
        "recompute is on")


@dataclass(frozen=True)
class TokenizerFlags:
    """The tokenizer and its files (:meth:`hybrid.config.sections.TokenizerConfig.from_flags`)."""

    tokenizer_type: str | None = opt(
        None, "byte, GPT2BPETokenizer (--vocab-file/--merge-file), HuggingFaceTokenizer "
        "(--tokenizer-model) or NullTokenizer (--vocab-size); older names gpt2bpe, hf. Default: "
        "GPT2BPETokenizer when both GPT-2 files are given, else byte", choices=TOKENIZER_TYPES,
        metavar="TYPE")
    vocab_file: str | None = opt(None, "GPT-2 vocab.json")
    merge_file: str | None = opt(None, "GPT-2 merges.txt")
    tokenizer_file: str | None = opt(None, "a tokenizers-library tokenizer.json")
    tokenizer_model: str | None = opt(
        None, "HuggingFaceTokenizer: a tokenizer directory or tokenizer.json")
    vocab_size: int | None = opt(None, "NullTokenizer: token ids 0..N-1 (eod is N)", at_least=1)


@dataclass(frozen=True)
class KernelFlags:
    """The csrc/ kernels; each left unset takes its HYBRID_* variable at the entry point
    (:func:`hybrid.config.kernels.kernel_config_from_env`)."""

    no_kernels: bool = opt(
        False, "never build or load the csrc/ kernels: PyTorch fallbacks only (also on with "
        "HYBRID_NO_KERNELS=1)")
    kernel_cache_dir: str | None = opt(
        None, "where compiled kernels are cached (default: $HYBRID_KERNEL_CACHE, else "
        "$XDG_CACHE_HOME or ~/.cache, /hybrid/kernels)")
    kernel_choice: str | None = opt(
        None,
        "op=path,... the path an op takes, overriding the "
        "measured default (ops: " + ", ".join(KERNEL_PATHS)
  + ", all; e.g. layer_norm=fused,linear=fp32; "
    "default: $HYBRID_KERNEL_CHOICE)")


@dataclass(frozen=True)
class DeepSpeedFlags:
    """DeepSpeed's configuration file (:mod:`hybrid.config.deepspeed`)."""

    deepspeed: str | None = opt(
        None, "Megatron-DeepSpeed's marker (no value), or as Hugging Face's Trainer takes it, the "
        "ds_config.json to read", const="")
    deepspeed_config: str | None = opt(
        None, "a DeepSpeed ds_config.json: its keys set the matching flags (README: 'Coming from "
        "DeepSpeed')", alias="--deepspeed_config")
