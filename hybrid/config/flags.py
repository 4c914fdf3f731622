"""The command line: Megatron-compatible flags -> :class:`Flags`, one field per flag.

Megatron users bring launch scripts full of flags. Each flag hybrid implements
is a field here; :mod:`hybrid.config.megatron_flags` knows the rest of Megatron's
flags, so they get a named answer (ignored with a note, or refused with what
to use instead) rather than argparse's "unrecognized arguments". No torch
import: the launcher checks a command line before it starts any worker.

[Note: each option defined once]
A flag is written once, here: its Megatron name, type, default, help and, in
``to``, the field of the frozen section (:mod:`hybrid.config.sections`) that
takes its checked value::

    offload_gds: bool = opt(False, "with --offload-param nvme: ...", to="offload.gds")

``to`` names a section as :class:`hybrid.config.TrainConfig` names it, and the
section's field when that differs from the flag's own name (``to="checkpoint"``
for ``save`` -> ``checkpoint.save``); a flag that feeds several sections names
each. :data:`ROUTES` collects them, and :func:`hybrid.config.build_config` cuts
each section by that table: there is no hand-written mapper to keep in step. The
flags are the source because Megatron's names are what users write and what a
checkpoint's metadata keeps; a section keeps the short name its component reads
(``cfg.offload.gds``). Explicit code remains only for fields derived from several
flags or from outside them (the LR schedule's unit and lengths, the recompute
method, the dtypes, the tokenizer, the kernels' environment defaults): see
:mod:`hybrid.config.build`.

What one option alone must satisfy is written on its field too, and so is the
ds_config key that sets it::

    zero_stage: int = opt(0, "...", choices=(0, 1, 2, 3), ds="zero_optimization.stage",
                          to="zero.stage")

``choices`` (a closed set; a constant components also read stays where they read it,
:mod:`hybrid.config.sections`, and the field names it) and the bounds ``at_least``,
``above``, ``at_most``, ``below`` are enforced by one check,
:func:`hybrid.config.checks.check_fields`, with one message ("--zero-stage must be 0,
1, 2 or 3, got 5"; a value a ds_config key gave is named by its key). A check that
reads two or more options stays in :mod:`hybrid.config.checks`. ``ds`` names the
ds_config key(s) that set the field (:class:`DsKey` where the value has its own kind
or is converted): :data:`hybrid.config.deepspeed_keys.KEYS` makes its ``Flag`` rules
from them, and the key so reaches the flag's section.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from hybrid.config.kinds import BOOL, INT, NUMBER, Kind, one_of
from hybrid.config.sections import (
    CP_COMM_TYPES,
    CP_LAYOUTS,
    KERNEL_PATHS,
    OFFLOAD_TIERS,
    PIPELINE_SCHEDULES,
    TOKENIZER_TYPES,
)
from hybrid.errors import ConfigError
from hybrid.pipeline.schedules import SCHEDULES

# The bounds opt takes, as a field's metadata names them (checks.check_fields reads them)
BOUNDS = ("at_least", "above", "at_most", "below")


@dataclass(frozen=True)
class DsKey:
    """A ds_config key that sets a flag's field (``opt(ds=...)``): its dotted ``path``; the
    ``kind`` its value must have (:mod:`hybrid.config.kinds`; None: the field's
    annotation); ``convert``: the checked value -> the field's value (None: as it is)."""

    path: str
    kind: Kind | None = None
    convert: Callable[[Any], Any] | None = None


def opt(default, help: str, alias: str | None = None, to: str | tuple[str, ...] = (), *,
        choices: Collection | None = None, refused: Mapping[Any, str] | None = None,
        at_least: float | None = None, above: float | None = None,
        at_most: float | None = None, below: float | None = None,
        ds: str | DsKey | tuple[str | DsKey, ...] = (), **argparse_kw):
    """A flag field with its --help text (and an optional alias flag). ``to``: the section
    field(s) its checked value goes to, ``"section"`` or ``"section.field"`` (the note
    above; none for a flag only checks and derived fields read).

    What the value alone must be (:func:`hybrid.config.checks.check_fields`; None passes
    where the default is None): ``choices``, a closed set (``--help`` shows it);
    ``refused``: values outside it whose message says why (a Megatron value hybrid
    lacks -> the reason); the bounds ``at_least`` (>=), ``above`` (>), ``at_most``
    (<=), ``below`` (<). ``ds``: the ds_config key(s) that set the field, a dotted path or
    a :class:`DsKey`. ``argparse_kw``: ``const`` for a flag whose value may be left out
    (``nargs="?"``), ``metavar`` for a set too long to show."""
    if choices is not None and {at_least, above, at_most, below} != {None}:
        raise TypeError("opt: a closed set or bounds, not both")
    keys = ds if isinstance(ds, tuple) else (ds,)
    meta: dict[str, Any] = {
        "help": help, "alias": alias, "to": (to,) if isinstance(to, str) else to,
        "ds": tuple(DsKey(k) if isinstance(k, str) else k for k in keys), **argparse_kw}
    given = {"choices": choices, "refused": refused, "at_least": at_least, "above": above,
             "at_most": at_most, "below": below}
    meta.update((name, value) for name, value in given.items() if value is not None)
    return field(default=default, metadata=meta)


