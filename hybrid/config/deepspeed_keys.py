"""Every ds_config.json key hybrid knows, what it does with each, and the type of its value.

One table, :data:`KEYS`, from a dotted key path to a rule:

* ``Flag(field, kind, convert)``: the value (converted) sets that :class:`Flags`
  field, as the flag of the same meaning would; ``"auto"`` leaves the field to
  the command line (or its default). The key thus reaches the section the flag
  names (``to=``, :mod:`hybrid.config.flags`): ``aio.use_gds`` -> ``offload_gds``
  -> ``offload.gds``; the table names no section itself.
* ``Hint(why, kind, same)``: a tuning knob of DeepSpeed's own machinery that
  hybrid does not need; accepted with one warning naming it and why (none for
  null, a section that is empty or not enabled, or the values in ``same``, which
  ask for what hybrid does anyway).
* ``Refuse(why, kind, ok)``: a feature hybrid does not have; a value that does
  not switch it off (null, a section that is empty or not enabled, or one of
  ``ok``) is one error naming the key and what to use.
* ``Custom(kind, fields)``: keys read together (the batch sizes, the optimizer and
  scheduler blocks, TensorBoard's), handled in :mod:`hybrid.config.deepspeed`;
  ``fields`` types the keys inside the block.

Every rule says the type its value must have (a :class:`~hybrid.config.kinds.Kind`;
a ``Flag`` without one takes its field's annotation), and
:mod:`hybrid.config.deepspeed` checks each value against it before the rule
reads it (:func:`kind_of`; the notes of :mod:`hybrid.config.kinds`).

A key in none of these is an error: nothing in the file is silently dropped.
Sections (``zero_optimization``, ``fp16``, ...) are objects, walked key by key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybrid.config.flags import Flags, field_type
from hybrid.config.kinds import BOOL, INT, NUMBER, OBJECT, PAIR, STRING, Kind, one_of


@dataclass(frozen=True)
class Flag:
    field: str
    kind: Kind | None = None  # None: the field's own type
    convert: Callable[[Any], Any] | None = None  # the checked value -> the field's value

    def __post_init__(self):
        # the key points at the flag's one definition: a renamed or removed flag fails
        # at import, not when a user's file first names the key
        if self.field not in _FIELDS:
            raise TypeError(f"Flag({self.field!r}): Flags has no field {self.field!r}")


@dataclass(frozen=True)
class Hint:
    why: str
    kind: Kind = BOOL
    same: tuple | None = None  # values that ask for what hybrid does anyway (see quiet)


@dataclass(frozen=True)
class Refuse:
    why: str
    kind: Kind = BOOL
    ok: tuple | None = None  # values that switch the feature off (see quiet)


@dataclass(frozen=True)
class Custom:
    """Read by deepspeed.py's handler of the same section; ``fields``: the kinds of the
    keys inside it, by their path below the section ("params.lr")."""

    kind: Kind = OBJECT
    fields: dict = field(default_factory=dict)


def kind_of(rule) -> Kind:
    """The kind a value of ``rule``'s key must have. A knob or a refused feature may
    also be null (not set)."""
    if isinstance(rule, Flag):
        return rule.kind if rule.kind is not None else _field_kind(rule.field)
    if isinstance(rule, (Hint, Refuse)):
        return rule.kind.or_null()
    return rule.kind


def quiet(rule: Hint | Refuse) -> tuple:
    """The values of a knob or a refused feature that ask for nothing, besides null and
    an empty or disabled section: its ``same`` or ``ok``; by default false for a switch."""
    given = rule.same if isinstance(rule, Hint) else rule.ok
    if given is not None:
        return given
    return (False,) if rule.kind.base == "bool" else ()


_FIELDS = {f.name: f for f in dataclasses.fields(Flags)}


def _field_kind(name: str) -> Kind:
    """The kind of Flags field ``name``, from its annotation (null too where it is
    ``... | None``)."""
    kind, many = field_type(_FIELDS[name])
    assert not many, name
    base = {bool: BOOL, int: INT, float: NUMBER, str: STRING}[kind]
    return base.or_null() if "None" in str(_FIELDS[name].type) else base


def _device(v):
    return None if v in (None, "none") else v


_DEVICE = one_of("none", "cpu", "nvme", None)

_ONE_UNIT = "hybrid prefetches one unit ahead (two from NVMe), sized by the model's units"
_NO_QUANT = "hybrid communicates in the training dtype: drop it"
_HOST_STEP = "hybrid's host step works per unit, the nvme tier per --offload-buffer-size tile"
_AIO = ("hybrid's swap I/O is its own thread pool (pread/pwrite, O_DIRECT on aligned "
        "blocks; python -m benchmarks.bench_aio measures it)")
_CKPT = "hybrid's checkpoints are atomic, full-precision and reshardable as they are"
_SYNC = "hybrid orders checkpoint boundaries on the stream; no device sync is needed"

KEYS: dict[str, object] = {
    # batch sizes, read together (train = micro x accumulation x DP)
    "train_batch_size": Custom(INT), "train_micro_batch_size_per_gpu": Custom(INT),
    "gradient_accumulation_steps": Custom(INT),
    "gradient_clipping": Flag("clip_grad"),
    "steps_per_print": Flag("log_interval"),
    "wall_clock_breakdown": Flag("timing_breakdown"),
    "memory_breakdown": Hint("hybrid logs peak memory and model-state bytes every log line"),
    "dump_state": Hint("hybrid logs its configuration at start"),
    "prescale_gradients": Refuse("hybrid averages gradients in one reduction: drop it"),
    "gradient_predivide_factor": Refuse("hybrid averages gradients in one reduction: "
                                        "drop it", NUMBER, ok=(1.0,)),
    "sparse_gradients": Refuse("hybrid reduces dense gradients"),
    "zero_allow_untested_optimizer": Hint("hybrid runs its own AdamW"),
    "zero_force_ds_cpu_optimizer": Hint("hybrid's host step is its own fused C++ AdamW"),
    "communication_data_type": Refuse("hybrid reduces in the gradient dtype: use "
                                      "--accumulate-allreduce-grads-in-fp32", STRING),
    "seq_parallel_communication_data_type": Hint("hybrid's SP communicates in the "
                                                 "training dtype", STRING),
    "dataloader_drop_last": Hint("hybrid's loader always yields whole global batches"),
    "disable_allgather": Refuse("hybrid needs its all-gathers"),
    "amp": Refuse("use the fp16 or bf16 block (or --fp16 / --bf16)", OBJECT),
    "sparse_attention": Refuse("hybrid's attention is dense (SDPA, flash or fused)", OBJECT),
    "pipeline": Refuse("hybrid takes a pipeline's settings as deepspeed.pipe.PipelineModule's "
                       "arguments (num_stages, partition_method, "
                       "activation_checkpoint_interval): remove the block", OBJECT),
    "compression_training": Refuse("hybrid has no compression training", OBJECT),
    "quantize_training": Refuse("hybrid has no quantized training", OBJECT),
    "data_efficiency": Refuse("hybrid has no curriculum or data routing", OBJECT),
    "curriculum_learning": Refuse("hybrid has no curriculum learning", OBJECT),
    "elasticity": Refuse("hybrid's layout is fixed per run: resume at another DP size from "
                         "its reshardable checkpoint", OBJECT),
    "autotuning": Refuse("hybrid has no autotuner: scripts/estimate_memory.py recommends "
                         "a stage and offload", OBJECT),
    "flops_profiler": Hint("hybrid logs TFLOP/s per rank (--log-throughput on the console)",
                           OBJECT),
    "comms_logger": Hint("hybrid counts bytes per collective kind in comm_bytes on every "
                         "log line", OBJECT),
    "csv_monitor": Refuse("hybrid writes --log-json and TensorBoard", OBJECT),
    "wandb": Refuse("hybrid writes --log-json and TensorBoard", OBJECT),
    "nebula": Refuse("hybrid saves with --save", OBJECT),
    "compile": Custom(OBJECT, {"enabled": BOOL}),
    "checkpoint": Hint(_CKPT, OBJECT),
    "data_types.grad_accum_dtype": Flag(
        "accumulate_allreduce_grads_in_fp32", one_of("fp32", "bf16", "fp16"),
        lambda v: v == "fp32"),
    # precision
    "fp16.enabled": Flag("fp16"),
    "fp16.loss_scale": Flag("loss_scale", NUMBER, lambda v: None if v == 0 else v),
    "fp16.initial_scale_power": Flag("initial_loss_scale", INT, lambda p: float(2 ** p)),
    "fp16.loss_scale_window": Flag("loss_scale_window"),
    "fp16.hysteresis": Flag("hysteresis"),
    "fp16.min_loss_scale": Flag("min_loss_scale"),
    "fp16.consecutive_hysteresis": Refuse("hybrid's hysteresis counts overflows since the "
                                          "last scale change, as Megatron's does"),
    "fp16.auto_cast": Refuse("hybrid keeps the model in fp16 itself: drop it"),
    "fp16.fp16_master_weights_and_grads": Refuse("hybrid keeps fp32 master weights"),
    "bf16.enabled": Flag("bf16"),
    "bf16.immediate_grad_update": Hint("hybrid accumulates into its flat gradient buffer"),
    "bf16.check_grad_overflow": Hint("hybrid checks every step's gradient norm for "
                                     "non-finite values"),
    # ZeRO
    "zero_optimization.stage": Flag("zero_stage"),
    "zero_optimization.overlap_comm": Flag("overlap_comm"),
    "zero_optimization.contiguous_gradients": Hint("hybrid's gradients always live in flat "
                                                   "contiguous buffers", same=(True,)),
    "zero_optimization.reduce_scatter": Hint("hybrid reduce-scatters gradients whenever the "
                                             "stage shards them", same=(True,)),
    "zero_optimization.reduce_bucket_size": Flag("reduce_bucket_size"),
    "zero_optimization.allgather_partitions": Hint("hybrid all-gathers each bucket at once",
                                                   same=(True,)),
    "zero_optimization.allgather_bucket_size": Flag("allgather_bucket_size"),
    "zero_optimization.stage3_prefetch_bucket_size": Hint(_ONE_UNIT, INT),
    "zero_optimization.stage3_param_persistence_threshold": Flag(
        "zero_param_persistence_threshold"),
    "zero_optimization.stage3_model_persistence_threshold": Hint(_ONE_UNIT, INT),
    "zero_optimization.stage3_max_live_parameters": Hint(_ONE_UNIT, INT),
    "zero_optimization.stage3_max_reuse_distance": Hint(_ONE_UNIT, INT),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Hint(_CKPT),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": Hint(_CKPT),
    "zero_optimization.sub_group_size": Hint(_HOST_STEP, INT),
    "zero_optimization.round_robin_gradients": Hint("hybrid's host step reads each unit's "
                                                    "gradient as its reduction ends"),
    "zero_optimization.elastic_checkpoint": Hint(_CKPT),
    "zero_optimization.load_from_fp32_weights": Hint("hybrid always loads the fp32 master"),
    "zero_optimization.ignore_unused_parameters": Hint("hybrid reduces every parameter's "
                                                       "gradient (zero when unused)"),
    "zero_optimization.legacy_stage1": Hint("hybrid has one stage 1"),
    "zero_optimization.memory_efficient_linear": Hint("hybrid's linear layers save what "
                                                      "backward needs only"),
    "zero_optimization.use_multi_rank_bucket_allreduce": Hint("hybrid reduces per bucket"),
    "zero_optimization.cpu_offload": Flag("offload_optimizer", BOOL,
                                          lambda on: "cpu" if on else None),
    "zero_optimization.cpu_offload_use_pin_memory": Flag("offload_pin_memory"),
    "zero_optimization.cpu_offload_params": Flag("offload_param", BOOL,
                                                 lambda on: "cpu" if on else None),
    "zero_optimization.zero_quantized_weights": Refuse(_NO_QUANT),
    "zero_optimization.zero_quantized_nontrainable_weights": Refuse(_NO_QUANT),
    "zero_optimization.zero_quantized_gradients": Refuse(_NO_QUANT),
    "zero_optimization.zero_hpz_partition_size": Refuse(
        "hybrid has no hierarchical (hpZ) partitions: parameters shard over all of DP",
        INT, ok=(1,)),
    "zero_optimization.mics_shard_size": Refuse(
        "hybrid has no MiCS sub-groups: parameters shard over all of DP", INT, ok=(-1, 0)),
    "zero_optimization.mics_hierarchical_params_gather": Refuse("hybrid has no MiCS"),
    "zero_optimization.offload_optimizer.device": Flag("offload_optimizer", _DEVICE, _device),
    "zero_optimization.offload_optimizer.nvme_path": Flag("offload_nvme_path"),
    "zero_optimization.offload_optimizer.pin_memory": Flag("offload_pin_memory"),
    "zero_optimization.offload_optimizer.buffer_count": Flag("offload_buffer_count"),
    "zero_optimization.offload_optimizer.fast_init": Hint("hybrid fills the swap file in "
                                                          "one pass at start"),
    "zero_optimization.offload_optimizer.pipeline_read": Hint("hybrid always pipelines the "
                                                              "tiles"),
    "zero_optimization.offload_optimizer.pipeline_write": Hint("hybrid always pipelines the "
                                                               "tiles"),
    "zero_optimization.offload_optimizer.pipeline": Hint("hybrid always pipelines the tiles"),
    "zero_optimization.offload_optimizer.ratio": Refuse(
        "hybrid offloads the whole optimizer state", NUMBER, ok=(1.0,)),
    "zero_optimization.offload_param.device": Flag("offload_param", _DEVICE, _device),
    "zero_optimization.offload_param.nvme_path": Flag("offload_nvme_path"),
    "zero_optimization.offload_param.pin_memory": Flag("offload_pin_memory"),
    "zero_optimization.offload_param.buffer_count": Hint(
        "hybrid reads a unit's shard whole, two units ahead", INT),
    "zero_optimization.offload_param.buffer_size": Hint(
        "hybrid reads a unit's shard whole, two units ahead", INT),
    "zero_optimization.offload_param.max_in_cpu": Hint(
        "hybrid keeps in host memory only the shards being read", INT),
    # swap I/O
    "aio.block_size": Hint(_AIO, INT), "aio.queue_depth": Hint(_AIO, INT),
    "aio.thread_count": Hint(_AIO, INT), "aio.single_submit": Hint(_AIO),
    "aio.overlap_events": Hint(_AIO), "aio.intra_op_parallelism": Hint(_AIO, INT),
    "aio.use_gds": Flag("offload_gds"),
    # optimizer and scheduler blocks (deepspeed.py reads them whole)
    "optimizer": Custom(OBJECT, {
        "type": STRING, "params": OBJECT, "params.lr": NUMBER, "params.betas": PAIR,
        "params.eps": NUMBER, "params.weight_decay": NUMBER, "params.adam_w_mode": BOOL,
        "params.bias_correction": BOOL, "params.amsgrad": BOOL, "params.torch_adam": BOOL}),
    "scheduler": Custom(OBJECT, {
        "type": STRING, "params": OBJECT, "params.warmup_min_lr": NUMBER,
        "params.warmup_max_lr": NUMBER, "params.warmup_num_steps": INT,
        "params.warmup_type": one_of("log", "linear"), "params.total_num_steps": INT,
        "params.warmup_min_ratio": NUMBER, "params.cos_min_ratio": NUMBER,
        "params.last_batch_iteration": INT}),
    # ZeRO-R
    "activation_checkpointing.partition_activations": Flag("partition_activations"),
    "activation_checkpointing.cpu_checkpointing": Flag("cpu_checkpointing"),
    "activation_checkpointing.contiguous_memory_optimization": Flag(
        "contiguous_checkpointing"),
    "activation_checkpointing.number_checkpoints": Hint("hybrid sizes the contiguous "
                                                        "buffer from the model's layers", INT),
    "activation_checkpointing.synchronize_checkpoint_boundary": Hint(_SYNC),
    "activation_checkpointing.profile": Hint("hybrid logs activation and checkpoint bytes "
                                             "every log line"),
    "tensorboard": Custom(OBJECT, {"enabled": BOOL, "output_path": STRING.or_null(),
                                   "job_name": STRING.or_null()}),
}

# Sections walked key by key (each must be an object; a key under them that KEYS lacks
# is unknown).
SECTIONS = ("fp16", "bf16", "bfloat16", "zero_optimization", "zero_optimization.offload_optimizer",
            "zero_optimization.offload_param", "aio", "activation_checkpointing", "data_types")
