"""Every ds_config.json key hybrid knows, what it does with each, and the type of its value.

One table, :data:`KEYS`, from a dotted key path to a rule:

* ``Flag(field, kind, convert)``: the value (converted) sets that :class:`Flags`
  field, as the flag of the same meaning would; ``"auto"`` leaves the field to
  the command line (or its default). These rules are not written here: a flag
  declares the keys that set it on its field (``opt(ds=...)``, a :class:`DsKey`
  where the value has its own kind or is converted; the note of
  :mod:`hybrid.config.options`), and :func:`_flag_rules` makes one rule per key. The
  key thus reaches the section field that declares the flag: ``aio.use_gds`` ->
  ``offload_gds`` -> ``offload.gds``; the table names no field or section itself.
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
        # the rules KEYS holds are made from the fields' ds= (_flag_rules), so each names
        # a field by construction; a Flag made by hand still fails here on a missing one
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


def _flag_rules() -> dict[str, Flag]:
    """A :class:`Flag` rule for every ds_config key a :class:`Flags` field declares
    (``opt(ds=...)``), in the fields' order."""
    rules: dict[str, Flag] = {}
    for f in dataclasses.fields(Flags):
        for key in f.metadata.get("ds", ()):
            if key.path in rules:  # one key, one field: a second would silently win
                raise TypeError(f"ds_config {key.path}: Flags.{rules[key.path].field} and "
                                f"Flags.{f.name} both declare it")
            rules[key.path] = Flag(f.name, key.kind, key.convert)
    return rules


_ONE_UNIT = "hybrid prefetches one unit ahead (two from NVMe), sized by the model's units"
_NO_QUANT = "hybrid communicates in the training dtype: drop it"
_HOST_STEP = "hybrid's host step works per unit, the nvme tier per --offload-buffer-size tile"
_AIO = ("hybrid's swap I/O is its own thread pool (pread/pwrite, O_DIRECT on aligned "
        "blocks; python -m benchmarks.bench_aio measures it)")
_CKPT = "hybrid's checkpoints are atomic, full-precision and reshardable as they are"
_SYNC = "hybrid orders checkpoint boundaries on the stream; no device sync is needed"