def _device(v):
    """A ds_config offload ``device`` as the tier flag takes it ("none": no tier)."""
    return None if v in (None, "none") else v


_DEVICE = one_of("none", "cpu", "nvme", None)


@dataclass
class Flags:
    """One field per command-line flag, flat, named as Megatron names it.

    Plain data, not yet checked: ``build_config(flags, world_size)``
    (:func:`hybrid.config.build_config`) turns it into the nested, frozen
    :class:`hybrid.config.TrainConfig` the components take.
    """


    # parallelism
    tensor_model_parallel_size: int = opt(1, "TP degree: ranks splitting each layer",
                                          to="parallel")
    sequence_parallel: bool = opt(False, "split norms, dropout and residuals along the "
                                         "sequence over TP (needs TP > 1)", to="parallel")
    context_parallel_size: int = opt(1, "CP degree: ranks splitting each sequence "
                                        "(attention across them, see --cp-comm-type)",
                                        to="parallel")
    cp_comm_type: str = opt("p2p", "how attention crosses the CP split: p2p (ring), "
                                   "all_gather (K/V once per layer) or a2a (Ulysses: heads "
                                   "split instead)", choices=CP_COMM_TYPES,
                                   refused={"a2a+p2p": "Megatron's hierarchical CP is not "
                                                       "in hybrid"}, to="parallel")
    cp_layout: str = opt("load_balanced", "which tokens a CP rank holds: load_balanced "
                                          "(chunks r and 2C-1-r of 2C) or striped "
                                          "(token i on rank i mod C)", choices=CP_LAYOUTS,
                                          to="parallel")
    distributed_backend: str | None = opt(None, "gloo or nccl (default: nccl with a GPU)",
                                          choices=("gloo", "nccl"), to="parallel.backend")
    distributed_timeout_minutes: float = opt(10.0, "timeout of every collective",
                                             to="parallel.timeout_minutes")
    # pipeline parallelism: the stages and which layers each holds (hybrid/config/stage_split.py)
    pipeline_model_parallel_size: int = opt(1, "PP degree: pipeline stages, each a "
                                               "consecutive slice of the layers (the "
                                               "outermost dimension of the layout)",
                                            to=("parallel", "pipeline.size"))
    virtual_pipeline_model_parallel_size: int | None = opt(
        None, "model chunks per pipeline rank (interleaved 1F1B when > 1; default 1, or what "
              "--num-layers-per-virtual-pipeline-stage or --pipeline-model-parallel-layout "
              "imply)", alias="--num-virtual-stages-per-pipeline-rank",
        to="pipeline.virtual_size")
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "layers per model chunk of an even split: the chunks per rank are the "
              "layers per stage / N")
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "transformer layers on the first pipeline stage (the rest split evenly over "
              "the stages after it)")
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "transformer layers on the last pipeline stage (the rest split evenly over "
              "the stages before it)")
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "count the embedding as a layer when splitting evenly: the first stage gets "
               "one transformer layer fewer")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "count the loss (final norm, output layer) as a layer when splitting evenly: "
               "the last stage gets one transformer layer fewer")
    pipeline_model_parallel_layout: str | None = opt(
        None, "every stage's layers as Megatron writes them: E embedding, t transformer "
              "layer, L loss, | between stages (PP x virtual stages of them, in model "
              "order), (..)*n and x*n repeat, commas for the eye; e.g. \"Ett|(tt|)*2,tL\"")
    pipeline_schedule: str = opt("1f1b", "the micro-batch schedule over the stages: "
                                 + ", ".join(f"{name} ({g.about})"
                                             for name, g in SCHEDULES.items()),
                                 choices=PIPELINE_SCHEDULES,
                                 to="pipeline.schedule")
    pipeline_reshard_after_micro_batch: bool = opt(
        False, "at --zero-stage 3, free each stage's gathered parameters after every "
               "micro-batch's forward and backward (2m all-gathers per unit a step, m "
               "micro-batches) instead of holding them from their first use to the stage's "
               "last backward (one): less memory, more traffic",
        to="pipeline.reshard_after_micro_batch")
    # model (defaults: a small GPT that trains on 2 CPU cores in minutes)
    num_layers: int = opt(4, "transformer layers", at_least=1, to="model")
    hidden_size: int = opt(256, "model width", at_least=1, to="model")
    num_attention_heads: int = opt(4, "attention heads (divisible by TP)", at_least=1,
                                   to="model")
    kv_channels: int | None = opt(None, "head size: accepted when it is --hidden-size / "
                                        "--num-attention-heads (Megatron scripts pass it)")
    ffn_hidden_size: int | None = opt(None, "MLP width (default 4 x hidden; see --swiglu)",
                                      at_least=1)
    seq_length: int = opt(128, "tokens per sample", at_least=1, to=("model", "data"))
    max_position_embeddings: int | None = opt(None, "positions (default: seq length)")
    make_vocab_size_divisible_by: int = opt(128, "pad vocab to a multiple of this x TP",
                                            at_least=1, to="model")
    hidden_dropout: float = opt(0.1, "dropout on the residual stream", at_least=0, below=1,
                                to="model")
    attention_dropout: float = opt(0.1, "dropout on attention probabilities", at_least=0,
                                   below=1, to="model")
    init_method_std: float = opt(0.02, "std of the normal weight init", at_least=0, to="model")
    attention_backend: str = opt("auto", "auto, flash, fused, unfused or local: which "
                                         "attention kernel runs (auto: torch's SDPA picks)",
                                 choices=("auto", "flash", "fused", "unfused", "local"),
                                 to="model")
    use_flash_attn: bool = opt(False, "older Megatron name for --attention-backend flash")
    # model architecture (the Llama family: hybrid/config/architecture.py)
    normalization: str = opt("LayerNorm", "LayerNorm or RMSNorm")
    norm_epsilon: float = opt(1e-5, "epsilon of every LayerNorm / RMSNorm")
    swiglu: bool = opt(False, "gated SiLU MLP; --ffn-hidden-size then defaults to "
                              "int(8 x hidden / 3 / 64) x 64")
    openai_gelu: bool = opt(False, "the MLP's GELU is the tanh approximation (OpenAI's GPT-2; "
                                   "Hugging Face's gelu_new); default: the exact (erf) GELU, "
                                   "as Megatron's")
    position_embedding_type: str = opt("learned_absolute", "learned_absolute, rope or none")
    rotary_base: float = opt(10000.0, "RoPE frequency base (theta)")
    rotary_percent: float = opt(1.0, "fraction of each head's channels RoPE rotates")
    use_rope_scaling: bool = opt(False, "Llama-3.1's RoPE frequency scaling (low/high "
                                        "frequency factors 1 and 4, original context 8192)")
    rope_scaling_factor: float = opt(8.0, "with --use-rope-scaling: how much longer the "
                                          "low frequencies' wavelengths become")
    rotary_seq_len_interpolation_factor: float | None = opt(
        None, "RoPE position interpolation: positions divided by this (a model trained "
              "at length L then reads L x factor tokens)")
    group_query_attention: bool = opt(False, "grouped-query attention (--num-query-groups)")
    num_query_groups: int | None = opt(None, "key/value heads with --group-query-attention "
                                             "(default 1)")
    untie_embeddings_and_output_weights: bool = opt(False, "a separate output layer instead "
                                                           "of the embedding's transpose")
    disable_bias_linear: bool = opt(False, "no biases in the linear layers")
    add_qkv_bias: bool = opt(False, "a bias on the QKV projection even with "
                                    "--disable-bias-linear (Qwen2)")
    # batch
    micro_batch_size: int = opt(8, "samples per rank per forward/backward", at_least=1,
                                to="loop")
    global_batch_size: int | None = opt(None, "samples per step (default micro x DP)",
                                        at_least=1, to="loop")
    rampup_batch_size: list[int] | None = opt(
        None, "START INCR SAMPLES: the global batch grows from START by INCR over the "
              "first SAMPLES samples, to --global-batch-size", to="loop.rampup")
    # optimizer and schedule
    lr: float = opt(1e-3, "peak learning rate", above=0, to="lr_schedule")
    min_lr: float = opt(0.0, "learning rate at the end of decay", at_least=0, to="lr_schedule")
    lr_warmup_iters: int = opt(0, "linear warmup iterations", at_least=0)
    lr_warmup_fraction: float | None = opt(None, "warmup as a fraction of the decay length",
                                           at_least=0, at_most=1)
    lr_warmup_samples: int = opt(0, "linear warmup samples (with --train-samples)", at_least=0)
    lr_decay_style: str = opt("constant", "constant, linear or cosine",
                              choices=("constant", "linear", "cosine"),
                              to="lr_schedule.decay_style")
    lr_warmup_init: float = opt(0.0, "the learning rate warmup starts from", at_least=0,
                                to="lr_schedule.warmup_init")
    lr_warmup_style: str = opt("linear", "warmup shape: linear, or log (DeepSpeed's "
                                         "WarmupLR default: log(step) / log(warmup))",
                               choices=("linear", "log"), to="lr_schedule.warmup_style")
    lr_schedule_steps: str = opt("megatron", "how a step's rate is counted: megatron (step k "
                                             "is iteration k of the schedule), or deepspeed "
                                             "(DeepSpeed's schedulers: the warmup start for "
                                             "steps 1 and 2, DeepSpeed's formulas after; set "
                                             "by a ds_config scheduler block)",
                                 choices=("megatron", "deepspeed"), to="lr_schedule.steps")
    lr_decay_iters: int | None = opt(None, "decay length (default: train iters)", at_least=1)
    lr_decay_samples: int | None = opt(None, "decay length in samples (with "
                                             "--train-samples; default: train samples)",
                                       at_least=1)
    weight_decay: float = opt(0.01, "AdamW decay (not on biases and norms)", at_least=0,
                              to="adamw")
    adam_beta1: float = opt(0.9, "Adam beta1", at_least=0, below=1, to="adamw.beta1")
    adam_beta2: float = opt(0.999, "Adam beta2", at_least=0, below=1, to="adamw.beta2")
    adam_eps: float = opt(1e-8, "Adam epsilon", above=0, to="adamw.eps")
    clip_grad: float = opt(1.0, "clip the global grad norm to this (0: off)", at_least=0,
                           ds="gradient_clipping", to="adamw")
    train_iters: int | None = opt(None, "optimizer steps (default 200 unless "
                                        "--train-samples)", at_least=1, to="loop")
    train_samples: int | None = opt(None, "train on this many samples instead of "
                                          "--train-iters (schedules count samples)",
                                    at_least=1, to="loop")
    exit_interval: int | None = opt(None, "save (with --save) and exit at the first "
                                          "iteration divisible by N", at_least=1, to="loop")
    exit_duration_in_mins: float | None = opt(None, "save (with --save) and exit once "
                                                    "the run has taken this long", above=0,
                                              to="loop")
    eod_mask_loss: bool = opt(False, "leave the predictions made at end-of-document tokens "
                                     "out of the loss", to="data")
    exit_signal_handler: bool = opt(False, "on SIGTERM (scancel, a preemption) save (with "
                                           "--save) and exit after the iteration in progress",
                                           to="loop")
    # (numpy's and torch's generators all take this range)
    seed: int = opt(1234, "fixes init, data order and dropout", at_least=0, at_most=2**32 - 1,
                    to="data")
    # ZeRO data parallelism
    zero_stage: int = opt(0, "0: all-reduce DP, 1: shard optimizer states, 2: +grads, "
                             "3: +params", choices=(0, 1, 2, 3), ds="zero_optimization.stage",
                          to="zero.stage")
    reduce_bucket_size: int = opt(50_000_000, "elements per gradient reduce bucket", at_least=1,
                                  ds="zero_optimization.reduce_bucket_size", to="zero")
    allgather_bucket_size: int = opt(50_000_000, "elements per parameter all-gather bucket",
                                     at_least=1, ds="zero_optimization.allgather_bucket_size",
                                     to="zero")
    overlap_comm: bool = opt(False, "launch bucket collectives during backward",
                             ds="zero_optimization.overlap_comm", to="zero")
    use_distributed_optimizer: bool = opt(False, "Megatron's sharded optimizer: ZeRO-1 "
                                                 "(unless --zero-stage says more)")
    overlap_grad_reduce: bool = opt(False, "Megatron's name for --overlap-comm (gradients)")
    overlap_param_gather: bool = opt(False, "Megatron's name for --overlap-comm "
                                            "(parameters)")
    zero_param_persistence_threshold: int = opt(100_000, "stage 3: params with fewer "
                                                         "elements stay unpartitioned",
                                                at_least=0,
                                                ds="zero_optimization."
                                                   "stage3_param_persistence_threshold",
                                                to="zero.param_persistence_threshold")
    ignore_unused_parameters: bool = opt(True, "a parameter the loss does not reach in a "
                                               "backward trains with a zero gradient "
                                               "(DeepSpeed's default); --no-ignore-unused-"
                                               "parameters: that is an error naming it",
                                         ds="zero_optimization.ignore_unused_parameters",
                                         to="zero")
    offload_optimizer: str | None = opt(
        None, "where the fp32 master shard and Adam moments live and the optimizer steps: "
              "cpu (host memory; the bare flag) or nvme (files under --offload-nvme-path, "
              "streamed through the staging buffers)", alias="--cpu-optimizer",
        const="cpu", choices=OFFLOAD_TIERS,
        ds=(DsKey("zero_optimization.cpu_offload", BOOL, lambda on: "cpu" if on else None),
            DsKey("zero_optimization.offload_optimizer.device", _DEVICE, _device)),
        to="offload.optimizer")
    offload_param: str | None = opt(
        None, "stage 3: where this rank's parameter shards live between uses: none, cpu or "
              "nvme", alias="--remote-device",
        choices=("none", *OFFLOAD_TIERS),
        ds=(DsKey("zero_optimization.cpu_offload_params", BOOL, lambda on: "cpu" if on else None),
            DsKey("zero_optimization.offload_param.device", _DEVICE, _device)),
        to="offload.param")
    offload_nvme_path: str | None = opt(None, "directory of the nvme tier's swap files (each "
                                              "rank uses its own subdirectory)",
                                      ds=("zero_optimization.offload_optimizer.nvme_path",
                                          "zero_optimization.offload_param.nvme_path"),
                                      to="offload.nvme_path")
    offload_buffer_count: int = opt(4, "host staging buffers of the nvme tier (>= 2: one is "
                                       "read while another is computed on)", at_least=2,
                                   ds="zero_optimization.offload_optimizer.buffer_count",
                                   to="offload.buffer_count")
    offload_buffer_size: int = opt(1 << 23, "elements per staging buffer (a multiple of "
                                            "1024); a buffer holds a tile's master and "
                                            "both moments, 12 bytes per element",
                                            to="offload.buffer_size")
    offload_pin_memory: bool | None = opt(None, "page-locked offload buffers (default: when "
                                                "training on a GPU; never without CUDA)",
                                                alias="--use-pin-memory",
                                       ds=("zero_optimization.cpu_offload_use_pin_memory",
                                           "zero_optimization.offload_optimizer.pin_memory",
                                           "zero_optimization.offload_param.pin_memory"),
                                       to="offload.pin_memory")
    offload_gds: bool = opt(False, "with --offload-param nvme: read the parameter shards "
                                   "from disk straight into device memory through GPUDirect "
                                   "Storage (torch.cuda.gds) where a probe shows it works; "
                                   "elsewhere one warning and pinned host buffers",
                             ds="aio.use_gds", to="offload.gds")
    # ZeRO-Offload's delayed update: the host step overlaps the next iteration's GPU work
    offload_delayed_update: bool = opt(False, "with --offload-optimizer: ZeRO-Offload's one-step "
                                              "delayed parameter update (the host step of "
                                              "iteration t overlaps iteration t+1)",
                                              to="offload.delayed_update")
    offload_delayed_update_warmup: int = opt(0, "normal steps before "
                                                "--offload-delayed-update starts",
                                            at_least=0, to="offload.delayed_update_warmup")
    offload_speculative_step: bool | None = opt(
        None, "with --offload-optimizer nvme under a pipeline: a stage whose backward has "
              "ended updates its read-ahead tiles while the other stages drain, kept when "
              "the clip does not bind and the step is not skipped (bit-identical either "
              "way; default: on there, never with --offload-delayed-update; --no- for A/B)",
        to="offload.speculative_step")
    compile: bool = opt(False, "torch.compile each transformer block's forward (same results "
                               "to rounding; its speed was not measured)", to="model")
    # mixed precision
    bf16: bool = opt(False, "bf16 params and grads, fp32 master weights", ds="bf16.enabled")
    fp16: bool = opt(False, "fp16 params and grads, fp32 master weights, loss scaling",
                     ds="fp16.enabled")
    accumulate_allreduce_grads_in_fp32: bool | None = opt(
        None, "accumulate micro-batch gradients and reduce them over DP in fp32 "
              "(default: on with --bf16, as in Megatron)",
        ds=DsKey("data_types.grad_accum_dtype", one_of("fp32", "bf16", "fp16"),
                 lambda v: v == "fp32"),
        to="precision.grads_in_fp32")
    loss_scale: float | None = opt(None, "static loss scale (default: dynamic)", above=0,
                                   ds=DsKey("fp16.loss_scale", NUMBER,
                                            lambda v: None if v == 0 else v),
                                   to="precision")
    initial_loss_scale: float = opt(2.0 ** 16, "dynamic loss scale to start from", above=0,
                                    ds=DsKey("fp16.initial_scale_power", INT,
                                             lambda p: float(2 ** p)),
                                    to="precision")
    min_loss_scale: float = opt(1.0, "dynamic loss scale floor", above=0,
                                ds="fp16.min_loss_scale", to="precision")
    loss_scale_window: int = opt(1000, "clean steps before the scale doubles", at_least=1,
                                 ds="fp16.loss_scale_window", to="precision")
    hysteresis: int = opt(2, "overflows tolerated before the scale halves", at_least=1,
                          ds="fp16.hysteresis", to="precision")
    # activation checkpointing (ZeRO-R)
    recompute_granularity: str | None = opt(
        None, "full: keep only each layer's input and rerun the layer in backward (ZeRO-R); "
              "selective: rerun only the attention core (scores, softmax, dropout)",
        choices=("full", "selective"), to="recompute.granularity")
    recompute_method: str | None = opt(None, "with full: uniform (every layer, in groups of "
                                             "--recompute-num-layers that each store one "
                                             "input) or block (only the first "
                                             "--recompute-num-layers layers, each on its own)",
                                         choices=("uniform", "block"))
    recompute_num_layers: int | None = opt(None, "with full: layers per checkpoint group "
                                                 "(uniform, default 1) or layers "
                                                 "checkpointed (block)")
    recompute_activations: bool = opt(False, "Megatron's shorthand for "
                                             "--recompute-granularity selective")
    checkpoint_activations: bool = opt(False, "older Megatron name for "
                                              "--recompute-granularity full")
    partition_activations: bool = opt(False, "each TP rank stores 1/TP of each checkpoint",
                                      alias="--distribute-saved-activations",
                                      ds="activation_checkpointing.partition_activations")
    cpu_checkpointing: bool = opt(False, "keep the checkpoints in host memory",
                                  alias="--checkpoint-in-cpu",
                                  ds="activation_checkpointing.cpu_checkpointing",
                                  to="recompute")
    contiguous_checkpointing: bool = opt(
        False, "store checkpoints in one preallocated buffer", alias="--contigious-checkpointing",
        ds="activation_checkpointing.contiguous_memory_optimization", to="recompute")
    deepspeed_activation_checkpointing: bool = opt(
        False, "Megatron-DeepSpeed's switch to DeepSpeed's activation checkpointing: hybrid's "
               "ZeRO-R is that, and the ds_config's activation_checkpointing section applies "
               "whenever recompute is on")
    # data
    data_path: list[str] | None = opt(None, "text file, or [weight] prefix ... of "
                                            "preprocessed data (default: built-in corpus)",
                                            to="data")
    split: str = opt("949,50,1", "train,valid,test proportions", to="data")
    tokenizer_type: str | None = opt(
        None, "byte, GPT2BPETokenizer (--vocab-file/--merge-file), HuggingFaceTokenizer "
              "(--tokenizer-model) or NullTokenizer (--vocab-size); older names gpt2bpe, hf. "
              "Default: GPT2BPETokenizer when both GPT-2 files are given, else byte",
        choices=TOKENIZER_TYPES, metavar="TYPE")
    vocab_file: str | None = opt(None, "GPT-2 vocab.json")
    merge_file: str | None = opt(None, "GPT-2 merges.txt")
    tokenizer_file: str | None = opt(None, "a tokenizers-library tokenizer.json")
    data_cache_path: str | None = opt(None, "where sample indices are cached (default: next "
                                            "to the data), and the parsed built-in corpus "
                                            "(default: ~/.cache/hybrid)", to="data.cache_path")
    mock_data: bool = opt(False, "train on synthetic tokens from --seed, no files (benchmarks)",
                          to="data")
    train_data_path: list[str] | None = opt(None, "[weight] prefix ... of the train split, "
                                                  "used whole (instead of --data-path + --split)",
                                                  to="data")
    valid_data_path: list[str] | None = opt(None, "[weight] prefix ... of the valid split",
                                            to="data")
    test_data_path: list[str] | None = opt(None, "[weight] prefix ... of the test split",
                                           to="data")
    tokenizer_model: str | None = opt(None, "HuggingFaceTokenizer: a tokenizer directory or "
                                            "tokenizer.json")
    vocab_size: int | None = opt(None, "NullTokenizer: token ids 0..N-1 (eod is N)",
                                 at_least=1)
    # checkpoints
    save: str | None = opt(None, "save checkpoints in this directory", to="checkpoint")
    load: str | None = opt(None, "resume from the newest checkpoint in this directory",
                           to="checkpoint")
    save_interval: int | None = opt(None, "save every N iterations (and at the end)",
                                    at_least=1, to="checkpoint")
    keep_last: int | None = opt(None, "after a save, keep only the newest N checkpoints",
                                at_least=1, to="checkpoint")
    no_save_optim: bool = opt(False, "save the fp32 model weights only, no optimizer state "
                                     "(about 1/3 of the bytes); resuming one needs "
                                     "--no-load-optim or --finetune", to="checkpoint")
    no_load_optim: bool = opt(False, "load weights, iteration and data position from --load "
                                     "but start the optimizer fresh (zero Adam moments)",
                                     to="checkpoint")
    no_load_rng: bool = opt(False, "keep the RNG seeded from --seed, not the checkpoint's",
                            to="checkpoint")
    finetune: bool = opt(False, "load the weights only: iteration 0, data from the start, "
                                "fresh optimizer, RNG from --seed; --save starts a new "
                                "series (a restart resumes that series)", to="checkpoint")
    ckpt_step: int | None = opt(None, "load the checkpoint of this iteration from --load "
                                      "instead of the newest one", at_least=0,
                                to="checkpoint")
    overwrite_save: bool = opt(False, "start a new run in a --save directory that holds "
                                      "another run's checkpoints, deleting them (without it "
                                      "such a run is refused)", to="checkpoint")
    exit_on_nan_iterations: int = opt(10, "stop with an error after N consecutive skipped "
                                          "steps with non-finite gradients", at_least=1,
                                      to="loop")
    # evaluation and logging
    eval_interval: int = opt(1000, "validate every N iterations", at_least=1, to="loop")
    eval_iters: int = opt(10, "iterations per validation", at_least=0, to="loop")
    log_interval: int = opt(10, "iterations per console line", at_least=1,
                            ds="steps_per_print", to="logging")
    log_json: str | None = opt(None, "write one JSON object per logged iteration here",
                               to="logging")
    tensorboard_dir: str | None = opt(None, "write TensorBoard scalars here", to="logging")
    log_throughput: bool = opt(False, "add TFLOP/s per rank to the console line "
                                      "(always in --log-json and TensorBoard)", to="logging")
    timing_breakdown: bool = opt(False, "forward, backward and optimizer seconds per step "
                                        "on every log line (on a GPU: a device sync at each "
                                        "phase boundary)", ds="wall_clock_breakdown",
                              to="logging")
    # diagnostics: collective flight recorder, collective and replica checks
    collective_dump_dir: str | None = opt(
        None, "when a collective fails, every live rank writes its last collectives here as "
              "JSON (collectives_rank00003.json)", to="diagnostics")
    check_collectives: bool = opt(
        False, "debug: before each collective the ranks of its group compare op, shape, dtype "
               "and sequence number (one small all-gather); a mismatch stops the job naming "
               "both calls", to="diagnostics")
    check_replicas_interval: int = opt(
        0, "every N iterations check that parameters replicated over TP and DP are "
           "bit-identical; a divergence stops the job naming the parameter and ranks (0: off)",
        at_least=0, to="diagnostics")
    # kernels (hybrid.kernels; defaults from HYBRID_* variables: config_kernels.py)
    no_kernels: bool = opt(False, "never build or load the csrc/ kernels: PyTorch fallbacks "
                                  "only (also on with HYBRID_NO_KERNELS=1)")
    kernel_cache_dir: str | None = opt(None, "where compiled kernels are cached (default: "
                                             "$HYBRID_KERNEL_CACHE, else $XDG_CACHE_HOME or "
                                             "~/.cache, /hybrid/kernels)")
    kernel_choice: str | None = opt(None, "op=path,... the path an op takes, overriding the "
                                          "measured default (ops: " + ", ".join(KERNEL_PATHS)
                                    + ", all; e.g. layer_norm=fused,linear=fp32; "
                                      "default: $HYBRID_KERNEL_CHOICE)")
    # DeepSpeed's configuration file (hybrid/config/deepspeed.py)
    deepspeed: str | None = opt(None, "Megatron-DeepSpeed's marker (no value), or as Hugging "
                                      "Face's Trainer takes it, the ds_config.json to read",
                                const="")
    deepspeed_config: str | None = opt(None, "a DeepSpeed ds_config.json: its keys set the "
                                             "matching flags (README: 'Coming from "
                                             "DeepSpeed')", alias="--deepspeed_config")
    # not flags: the Megatron flags parse_args dropped as having no effect here, the
    # flags the command line gave (a ds_config may not contradict them), what the
    # ds_config accepted without effect, and the fields set other than by their flag
    # (field -> the name the user gave the value by: "ds_config zero_optimization.stage",
    # "hybrid.initialize(seed=...)"), which build_config's messages say instead of the flag
    ignored_megatron_flags: list[str] = field(default_factory=list, metadata={"cli": False})
    explicit_flags: list[str] = field(default_factory=list, metadata={"cli": False})
    ds_config_notes: list[str] = field(default_factory=list, metadata={"cli": False})
    given_as: dict[str, str] = field(default_factory=dict, metadata={"cli": False})


