"""The small, frozen config sections each component takes (never the whole run config).

:func:`hybrid.config.build_config` checks the flat command-line flags in one
place and cuts them into these sections; :class:`hybrid.config.TrainConfig`
holds one of each. Each section is plain data (no torch import), so a
component can also be built directly in tests and tools. A field here is the
contract its component reads; which flag fills it is said once, by the flag
(``to=`` in :mod:`hybrid.config.flags`), and a test holds the two to the same
type and default (tests/config/test_single_definition.py). The model section
lives in :mod:`hybrid.config.model`, the closed sets of values some options
take (:data:`CP_COMM_TYPES`, :data:`OFFLOAD_TIERS`, ...) here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.config.stage_split import StageSplit
from hybrid.errors import ConfigError
from hybrid.pipeline.schedules import SCHEDULES


@dataclass(frozen=True)
class ZeroConfig:
    """How :func:`hybrid.zero.apply_zero` shards the model states over the DP group,
    and in what pieces it communicates them.

    ``stage``: 0-3 (:class:`hybrid.zero.plan.ShardingPlan`). ``reduce_bucket_size``
    / ``allgather_bucket_size``: elements per gradient reduction / parameter
    all-gather bucket (no staging buffer is larger). ``overlap_comm``: reduce
    buckets while backward goes on. ``param_persistence_threshold``: at stage 3,
    parameters smaller than this stay whole on every rank. ``ignore_unused_parameters``:
    a parameter that gets no gradient in a backward counts as a zero gradient (as
    DeepSpeed's key of that name); False: it is an error naming it
    (:mod:`hybrid.zero.grad_sync`, [Note: unused parameters]).
    """

    stage: int = 0
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    overlap_comm: bool = False
    param_persistence_threshold: int = 100_000
    ignore_unused_parameters: bool = True


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW's hyperparameters and the gradient clipping before it, as the ZeRO
    engine applies them to its shards (the learning rate comes each step from
    :class:`LRScheduleConfig`).

    ``clip_grad``: the largest global L2 norm of the gradient; a larger one is
    scaled down to it (<= 0: no clipping). ``weight_decay``: decoupled, on the
    matrices (parameters of two or more dimensions) only.
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0


@dataclass(frozen=True)
class PrecisionConfig:
    """The dtypes the model trains and reduces in, and the fp16 loss scale.

    ``params_dtype``: "fp32", "bf16" or "fp16" (the model's training dtype; the
    optimizer keeps fp32 master weights for the low-precision ones).
    ``grads_in_fp32``: accumulate micro-batches and reduce over DP in fp32
    (Megatron's ``--accumulate-allreduce-grads-in-fp32``); otherwise in
    ``params_dtype``.
    ``loss_scale``: static fp16 loss scale; None means dynamic under fp16
    (from ``initial_loss_scale``, halved on overflow down to ``min_loss_scale``
    once ``hysteresis`` overflows have accumulated, doubled after
    ``loss_scale_window`` clean steps) and no scaling otherwise.
    """

    params_dtype: str = "fp32"
    grads_in_fp32: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    @property
    def grads_dtype(self) -> str:
        return "fp32" if self.grads_in_fp32 else self.params_dtype


OFFLOAD_TIERS = ("cpu", "nvme")  # where model states can live off the device


@dataclass(frozen=True)
class OffloadConfig:
    """What lives off the device, and where (:mod:`hybrid.zero.offload`,
    :mod:`hybrid.zero.offload.nvme.swap`).

    ``optimizer``: None (on the device), "cpu" (the fp32 master weights and Adam
    moments live in host memory and the optimizer step runs there: ZeRO-Offload)
    or "nvme" (they live in per-rank swap files under ``nvme_path`` and stream
    through the staging buffers during the host step: ZeRO-Infinity).
    ``param``: stage 3 only; None, "cpu" or "nvme": where this rank's parameter
    shards live between the gathers that use them.
    ``buffer_count`` x ``buffer_size`` elements: the nvme tier's host staging, at
    most that whatever the model size (:meth:`tile`: a smaller shard's own size).
    ``pin_memory``: page-locked host buffers (None: when training on a GPU; never
    without CUDA). ``delayed_update``:
    with ``optimizer``, ZeRO-Offload's one-step delayed parameter update, after
    ``delayed_update_warmup`` normal steps. ``gds``: with ``param`` "nvme", read
    the shards into device memory through GPUDirect Storage where it works
    (:mod:`hybrid.kernels.gds`). ``speculative_step``: on the nvme tier without the
    delayed update, a pipeline stage whose backward has ended updates its read-ahead
    tiles while the other stages drain, kept only if the step's scalars turn out the
    same (hybrid/zero/offload/host_step.py, [Note: what starts before the step]).
    """

    optimizer: str | None = None
    param: str | None = None
    nvme_path: str | None = None
    buffer_count: int = 4
    buffer_size: int = 1 << 23
    pin_memory: bool | None = None
    delayed_update: bool = False
    delayed_update_warmup: int = 0
    gds: bool = False
    speculative_step: bool = True

    @property
    def nvme(self) -> bool:
        """Some state lives in swap files: ``nvme_path`` is needed."""
        return "nvme" in (self.optimizer, self.param)

    def tile(self, n: int) -> int:
        """Elements of the nvme tier's tile for a shard of ``n`` elements: ``buffer_size``,
        or a shard smaller than that whole, rounded up to 1024 elements (12 bytes each
        keeps a tile's offsets 4096-aligned for direct I/O). A small model then stages
        and preallocates its own size, not a default tile's 96 MiB per buffer."""
        return min(self.buffer_size, max(1024, -(-n // 1024) * 1024))


@dataclass(frozen=True)
class RecomputeConfig:
    """What :func:`hybrid.recompute.checkpointing.apply_activation_checkpointing` needs.

    ``granularity``: None (no recompute), "full" (whole blocks) or "selective"
    (the attention core only). ``num_layers``: with full, checkpoint the first N
    blocks (None: all) -- Megatron's block method. ``layers_per_checkpoint``:
    with full, cut the checkpointed blocks into groups of N consecutive ones (the
    last may be shorter); a group stores only its input and reruns all N blocks
    in backward -- Megatron's uniform method with ``--recompute-num-layers N``.
    """

    granularity: str | None = None
    num_layers: int | None = None
    layers_per_checkpoint: int = 1
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_checkpointing: bool = False


# --cp-comm-type: how attention crosses the CP split (hybrid.tensor_parallel.cp_attention
# runs each); --cp-layout: which tokens a CP rank holds (hybrid.tensor_parallel.context_parallel)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
CP_LAYOUTS = ("load_balanced", "striped")


@dataclass(frozen=True)
class ParallelConfig:
    """The process layout (:mod:`hybrid.parallel.layout`) and how the process groups are made."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"  # one of CP_COMM_TYPES
    cp_layout: str = "load_balanced"  # one of CP_LAYOUTS
    backend: str | None = None  # None: nccl with a GPU, gloo otherwise
    timeout_minutes: float = 10.0


# --pipeline-schedule: the micro-batch orders of the pipeline stages (the registry's names)
PIPELINE_SCHEDULES = tuple(SCHEDULES)


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is cut into pipeline stages and how micro-batches flow through them.

    ``size``: pipeline stages (PP; the layout's is ``ParallelConfig``'s, the same number).
    ``virtual_size``: model chunks per stage (1: each stage one consecutive slice).
    ``schedule``: one of :data:`PIPELINE_SCHEDULES`; ``"interleaved_1f1b"`` exactly when
    ``virtual_size`` > 1. ``split``: the layers of every chunk, and where the embedding and
    the loss are (:class:`hybrid.config.stage_split.StageSplit`); None only in a section built
    by hand, meaning one stage with the whole model. ``reshard_after_micro_batch``: at
    ZeRO stage 3, free a stage's gathered parameters after every micro-batch's forward and
    backward (2m all-gathers per unit a step) instead of holding them from their first use
    to the stage's last backward (one).
    """

    size: int = 1
    virtual_size: int = 1
    schedule: str = "1f1b"
    split: StageSplit | None = None
    reshard_after_micro_batch: bool = False


@dataclass(frozen=True)
class LRScheduleConfig:
    """The learning-rate schedule, Megatron's ``--lr*`` flags (AdamW's own
    hyperparameters are in :class:`AdamWConfig`).

    ``unit``: "iterations" or "samples" -- what ``warmup`` and ``decay`` count,
    and what :func:`hybrid.train.lr_schedule.scheduled_lr` is stepped by.
    Warmup rises from ``warmup_init`` to ``lr``, linearly or (``warmup_style``
    "log", DeepSpeed's default) as log(step) / log(warmup). ``steps``: "megatron"
    (optimizer step k takes the schedule's iteration k) or "deepspeed" (DeepSpeed's
    schedulers' own counting and formulas: :func:`hybrid.train.lr_schedule.deepspeed_lr`).
    """

    lr: float = 1e-3
    min_lr: float = 0.0
    decay_style: str = "constant"
    unit: str = "iterations"
    warmup: int = 0
    decay: int = 200
    warmup_init: float = 0.0
    warmup_style: str = "linear"
    steps: str = "megatron"


@dataclass(frozen=True)
class LoopConfig:
    """What the training loop (:mod:`hybrid.train.loop`) runs: its batches, how long
    it goes, when it exits early, when it evaluates.

    Exactly one of ``train_iters`` and ``train_samples`` is set. ``rampup``:
    (start, increment, samples) -- Megatron's ``--rampup-batch-size``; the
    global batch is ``start + k * increment`` after ``k`` ramp intervals of
    ``samples / ((global - start) / increment)`` samples each.
    """

    micro_batch_size: int = 8
    global_batch_size: int = 8
    rampup: tuple[int, int, int] | None = None
    train_iters: int | None = 200
    train_samples: int | None = None
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False  # SIGTERM: save and exit (hybrid/train/early_exit.py)
    exit_on_nan_iterations: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10


@dataclass(frozen=True)
class DataConfig:
    """What :func:`hybrid.data.dataset.build_datasets` needs (besides the tokenizer).

    The sources, one of: ``data_path`` (``[weight] prefix ...`` cut into
    train/valid/test by ``split``), per-split ``train/valid/test_data_path``
    lists used whole, ``mock_data`` (synthetic tokens from ``seed``), or none
    (the built-in corpus). ``cache_path``: where sample orders and token checks
    are cached (None: next to each data file). ``corpus_cache``: where the built-in
    corpus is kept once parsed (None: parsed by every process).
    """

    seq_length: int = 128
    seed: int = 1234
    data_path: tuple[str, ...] | None = None
    split: str = "949,50,1"
    train_data_path: tuple[str, ...] | None = None
    valid_data_path: tuple[str, ...] | None = None
    test_data_path: tuple[str, ...] | None = None
    mock_data: bool = False
    eod_mask_loss: bool = False  # micro-batches carry a loss mask, 0 at end-of-document inputs
    cache_path: str | None = None
    corpus_cache: str | None = None


# --tokenizer-type: Megatron's names, and hybrid's older ones as aliases.
TOKENIZER_TYPES = {
    "byte": "byte",
    "GPT2BPETokenizer": "GPT2BPETokenizer", "gpt2bpe": "GPT2BPETokenizer",
    "HuggingFaceTokenizer": "HuggingFaceTokenizer", "hf": "HuggingFaceTokenizer",
    "NullTokenizer": "NullTokenizer", "null": "NullTokenizer",
}


def tokenizer_kind(name: str | None) -> str | None:
    """The canonical name of a ``--tokenizer-type`` value, or None if unknown."""
    return TOKENIZER_TYPES.get(name or "byte")


@dataclass(frozen=True)
class TokenizerConfig:
    """What :func:`hybrid.data.tokenizer.build_tokenizer` needs.

    ``type``: a canonical name (a value of :data:`TOKENIZER_TYPES`). Its files:
    ``vocab_file`` and ``merge_file`` (GPT2BPETokenizer), ``model`` (a tokenizer
    directory or tokenizer.json, HuggingFaceTokenizer; ``model_flag`` is the flag
    that named it, for messages), ``vocab_size`` (NullTokenizer).
    """

    type: str = "byte"
    vocab_file: str | None = None
    merge_file: str | None = None
    model: str | None = None
    model_flag: str = "--tokenizer-model"
    vocab_size: int | None = None

    def __post_init__(self):
        if self.type not in TOKENIZER_TYPES.values():
            raise ValueError(f"tokenizer type {self.type!r}: expected one of "
                             f"{sorted(set(TOKENIZER_TYPES.values()))}")

    @classmethod
    def from_flags(cls, tokenizer_type: str | None = None, vocab_file: str | None = None,
                   merge_file: str | None = None, tokenizer_model: str | None = None,
                   tokenizer_file: str | None = None,
                   vocab_size: int | None = None) -> TokenizerConfig:
        """The section from Megatron's tokenizer flags (any spelling of the type;
        ``--tokenizer-file`` is the older name of ``--tokenizer-model``)."""
        kind = tokenizer_kind(tokenizer_type)
        if kind is None:
            raise ConfigError(f"--tokenizer-type {tokenizer_type!r}: unknown (one of "
                             f"{', '.join(TOKENIZER_TYPES)})")
        return cls(type=kind, vocab_file=vocab_file, merge_file=merge_file,
                   model=tokenizer_model or tokenizer_file,
                   model_flag="--tokenizer-model" if tokenizer_model or not tokenizer_file
                   else "--tokenizer-file", vocab_size=vocab_size)


@dataclass(frozen=True)
class CheckpointConfig:
    """What saving and resuming need (:mod:`hybrid.checkpoint.resume`, the training loop).

    ``save`` / ``load``: directories (None: off). ``no_save_optim``: save the fp32
    master weights only. ``no_load_optim``: load the weights, iteration and data
    position, with a fresh optimizer. ``no_load_rng``: keep the RNG seeded from
    ``--seed``. ``finetune``: load the weights only and start at iteration 0 (a
    new series of checkpoints in ``save``). ``ckpt_step``: load that iteration
    rather than the newest. Megatron's flags of the same names. ``overwrite_save``
    (hybrid's own): a new run may take a ``save`` directory that holds another
    run's checkpoints, deleting them (:mod:`hybrid.checkpoint.ownership`).
    """

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    keep_last: int | None = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_step: int | None = None
    overwrite_save: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    """What is logged where, and how often (rank 0 writes)."""

    log_interval: int = 10
    log_json: str | None = None
    tensorboard_dir: str | None = None
    log_throughput: bool = False
    timing_breakdown: bool = False


@dataclass(frozen=True)
class DiagnosticsConfig:
    """What the training loop's diagnostics need (:mod:`hybrid.diagnostics`).

    ``collective_dump_dir``: where each live rank writes its flight recorder
    ring when a collective fails (None: nowhere). ``check_collectives``:
    compare every collective's fingerprint across its group first.
    ``check_replicas_interval``: every N iterations compare the checksums of
    replicated parameters over TP and DP (0: never).
    """

    collective_dump_dir: str | None = None
    check_collectives: bool = False
    check_replicas_interval: int = 0


# The paths each op of :mod:`hybrid.kernels` can take (hybrid/kernels/select.py):
# "fused" (a csrc/ kernel), "eager" (plain PyTorch ops), "compile" (torch.compile of
# eager); for "linear", "fp32" (a bf16/fp16 product computed in fp32, for CPUs
# without native low-precision matmuls).
KERNEL_PATHS = {
    "layer_norm": ("fused", "eager", "compile"),
    "bias_gelu": ("fused", "eager", "compile"),
    "cross_entropy": ("fused", "eager", "compile"),
    "adam": ("fused", "eager", "compile"),
    "linear": ("eager", "fp32"),
}


@dataclass(frozen=True)
class KernelConfig:
    """What :mod:`hybrid.kernels` needs; set once per process at start-up with
    :func:`hybrid.kernels.configure` (default: this, all kernels allowed).

    ``no_kernels``: never build or load a ``csrc/`` extension; every op takes its
    PyTorch fallback. ``cache_dir``: where compiled extensions are cached (None:
    ``~/.cache/hybrid/kernels``). ``choice``: ``(op, path)`` pairs overriding the
    path an op takes (paths per op in ``KERNEL_PATHS``). ``cuda_arch_list``: the
    ``TORCH_CUDA_ARCH_LIST`` the CUDA build compiles for (part of its cache key).
    """

    no_kernels: bool = False
    cache_dir: str | None = None
    choice: tuple[tuple[str, str], ...] = ()
    cuda_arch_list: str | None = None

    def __post_init__(self):
        for op, path in self.choice:
            if path not in KERNEL_PATHS.get(op, ()):
                raise ValueError(f"kernel choice {op}={path}: expected op=path with op in "
                                 f"{tuple(KERNEL_PATHS)} and path one of that op's "
                                 f"{KERNEL_PATHS.get(op, ())}")

    def path_for(self, op: str) -> str | None:
        """The path ``op`` was told to take, or None (the default choice)."""
        return dict(self.choice).get(op)