# The keys no flag declares; a key that sets a flag is on the flag's field (ds=), and
# _flag_rules adds its Flag rule to KEYS below.
_RULES: dict[str, object] = {
    # batch sizes, read together (train = micro x accumulation x DP)
    "train_batch_size": Custom(INT), "train_micro_batch_size_per_gpu": Custom(INT),
    "gradient_accumulation_steps": Custom(INT),
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
    # (checkpoint.writer.decoupled is --async-save's key)
    "checkpoint.tag_validation": Hint("hybrid agrees on a save's tag over the ranks and "
                                      "refuses one that differs", STRING),
    "checkpoint.checkpoint_serialization": Hint(_CKPT),
    "checkpoint.load_universal": Hint("hybrid tells a checkpoint's format (its own, "
                                      "DeepSpeed's ZeRO or universal one) by its files"),
    "checkpoint.use_node_local_storage": Hint(_CKPT),
    "checkpoint.parallel_write": Hint(_CKPT, OBJECT),
    "checkpoint.writer.type": Hint(_CKPT, STRING),
    "checkpoint.writer.io_buffer_size": Hint(_CKPT, NUMBER),
    "checkpoint.writer.io_buffer_double": Hint(_CKPT),
    "checkpoint.writer.show_statistics": Hint(_CKPT),
    "checkpoint.writer.data_parallel": Hint(_CKPT, STRING.or_null()),
    "checkpoint.writer.io_multiplier": Hint(_CKPT, NUMBER),
    # precision
    "fp16.consecutive_hysteresis": Refuse("hybrid's hysteresis counts overflows since the "
                                          "last scale change, as Megatron's does"),
    "fp16.auto_cast": Refuse("hybrid keeps the model in fp16 itself: drop it"),
    "fp16.fp16_master_weights_and_grads": Refuse("hybrid keeps fp32 master weights"),
    "bf16.bf16_master_weights_and_grads": Refuse(
        "hybrid keeps fp32 master weights beside the bf16 parameters and reduces gradients "
        "in bf16 (or fp32: --accumulate-allreduce-grads-in-fp32): drop it"),
    "bf16.bf16_optimizer_states": Refuse("hybrid keeps Adam's moments in fp32: drop it"),
    "torch_autocast": Refuse("hybrid trains in the dtype of the bf16 or fp16 block (the "
                             "parameters themselves in it, fp32 masters beside them), not "
                             "under torch.autocast over fp32 parameters: enable the bf16 "
                             "block instead", OBJECT),
    "bf16.immediate_grad_update": Hint("hybrid accumulates into its flat gradient buffer"),
    "bf16.check_grad_overflow": Hint("hybrid checks every step's gradient norm for "
                                     "non-finite values"),
    # ZeRO
    "zero_optimization.contiguous_gradients": Hint("hybrid's gradients always live in flat "
                                                   "contiguous buffers", same=(True,)),
    "zero_optimization.reduce_scatter": Hint("hybrid reduce-scatters gradients whenever the "
                                             "stage shards them", same=(True,)),
    "zero_optimization.allgather_partitions": Hint("hybrid all-gathers each bucket at once",
                                                   same=(True,)),
    "zero_optimization.stage3_prefetch_bucket_size": Hint(_ONE_UNIT, INT),
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
    "zero_optimization.legacy_stage1": Hint("hybrid has one stage 1"),
    "zero_optimization.memory_efficient_linear": Hint("hybrid's linear layers save what "
                                                      "backward needs only"),
    "zero_optimization.use_multi_rank_bucket_allreduce": Hint("hybrid reduces per bucket"),
    "zero_optimization.zero_quantized_weights": Refuse(_NO_QUANT),
    "zero_optimization.zero_quantized_nontrainable_weights": Refuse(_NO_QUANT),
    "zero_optimization.zero_quantized_gradients": Refuse(_NO_QUANT),
    "zero_optimization.zero_hpz_partition_size": Refuse(
        "hybrid has no hierarchical (hpZ) partitions: parameters shard over all of DP",
        INT, ok=(1,)),
    "zero_optimization.mics_shard_size": Refuse(
        "hybrid has no MiCS sub-groups: parameters shard over all of DP", INT, ok=(-1, 0)),
    "zero_optimization.mics_hierarchical_params_gather": Refuse("hybrid has no MiCS"),
    "zero_optimization.offload_optimizer.fast_init": Hint("hybrid fills the swap file in "
                                                          "one pass at start"),
    "zero_optimization.offload_optimizer.pipeline_read": Hint("hybrid always pipelines the "
                                                              "tiles"),
    "zero_optimization.offload_optimizer.pipeline_write": Hint("hybrid always pipelines the "
                                                               "tiles"),
    "zero_optimization.offload_optimizer.pipeline": Hint("hybrid always pipelines the tiles"),
    # DeepSpeed's partial offload and SuperOffload (its .sh configs in DeepSpeedExamples'
    # training/DeepSpeed-SuperOffload): schedules of the same arithmetic, so hybrid's own
    # schedule gives the same numbers; the line says what differs
    "zero_optimization.offload_optimizer.ratio": Hint(
        "hybrid offloads the whole optimizer state and steps it on the host (more host "
        "memory, less device memory than the ratio asks; the same numbers)", NUMBER,
        same=(1.0,)),
    "zero_optimization.offload_optimizer.super_offload": Hint(
        "hybrid's host step starts once backward has ended and the global norm is known "
        "(no speculative step to roll back); the same numbers"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": Hint(
        "hybrid's host Adam runs on torch's intra-op threads (torch.set_num_threads, "
        "OMP_NUM_THREADS at launch)", NUMBER),
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
    "activation_checkpointing.number_checkpoints": Hint("hybrid sizes the contiguous "
                                                        "buffer from the model's layers", INT),
    "activation_checkpointing.synchronize_checkpoint_boundary": Hint(_SYNC),
    "activation_checkpointing.profile": Hint("hybrid logs activation and checkpoint bytes "
                                             "every log line"),
    "tensorboard": Custom(OBJECT, {"enabled": BOOL, "output_path": STRING.or_null(),
                                   "job_name": STRING.or_null()}),
}

_FLAG_RULES = _flag_rules()
if set(_RULES) & set(_FLAG_RULES):  # a key ruled both above and on a field
    raise TypeError(f"ds_config keys both in _RULES and on a Flags field: "
                    f"{sorted(set(_RULES) & set(_FLAG_RULES))}")
# every key: the rules above, and a Flag rule for each key a field declares (ds=)
KEYS: dict[str, object] = {**_RULES, **_FLAG_RULES}

# Sections walked key by key (each must be an object; a key under them that KEYS lacks
# is unknown).
SECTIONS = ("fp16", "bf16", "bfloat16", "zero_optimization", "zero_optimization.offload_optimizer",
            "zero_optimization.offload_param", "aio", "activation_checkpointing", "data_types",
            "checkpoint", "checkpoint.writer")
