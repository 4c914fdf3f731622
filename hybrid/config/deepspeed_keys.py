"""Every ds_config.json key hybrid knows, and what it does with each.

One table, :data:`KEYS`, from a dotted key path to a rule:

* ``Flag(field, convert)``: the value (converted) sets that :class:`Flags` field,
  as the flag of the same meaning would; ``"auto"`` leaves the field to the
  command line (or its default).
* ``Hint(why, same)``: a tuning knob of DeepSpeed's own machinery that hybrid
  does not need; accepted with one warning naming it and why (none for the
  values in ``same``, which ask for what hybrid does anyway).
* ``Refuse(why, ok)``: a feature hybrid does not have; any value outside ``ok``
  (the values that switch it off) is one error naming the key and what to use.
* ``Custom``: keys read together (the batch sizes, the optimizer and scheduler
  blocks, TensorBoard's), handled in :mod:`hybrid.config.deepspeed`.

A key in none of these is an error: nothing in the file is silently dropped.
Sections (``zero_optimization``, ``fp16``, ...) are walked key by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Flag:
    field: str
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Hint:
    why: str
    same: tuple = (False, None)  # values that ask for what hybrid does anyway: no warning


@dataclass(frozen=True)
class Refuse:
    why: str
    ok: tuple = (False, None, 0)


@dataclass(frozen=True)
class Custom:
    """Read by deepspeed.py's handler of the same section."""


def _device(v):
    return None if v in (None, "none") else v


_ONE_UNIT = "hybrid prefetches one unit ahead (two from NVMe), sized by the model's units"
_NO_QUANT = "hybrid communicates in the training dtype: drop it"
_HOST_STEP = "hybrid's host step works per unit, the nvme tier per --offload-buffer-size tile"
_AIO = ("hybrid's swap I/O is its own thread pool (pread/pwrite, O_DIRECT on aligned "
        "blocks; scripts/bench_aio.py measures it)")
_CKPT = "hybrid's checkpoints are atomic, full-precision and reshardable as they are"
_SYNC = "hybrid orders checkpoint boundaries on the stream; no device sync is needed"

