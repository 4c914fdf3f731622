"""The small, frozen config sections each component takes (never the whole run config).

:func:`hybrid.config.build_config` checks the flat command-line flags in one
place and cuts them into these sections; :class:`hybrid.config.TrainConfig`
holds one of each. Each section is plain data (no torch import), so a
component can also be built directly in tests and tools. A field here is the
contract its component reads, and a field a flag fills declares that flag (its
Megatron name, help, what its value alone must be, the ds_config keys that set it:
:func:`hybrid.config.options.opt`, the note there). A field with a plain default is
derived by :mod:`hybrid.config.build`. The model section
lives in :mod:`hybrid.config.model`, the closed sets of values some options
take (:data:`CP_COMM_TYPES`, :data:`OFFLOAD_TIERS`, ...) here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid.config.kinds import BOOL, INT, NUMBER, one_of
from hybrid.config.options import DsKey, opt, route
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

    stage: int = opt(
        0, "0: all-reduce DP, 1: shard optimizer states, 2: +grads, 3: +params", flag="zero_stage",
        choices=(0, 1, 2, 3), ds="zero_optimization.stage")
    reduce_bucket_size: int = opt(
        50_000_000, "elements per gradient reduce bucket", at_least=1,
        ds="zero_optimization.reduce_bucket_size")
    allgather_bucket_size: int = opt(
        50_000_000, "elements per parameter all-gather bucket", at_least=1,
        ds="zero_optimization.allgather_bucket_size")
    overlap_comm: bool = opt(
        False, "launch bucket collectives during backward", ds="zero_optimization.overlap_comm")
    param_persistence_threshold: int = opt(
        100_000, "stage 3: params with fewer elements stay unpartitioned",
        flag="zero_param_persistence_threshold", at_least=0,
        ds="zero_optimization."
           "stage3_param_persistence_threshold")
    ignore_unused_parameters: bool = opt(
        True, "a parameter the loss does not reach in a backward trains with a zero gradient "
        "(DeepSpeed's default); --no-ignore-unused-parameters: that is an error naming it",
        ds="zero_optimization.ignore_unused_parameters")


@dataclass(frozen=True)
class MegatronZeroFlags:
    """Megatron's names for ZeRO options (:func:`hybrid.config.checks.check_zero`)."""

    use_distributed_optimizer: bool = opt(
        False, "Megatron's sharded optimizer: ZeRO-1 (unless --zero-stage says more)")
    overlap_grad_reduce: bool = opt(False, "Megatron's name for --overlap-comm (gradients)")
    overlap_param_gather: bool = opt(False, "Megatron's name for --overlap-comm (parameters)")


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW's hyperparameters and the gradient clipping before it, as the ZeRO
    engine applies them to its shards (the learning rate comes each step from
    :class:`LRScheduleConfig`).

    ``clip_grad``: the largest global L2 norm of the gradient; a larger one is
    scaled down to it (<= 0: no clipping). ``weight_decay``: decoupled, on the
    matrices (parameters of two or more dimensions) only. ``clip_norm_of``: the
    gradients that norm counts: ``"model"``, every parameter once (Megatron's), or
    ``"first_stage"``, DeepSpeed's PipelineEngine's: a replicated (not tensor-split)
    parameter counts on the first pipeline stage only, and every stage clips by that
    norm (:func:`hybrid.zero.optimizer.global_grad_norm`).
    """

    beta1: float = opt(0.9, "Adam beta1", flag="adam_beta1", at_least=0, below=1)
    beta2: float = opt(0.999, "Adam beta2", flag="adam_beta2", at_least=0, below=1)
    eps: float = opt(1e-8, "Adam epsilon", flag="adam_eps", above=0)
    weight_decay: float = opt(0.01, "AdamW decay (not on biases and norms)", at_least=0)
    clip_grad: float = opt(
        1.0, "clip the global grad norm to this (0: off)", at_least=0, ds="gradient_clipping")
    clip_norm_of: str = "model"


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
    grads_in_fp32: bool = opt(
        False, "accumulate micro-batch gradients and reduce them over DP in fp32 (default: on "
        "with --bf16, as in Megatron)", flag="accumulate_allreduce_grads_in_fp32",
        flag_default=None,
        ds=DsKey("data_types.grad_accum_dtype", one_of("fp32", "bf16", "fp16"),
                 lambda v: v == "fp32"))
    loss_scale: float | None = opt(
        None, "static loss scale (default: dynamic)", above=0,
        ds=DsKey("fp16.loss_scale", NUMBER,
                 lambda v: None if v == 0 else v))
    initial_loss_scale: float = opt(
        2.0 ** 16, "dynamic loss scale to start from", above=0,
        ds=DsKey("fp16.initial_scale_power", INT,
                 lambda p: float(2 ** p)))
    min_loss_scale: float = opt(1.0, "dynamic loss scale floor", above=0, ds="fp16.min_loss_scale")
    loss_scale_window: int = opt(
        1000, "clean steps before the scale doubles", at_least=1, ds="fp16.loss_scale_window")
    hysteresis: int = opt(
        2, "overflows tolerated before the scale halves", at_least=1, ds="fp16.hysteresis")

    @property
    def grads_dtype(self) -> str:
        return "fp32" if self.grads_in_fp32 else self.params_dtype

    @staticmethod
    def derived(f: Any) -> dict[str, Any]:
        """``params_dtype`` from the checked flat flags ``f`` (:class:`DtypeFlags`)."""
        return {"params_dtype": "bf16" if f.bf16 else "fp16" if f.fp16 else "fp32"}


@dataclass(frozen=True)
class DtypeFlags:
    """The training dtype: ``PrecisionConfig.params_dtype`` is derived from these."""

    bf16: bool = opt(False, "bf16 params and grads, fp32 master weights", ds="bf16.enabled")
    fp16: bool = opt(
        False, "fp16 params and grads, fp32 master weights, loss scaling", ds="fp16.enabled")


OFFLOAD_TIERS = ("cpu", "nvme")  # where model states can live off the device


def _device(v):
    """A ds_config offload ``device`` as the tier flag takes it ("none": no tier)."""
    return None if v in (None, "none") else v


_DEVICE = one_of("none", "cpu", "nvme", None)


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

    optimizer: str | None = opt(
        None, "where the fp32 master shard and Adam moments live and the optimizer steps: cpu "
        "(host memory; the bare flag) or nvme (files under --offload-nvme-path, streamed through "
        "the staging buffers)", flag="offload_optimizer", alias="--cpu-optimizer", const="cpu",
        choices=OFFLOAD_TIERS,
        ds=(DsKey("zero_optimization.cpu_offload", BOOL, lambda on: "cpu" if on else None),
            DsKey("zero_optimization.offload_optimizer.device", _DEVICE, _device)))
    param: str | None = opt(
        None, "stage 3: where this rank's parameter shards live between uses: none, cpu or nvme",
        flag="offload_param", alias="--remote-device", choices=("none", *OFFLOAD_TIERS),
        ds=(DsKey("zero_optimization.cpu_offload_params", BOOL, lambda on: "cpu" if on else None),
            DsKey("zero_optimization.offload_param.device", _DEVICE, _device)))
    nvme_path: str | None = opt(
        None, "directory of the nvme tier's swap files (each rank uses its own subdirectory)",
        flag="offload_nvme_path",
        ds=("zero_optimization.offload_optimizer.nvme_path",
            "zero_optimization.offload_param.nvme_path"))
    buffer_count: int = opt(
        4, "host staging buffers of the nvme tier (>= 2: one is read while another is computed "
        "on)", flag="offload_buffer_count", at_least=2,
        ds="zero_optimization.offload_optimizer.buffer_count")
    buffer_size: int = opt(
        1 << 23, "elements per staging buffer (a multiple of 1024); a buffer holds a tile's "
        "master and both moments, 12 bytes per element", flag="offload_buffer_size")
    pin_memory: bool | None = opt(
        None, "page-locked offload buffers (default: when training on a GPU; never without CUDA)",
        flag="offload_pin_memory", alias="--use-pin-memory",
        ds=("zero_optimization.cpu_offload_use_pin_memory",
            "zero_optimization.offload_optimizer.pin_memory",
            "zero_optimization.offload_param.pin_memory"))
    delayed_update: bool = opt(
        False, "with --offload-optimizer: ZeRO-Offload's one-step delayed parameter update (the "
        "host step of iteration t overlaps iteration t+1)", flag="offload_delayed_update")
    delayed_update_warmup: int = opt(
        0, "normal steps before --offload-delayed-update starts",
        flag="offload_delayed_update_warmup", at_least=0)
    gds: bool = opt(
        False, "with --offload-param nvme: read the parameter shards from disk straight into "
        "device memory through GPUDirect Storage (torch.cuda.gds) where a probe shows it works; "
        "elsewhere one warning and pinned host buffers", flag="offload_gds", ds="aio.use_gds")
    speculative_step: bool = opt(
        True, "with --offload-optimizer nvme under a pipeline: a stage whose backward has ended "
        "updates its read-ahead tiles while the other stages drain, kept when the clip does not "
        "bind and the step is not skipped (bit-identical either way; default: on there, never "
        "with --offload-delayed-update; --no- for A/B)", flag="offload_speculative_step",
        flag_default=None)

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

    granularity: str | None = opt(
        None, "full: keep only each layer's input and rerun the layer in backward (ZeRO-R); "
        "selective: rerun only the attention core (scores, softmax, dropout)",
        flag="recompute_granularity", choices=("full", "selective"))
    num_layers: int | None = None
    layers_per_checkpoint: int = 1
    partition_activations: bool = False
    cpu_checkpointing: bool = opt(
        False, "keep the checkpoints in host memory", alias="--checkpoint-in-cpu",
        ds="activation_checkpointing.cpu_checkpointing")
    contiguous_checkpointing: bool = opt(
        False, "store checkpoints in one preallocated buffer", alias="--contigious-checkpointing",
        ds="activation_checkpointing.contiguous_memory_optimization")

    @staticmethod
    def derived(f: Any) -> dict[str, Any]:
        """The fields of checked flat flags ``f`` no flag gives as it is
        (:class:`RecomputeFlags`): Megatron's method and layer count as the two layer
        fields; partitioning, which sequence parallelism makes moot."""
        return {
            "num_layers": f.recompute_num_layers if f.recompute_method == "block" else None,
            "layers_per_checkpoint": (f.recompute_num_layers or 1
                                      if f.recompute_method == "uniform" else 1),
            # With SP a block's input is already this rank's 1/TP of the sequence:
            # nothing replicated is left to partition (see docs/sequence-parallelism.md).
            "partition_activations": f.partition_activations and not f.sequence_parallel}


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


# --cp-comm-type: how attention crosses the CP split (hybrid.tensor_parallel.cp_attention
# runs each); --cp-layout: which tokens a CP rank holds (hybrid.tensor_parallel.context_parallel)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
CP_LAYOUTS = ("load_balanced", "striped")


@dataclass(frozen=True)
class ParallelConfig:
    """The process layout (:mod:`hybrid.parallel.layout`) and how the process groups are made."""

    world_size: int = 1
    tensor_model_parallel_size: int = opt(1, "TP degree: ranks splitting each layer")
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = opt(
        1, "PP degree: pipeline stages, each a consecutive slice of the layers (the outermost "
        "dimension of the layout)")
    sequence_parallel: bool = opt(
        False, "split norms, dropout and residuals along the sequence over TP (needs TP > 1)")
    context_parallel_size: int = opt(
        1, "CP degree: ranks splitting each sequence (attention across them, see --cp-comm-type)")
    expert_model_parallel_size: int = opt(
        1, "EP degree: ranks an MoE layer's experts are split over (tokens reach them by "
        "all-to-all; the expert layout in hybrid/parallel/layout.py)", at_least=1)
    expert_tensor_parallel_size: int = opt(
        1, "ETP degree: ranks each expert's hidden units are split over (ETP innermost in "
        "the expert layout, then EP; Megatron's default is the TP size, hybrid's 1, with the "
        "same numbers)", at_least=1)
    cp_comm_type: str = opt(
        "p2p", "how attention crosses the CP split: p2p (ring), all_gather (K/V once per layer) "
        "or a2a (Ulysses: heads split instead)", choices=CP_COMM_TYPES,
        refused={"a2a+p2p": "Megatron's hierarchical CP is not "
                            "in hybrid"})
    cp_layout: str = opt(
        "load_balanced", "which tokens a CP rank holds: load_balanced (chunks r and 2C-1-r of 2C) "
        "or striped (token i on rank i mod C)", choices=CP_LAYOUTS)
    backend: str | None = opt(
        None, "gloo or nccl (default: nccl with a GPU)", flag="distributed_backend",
        choices=("gloo", "nccl"))
    timeout_minutes: float = opt(
        10.0, "timeout of every collective", flag="distributed_timeout_minutes")


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

    size: int = route("pipeline_model_parallel_size", 1)
    virtual_size: int = opt(
        1, "model chunks per pipeline rank (interleaved 1F1B when > 1; default 1, or what "
        "--num-layers-per-virtual-pipeline-stage or --pipeline-model-parallel-layout imply)",
        flag="virtual_pipeline_model_parallel_size", flag_default=None,
        alias="--num-virtual-stages-per-pipeline-rank")
    schedule: str = opt(
        "1f1b",
        "the micro-batch schedule over the stages: "
+ ", ".join(f"{name} ({g.about})"
            for name, g in SCHEDULES.items()), flag="pipeline_schedule", choices=PIPELINE_SCHEDULES)
    split: StageSplit | None = None
    reshard_after_micro_batch: bool = opt(
        False, "at --zero-stage 3, free each stage's gathered parameters after every "
        "micro-batch's forward and backward (2m all-gathers per unit a step, m micro-batches) "
        "instead of holding them from their first use to the stage's last backward (one): less "
        "memory, more traffic", flag="pipeline_reshard_after_micro_batch")


@dataclass(frozen=True)
class LRScheduleConfig:
    """The learning-rate schedule, Megatron's ``--lr*`` flags (AdamW's own
    hyperparameters are in :class:`AdamWConfig`).

    ``unit``: "iterations" or "samples" -- what ``warmup`` and ``decay`` count,
    and what :func:`hybrid.config.lr_schedule.scheduled_lr` is stepped by.
    Warmup rises from ``warmup_init`` to ``lr``, linearly or (``warmup_style``
    "log", DeepSpeed's default) as log(step) / log(warmup). ``steps``: "megatron"
    (optimizer step k runs at the schedule's position after k - 1 steps, as Megatron-LM's
    scheduler does) or "deepspeed" (DeepSpeed's
    schedulers' own counting and formulas: :func:`hybrid.config.lr_schedule.deepspeed_lr`).
    """

    lr: float = opt(1e-3, "peak learning rate", above=0)
    min_lr: float = opt(0.0, "learning rate at the end of decay", at_least=0)
    decay_style: str = opt(
        "constant", "constant, linear or cosine", flag="lr_decay_style",
        choices=("constant", "linear", "cosine"))
    unit: str = "iterations"
    warmup: int = 0
    decay: int = 200
    warmup_init: float = opt(
        0.0, "the learning rate warmup starts from", flag="lr_warmup_init", at_least=0)
    warmup_style: str = opt(
        "linear", "warmup shape: linear, or log (DeepSpeed's WarmupLR default: log(step) / "
        "log(warmup))", flag="lr_warmup_style", choices=("linear", "log"))
    steps: str = opt(
        "megatron", "how a step's rate is counted: megatron (step k runs at the schedule's "
        "position after k - 1 steps, as Megatron-LM's scheduler), or deepspeed (DeepSpeed's "
        "schedulers: the warmup start for steps 1 and 2, DeepSpeed's formulas after; set by a "
        "ds_config scheduler block)", flag="lr_schedule_steps",
        choices=("megatron", "deepspeed"))

    @staticmethod
    def derived(f: Any) -> dict[str, Any]:
        """``unit``, ``warmup`` and ``decay`` of checked flat flags ``f``
        (:class:`LRLengthFlags`): in samples with ``--train-samples``, else iterations;
        ``--lr-warmup-fraction`` of the decay wins over a warmup length."""
        samples = f.train_samples is not None
        decay = f.lr_decay_samples if samples else f.lr_decay_iters
        warmup = f.lr_warmup_samples if samples else f.lr_warmup_iters
        assert decay is not None  # checks.check_schedule filled it (the train length by default)
        if f.lr_warmup_fraction is not None:
            warmup = int(f.lr_warmup_fraction * decay)
        return {"unit": "samples" if samples else "iterations", "warmup": warmup,
                "decay": decay}


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
class LoopConfig:
    """What the training loop (:mod:`hybrid.train.loop`) runs: its batches, how long
    it goes, when it exits early, when it evaluates.

    Exactly one of ``train_iters`` and ``train_samples`` is set. ``rampup``:
    (start, increment, samples) -- Megatron's ``--rampup-batch-size``; the
    global batch is ``start + k * increment`` after ``k`` ramp intervals of
    ``samples / ((global - start) / increment)`` samples each.
    """

    micro_batch_size: int = opt(8, "samples per rank per forward/backward", at_least=1)
    global_batch_size: int = opt(
        8, "samples per step (default micro x DP)", flag_default=None, at_least=1)
    rampup: tuple[int, int, int] | None = opt(
        None, "START INCR SAMPLES: the global batch grows from START by INCR over the first "
        "SAMPLES samples, to --global-batch-size", flag="rampup_batch_size")
    train_iters: int | None = opt(
        200, "optimizer steps (default 200 unless --train-samples)", flag_default=None, at_least=1)
    train_samples: int | None = opt(
        None, "train on this many samples instead of --train-iters (schedules count samples)",
        at_least=1)
    exit_interval: int | None = opt(
        None, "save (with --save) and exit at the first iteration divisible by N", at_least=1)
    exit_duration_in_mins: float | None = opt(
        None, "save (with --save) and exit once the run has taken this long", above=0)
    exit_signal_handler: bool = opt(
        False, "on SIGTERM (scancel, a preemption) save (with --save) and exit after the "
        "iteration in progress")
    exit_on_nan_iterations: int = opt(
        10, "stop with an error after N consecutive skipped steps with non-finite gradients",
        at_least=1)
    eval_interval: int = opt(1000, "validate every N iterations", at_least=1)
    eval_iters: int = opt(10, "iterations per validation", at_least=0)


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

    seq_length: int = route("seq_length", 128)
    seed: int = opt(1234, "fixes init, data order and dropout", at_least=0, at_most=2**32 - 1)
    data_path: tuple[str, ...] | None = opt(
        None, "text file, or [weight] prefix ... of preprocessed data (default: built-in corpus)")
    split: str = opt("949,50,1", "train,valid,test proportions")
    train_data_path: tuple[str, ...] | None = opt(
        None, "[weight] prefix ... of the train split, used whole (instead of --data-path + "
        "--split)")
    valid_data_path: tuple[str, ...] | None = opt(None, "[weight] prefix ... of the valid split")
    test_data_path: tuple[str, ...] | None = opt(None, "[weight] prefix ... of the test split")
    mock_data: bool = opt(False, "train on synthetic tokens from --seed, no files (benchmarks)")
    eod_mask_loss: bool = opt(
        False, "leave the predictions made at end-of-document tokens out of the loss")
    cache_path: str | None = opt(
        None, "where sample indices are cached (default: next to the data), and the parsed "
        "built-in corpus (default: ~/.cache/hybrid)", flag="data_cache_path")
    corpus_cache: str | None = None


# --tokenizer-type: Megatron's names, and hybrid's older ones as aliases.
TOKENIZER_TYPES = {
    "byte": "byte",
    "GPT2BPETokenizer": "GPT2BPETokenizer", "gpt2bpe": "GPT2BPETokenizer",
    "HuggingFaceTokenizer": "HuggingFaceTokenizer", "hf": "HuggingFaceTokenizer",
    "NullTokenizer": "NullTokenizer", "null": "NullTokenizer",
    # Megatron's SentencePiece tokenizers, read from the model's Hugging Face tokenizer
    # (tokenizer.json or its directory): the same vocabulary and end-of-document id
    "Llama2Tokenizer": "HuggingFaceTokenizer",
}


def tokenizer_kind(name: str | None) -> str | None:
    """The canonical name of a ``--tokenizer-type`` value, or None if unknown."""
    return TOKENIZER_TYPES.get(name or "byte")


@dataclass(frozen=True)
class TokenizerFlags:
    """The tokenizer and its files (:meth:`hybrid.config.sections.TokenizerConfig.from_flags`)."""

    tokenizer_type: str | None = opt(
        None, "byte, GPT2BPETokenizer (--vocab-file/--merge-file), HuggingFaceTokenizer "
        "(--tokenizer-model), Llama2Tokenizer (--tokenizer-model: the model's tokenizer.json) "
        "or NullTokenizer (--vocab-size); older names gpt2bpe, hf. Default: "
        "GPT2BPETokenizer when both GPT-2 files are given, else byte", choices=TOKENIZER_TYPES,
        metavar="TYPE")
    vocab_file: str | None = opt(None, "GPT-2 vocab.json")
    merge_file: str | None = opt(None, "GPT-2 merges.txt")
    tokenizer_file: str | None = opt(None, "a tokenizers-library tokenizer.json")
    tokenizer_model: str | None = opt(
        None, "HuggingFaceTokenizer: a tokenizer directory or tokenizer.json")
    vocab_size: int | None = opt(None, "NullTokenizer: token ids 0..N-1 (eod is N)", at_least=1)


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
    def from_flags(cls, f: Any) -> TokenizerConfig:
        """The section from Megatron's tokenizer flags (:class:`TokenizerFlags`): the flat
        flags, or a dict of some of them (a tool's own command line; a missing one is
        unset). Any spelling of the type; ``--tokenizer-file`` is the older name of
        ``--tokenizer-model``."""
        def get(name: str) -> Any:
            return f.get(name) if isinstance(f, dict) else getattr(f, name)
        given, model, older = get("tokenizer_type"), get("tokenizer_model"), get("tokenizer_file")
        kind = tokenizer_kind(given)
        if kind is None:
            raise ConfigError(f"--tokenizer-type {given!r}: unknown (one of "
                              f"{', '.join(TOKENIZER_TYPES)})")
        return cls(type=kind, vocab_file=get("vocab_file"), merge_file=get("merge_file"),
                   model=model or older,
                   model_flag="--tokenizer-model" if model or not older
                   else "--tokenizer-file", vocab_size=get("vocab_size"))


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

    save: str | None = opt(None, "save checkpoints in this directory")
    load: str | None = opt(None, "resume from the newest checkpoint in this directory")
    save_interval: int | None = opt(None, "save every N iterations (and at the end)", at_least=1)
    keep_last: int | None = opt(
        None, "after a save, keep only the newest N checkpoints", at_least=1)
    no_save_optim: bool = opt(
        False, "save the fp32 model weights only, no optimizer state (about 1/3 of the bytes); "
        "resuming one needs --no-load-optim or --finetune")
    no_load_optim: bool = opt(
        False, "load weights, iteration and data position from --load but start the optimizer "
        "fresh (zero Adam moments)")
    no_load_rng: bool = opt(False, "keep the RNG seeded from --seed, not the checkpoint's")
    finetune: bool = opt(
        False, "load the weights only: iteration 0, data from the start, fresh optimizer, RNG "
        "from --seed; --save starts a new series (a restart resumes that series)")
    ckpt_step: int | None = opt(
        None, "load the checkpoint of this iteration from --load instead of the newest one",
        at_least=0)
    overwrite_save: bool = opt(
        False, "start a new run in a --save directory that holds another run's checkpoints, "
        "deleting them (without it such a run is refused)")
    load_format: str = opt(
        "auto", "the format of --load's checkpoint: auto (hybrid's own, else the peer format "
        "its files show), or one of them by name; a peer's checkpoint is imported into --save "
        "as a hybrid one, then loaded (hybrid/checkpoint/peers)",
        choices=("auto", "hybrid", "deepspeed", "megatron", "dcp"))
    async_save: bool = opt(
        False, "write checkpoints in the background: the step copies its values to host "
        "memory and goes on; the checkpoint is published once every rank's files are "
        "written (hybrid/checkpoint/async_save.py)", ds="checkpoint.writer.decoupled")


@dataclass(frozen=True)
class LoggingConfig:
    """What is logged where, and how often (rank 0 writes)."""

    log_interval: int = opt(10, "iterations per console line", at_least=1, ds="steps_per_print")
    log_json: str | None = opt(None, "write one JSON object per logged iteration here")
    tensorboard_dir: str | None = opt(None, "write TensorBoard scalars here")
    log_throughput: bool = opt(
        False, "add TFLOP/s per rank to the console line (always in --log-json and TensorBoard)")
    timing_breakdown: bool = opt(
        False, "forward, backward and optimizer seconds per step on every log line (on a GPU: a "
        "device sync at each phase boundary)", ds="wall_clock_breakdown")


@dataclass(frozen=True)
class DiagnosticsConfig:
    """What the training loop's diagnostics need (:mod:`hybrid.diagnostics`).

    ``collective_dump_dir``: where each live rank writes its flight recorder
    ring when a collective fails (None: nowhere). ``check_collectives``:
    compare every collective's fingerprint across its group first.
    ``check_replicas_interval``: every N iterations compare the checksums of
    replicated parameters over TP and DP (0: never).
    """

    collective_dump_dir: str | None = opt(
        None, "when a collective fails, every live rank writes its last collectives here as JSON "
        "(collectives_rank00003.json)")
    check_collectives: bool = opt(
        False, "debug: before each collective the ranks of its group compare op, shape, dtype and "
        "sequence number (one small all-gather); a mismatch stops the job naming both calls")
    check_replicas_interval: int = opt(
        0, "every N iterations check that parameters replicated over TP and DP are bit-identical; "
        "a divergence stops the job naming the parameter and ranks (0: off)", at_least=0)


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