def _routes() -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {}
    for f in dataclasses.fields(Flags):
        for target in f.metadata.get("to", ()):
            section, _, name = target.partition(".")
            fields = table.setdefault(section, {})
            name = name or f.name
            if name in fields:  # one field, one source: a second would silently win
                raise TypeError(f"Flags.{f.name} and Flags.{fields[name]} both go to "
                                f"{section}.{name}")
            fields[name] = f.name
    return table


# section -> {its field: the Flags field whose checked value it takes}, from every flag's
# ``to`` (the module note). Read-only: build_config and ModelConfig.from_flags cut by it.
ROUTES: dict[str, dict[str, str]] = _routes()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def build_parser(explicit_only: bool = False,
                 cls: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    """One flag per :class:`Flags` field, named as Megatron names it. ``explicit_only``:
    no defaults, so a parse holds only the flags the command line gave. ``cls``: the
    parser's class (:func:`parse_args` takes one whose errors are ConfigErrors)."""
    p = cls(
        prog="pretrain_gpt.py", description="Pretrain a GPT with tensor x data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Flags):
        if f.metadata.get("cli") is False:
            continue
        names = [flag_name(f.name)] + ([f.metadata["alias"]] if f.metadata.get("alias") else [])
        kind, many = field_type(f)
        kw: dict[str, Any] = dict(
            dest=f.name, default=argparse.SUPPRESS if explicit_only else f.default,
            help=f.metadata.get("help"))
        if "metavar" in f.metadata:
            kw["metavar"] = f.metadata["metavar"]
        elif "choices" in f.metadata:  # shown as argparse shows choices; check_fields checks
            kw["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
        if "const" in f.metadata:
            kw.update(nargs="?", const=f.metadata["const"])
        # tri-state (--x / --no-x / a derived default), or on by default (--no-x turns it off)
        if kind is bool and f.default is not False:
            p.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif kind is bool:
            p.add_argument(*names, action="store_true", **kw)
        else:
            kw.setdefault("nargs", "+" if many else None)
            kw.setdefault("metavar", f.name.split("_")[-1].upper())
            p.add_argument(*names, type=kind, **kw)
    return p


def field_type(f: dataclasses.Field) -> tuple[type, bool]:
    """(element type, is a list) of a field annotated like 'int', 'str | None', 'list[str]'."""
    t = str(f.type).replace("typing.", "")
    many = t.startswith("list[")
    head = t[5:].split("]")[0] if many else t.split(" ")[0]
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if head == name:
            return kind, many
    raise TypeError(f"unsupported flag field type {f.type!r} for {f.name}")


def parse_args(argv: list[str] | None = None) -> Flags:
    """Parse a command line into :class:`Flags` (checked later: that needs the world size).

    Megatron flags hybrid does not implement raise one ConfigError naming them
    (see :mod:`hybrid.config.megatron_flags`); those that only pick a Megatron
    implementation are dropped, and :attr:`Flags.ignored_megatron_flags` lists them.
    """
    from hybrid.config.megatron_flags import split_megatron_flags
    ours, ignored = split_megatron_flags(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(cls=_RaisingParser)
    ns, unknown = parser.parse_known_args(ours)
    if unknown:
        raise ConfigError(_unknown_message(unknown[0]))
    given = build_parser(explicit_only=True).parse_known_args(ours)[0]
    return Flags(**vars(ns), ignored_megatron_flags=ignored, explicit_flags=sorted(vars(given)))


def _unknown_message(arg: str) -> str:
    name = arg.partition("=")[0]
    if not name.startswith("-"):
        return f"unexpected argument {arg!r} (every value follows its --flag)"
    known = [flag_name(f.name) for f in dataclasses.fields(Flags)]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"{name} is not a flag hybrid knows, nor a Megatron-LM flag it maps "
            f"(README: 'Coming from Megatron-LM'){hint}")


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors are one ConfigError, not argparse's usage dump + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)