KEYS: dict[str, object] = {
    # batch sizes, read together (train = micro x accumulation x DP)
    "train_batch_size": Custom(), "train_micro_batch_size_per_gpu": Custom(),
    "gradient_accumulation_steps": Custom(),
    "gradient_clipping": Flag("clip_grad", float),
    "steps_per_print": Flag("log_interval", int),
    "wall_clock_breakdown": Flag("timing_breakdown", bool),
    "memory_breakdown": Hint("hybrid logs peak memory and model-state bytes every log line"),
    "dump_state": Hint("hybrid logs its configuration at start"),
    "prescale_gradients": Refuse("hybrid averages gradients in one reduction: drop it"),
    "gradient_predivide_factor": Refuse("hybrid averages gradients in one reduction: "
                                        "drop it", ok=(1, 1.0, None)),
    "sparse_gradients": Refuse("hybrid reduces dense gradients"),
    "zero_allow_untested_optimizer": Hint("hybrid runs its own AdamW"),
    "zero_force_ds_cpu_optimizer": Hint("hybrid's host step is its own fused C++ AdamW"),
    "communication_data_type": Refuse("hybrid reduces in the gradient dtype: use "
                                      "--accumulate-allreduce-grads-in-fp32", ok=(None,)),
    "seq_parallel_communication_data_type": Hint("hybrid's SP communicates in the "
                                                 "training dtype"),
    "dataloader_drop_last": Hint("hybrid's loader always yields whole global batches"),
    "disable_allgather": Refuse("hybrid needs its all-gathers"),
    "amp": Refuse("use the fp16 or bf16 block (or --fp16 / --bf16)"),
    "sparse_attention": Refuse("hybrid's attention is dense (SDPA, flash or fused)"),
    "pipeline": Refuse("hybrid has no pipeline parallelism: shard with TP and ZeRO-3",
                       ok=(None,)),
    "compression_training": Refuse("hybrid has no compression training", ok=(None,)),
    "quantize_training": Refuse("hybrid has no quantized training", ok=(None,)),
    "data_efficiency": Refuse("hybrid has no curriculum or data routing", ok=(None,)),
    "curriculum_learning": Refuse("hybrid has no curriculum learning", ok=(None,)),
    "elasticity": Refuse("hybrid's layout is fixed per run: resume at another DP size from "
                         "its reshardable checkpoint", ok=(None,)),
    "autotuning": Refuse("hybrid has no autotuner: scripts/estimate_memory.py recommends "
                         "a stage and offload", ok=(None,)),
    "flops_profiler": Hint("hybrid logs TFLOP/s per rank (--log-throughput on the console)"),
    "comms_logger": Hint("hybrid counts bytes per collective kind in comm_bytes on every "
                         "log line"),
    "csv_monitor": Refuse("hybrid writes --log-json and TensorBoard", ok=(None,)),
    "wandb": Refuse("hybrid writes --log-json and TensorBoard", ok=(None,)),
    "nebula": Refuse("hybrid saves with --save", ok=(None,)),
    "compile": Custom(),
    "checkpoint": Hint(_CKPT),
    "data_types.grad_accum_dtype": Flag(
        "accumulate_allreduce_grads_in_fp32", lambda v: {"fp32": True, "bf16": False,
                                                         "fp16": False}[v]),
    # precision
    "fp16.enabled": Flag("fp16", bool),
    "fp16.loss_scale": Flag("loss_scale", lambda v: None if float(v) == 0 else float(v)),
    "fp16.initial_scale_power": Flag("initial_loss_scale", lambda v: float(2 ** int(v))),
    "fp16.loss_scale_window": Flag("loss_scale_window", int),
    "fp16.hysteresis": Flag("hysteresis", int),
    "fp16.min_loss_scale": Flag("min_loss_scale", float),
    "fp16.consecutive_hysteresis": Refuse("hybrid's hysteresis counts overflows since the "
                                          "last scale change, as Megatron's does"),
    "fp16.auto_cast": Refuse("hybrid keeps the model in fp16 itself: drop it"),
    "fp16.fp16_master_weights_and_grads": Refuse("hybrid keeps fp32 master weights"),
    "bf16.enabled": Flag("bf16", bool),
    "bf16.immediate_grad_update": Hint("hybrid accumulates into its flat gradient buffer"),
    "bf16.check_grad_overflow": Hint("hybrid checks every step's gradient norm for "
                                     "non-finite values"),
    # ZeRO
    "zero_optimization.stage": Flag("zero_stage", int),
    "zero_optimization.overlap_comm": Flag("overlap_comm", bool),
    "zero_optimization.contiguous_gradients": Hint("hybrid's gradients always live in flat "
                                                   "contiguous buffers",
        same=(True,)),
    "zero_optimization.reduce_scatter": Hint("hybrid reduce-scatters gradients whenever the "
                                             "stage shards them",
        same=(True,)),
    "zero_optimization.reduce_bucket_size": Flag("reduce_bucket_size", int),
    "zero_optimization.allgather_partitions": Hint("hybrid all-gathers each bucket at once",
        same=(True,)),
    "zero_optimization.allgather_bucket_size": Flag("allgather_bucket_size", int),
    "zero_optimization.stage3_prefetch_bucket_size": Hint(_ONE_UNIT),
    "zero_optimization.stage3_param_persistence_threshold": Flag(
        "zero_param_persistence_threshold", int),
    "zero_optimization.stage3_model_persistence_threshold": Hint(_ONE_UNIT),
    "zero_optimization.stage3_max_live_parameters": Hint(_ONE_UNIT),
    "zero_optimization.stage3_max_reuse_distance": Hint(_ONE_UNIT),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Hint(_CKPT),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": Hint(_CKPT),
    "zero_optimization.sub_group_size": Hint(_HOST_STEP),
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
    "zero_optimization.cpu_offload": Flag("offload_optimizer",
                                          lambda v: "cpu" if v else None),
    "zero_optimization.cpu_offload_use_pin_memory": Flag("offload_pin_memory", bool),
    "zero_optimization.cpu_offload_params": Flag("offload_param",
                                                 lambda v: "cpu" if v else None),
    "zero_optimization.zero_quantized_weights": Refuse(_NO_QUANT),
    "zero_optimization.zero_quantized_nontrainable_weights": Refuse(_NO_QUANT),
    "zero_optimization.zero_quantized_gradients": Refuse(_NO_QUANT),
    "zero_optimization.zero_hpz_partition_size": Refuse(
        "hybrid has no hierarchical (hpZ) partitions: parameters shard over all of DP",
        ok=(1, None)),
    "zero_optimization.mics_shard_size": Refuse(
        "hybrid has no MiCS sub-groups: parameters shard over all of DP", ok=(-1, 0, None)),
    "zero_optimization.mics_hierarchical_params_gather": Refuse("hybrid has no MiCS"),
    "zero_optimization.offload_optimizer.device": Flag("offload_optimizer", _device),
    "zero_optimization.offload_optimizer.nvme_path": Flag("offload_nvme_path", str),
    "zero_optimization.offload_optimizer.pin_memory": Flag("offload_pin_memory", bool),
    "zero_optimization.offload_optimizer.buffer_count": Flag("offload_buffer_count", int),
    "zero_optimization.offload_optimizer.fast_init": Hint("hybrid fills the swap file in "
                                                          "one pass at start"),
    "zero_optimization.offload_optimizer.pipeline_read": Hint("hybrid always pipelines the "
                                                              "tiles"),
    "zero_optimization.offload_optimizer.pipeline_write": Hint("hybrid always pipelines the "
                                                               "tiles"),
    "zero_optimization.offload_optimizer.pipeline": Hint("hybrid always pipelines the tiles"),
    "zero_optimization.offload_optimizer.ratio": Refuse(
        "hybrid offloads the whole optimizer state", ok=(1, 1.0, None)),
    "zero_optimization.offload_param.device": Flag("offload_param", _device),
    "zero_optimization.offload_param.nvme_path": Flag("offload_nvme_path", str),
    "zero_optimization.offload_param.pin_memory": Flag("offload_pin_memory", bool),
    "zero_optimization.offload_param.buffer_count": Hint(
        "hybrid reads a unit's shard whole, two units ahead"),
    "zero_optimization.offload_param.buffer_size": Hint(
        "hybrid reads a unit's shard whole, two units ahead"),
    "zero_optimization.offload_param.max_in_cpu": Hint(
        "hybrid keeps in host memory only the shards being read"),
    # swap I/O
    "aio.block_size": Hint(_AIO), "aio.queue_depth": Hint(_AIO), "aio.thread_count": Hint(_AIO),
    "aio.single_submit": Hint(_AIO), "aio.overlap_events": Hint(_AIO),
    "aio.intra_op_parallelism": Hint(_AIO),
    "aio.use_gds": Flag("offload_gds", bool),
    # optimizer and scheduler blocks (deepspeed.py reads them whole)
    "optimizer": Custom(), "scheduler": Custom(),
    # ZeRO-R
    "activation_checkpointing.partition_activations": Flag("partition_activations", bool),
    "activation_checkpointing.cpu_checkpointing": Flag("cpu_checkpointing", bool),
    "activation_checkpointing.contiguous_memory_optimization": Flag(
        "contiguous_checkpointing", bool),
    "activation_checkpointing.number_checkpoints": Hint("hybrid sizes the contiguous "
                                                        "buffer from the model's layers"),
    "activation_checkpointing.synchronize_checkpoint_boundary": Hint(_SYNC),
    "activation_checkpointing.profile": Hint("hybrid logs activation and checkpoint bytes "
                                             "every log line"),
    "tensorboard": Custom(),
}

# Sections walked key by key (a key under them that KEYS lacks is unknown).
SECTIONS = ("fp16", "bf16", "bfloat16", "zero_optimization", "zero_optimization.offload_optimizer",
            "zero_optimization.offload_param", "aio", "activation_checkpointing", "data_types")
