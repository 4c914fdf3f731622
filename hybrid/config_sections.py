"""The small, frozen config sections each component takes (never the whole run config).

:class:`hybrid.config.TrainConfig` holds the flags and validates them in one
place; ``cfg.zero`` and ``cfg.recompute`` cut the sections out of it. Each
section is plain data (no torch import), so a component can also be built
directly in tests and tools.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroConfig:
    """What :func:`hybrid.zero.apply_zero` needs: sharding, buckets, precision, AdamW.

    ``params_dtype``: "fp32", "bf16" or "fp16" (the model's training dtype; the
    optimizer keeps fp32 master weights for the low-precision ones).
    ``grads_in_fp32``: accumulate micro-batches and reduce over DP in fp32
    (Megatron's ``--accumulate-allreduce-grads-in-fp32``); otherwise in
    ``params_dtype``.
    ``loss_scale``: static fp16 loss scale; None means dynamic under fp16 and
    no scaling otherwise.
    """

    stage: int = 0
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    overlap_comm: bool = False
    param_persistence_threshold: int = 100_000
    offload_optimizer: bool = False
    params_dtype: str = "fp32"
    grads_in_fp32: bool = False
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    @property
    def grads_dtype(self) -> str:
        return "fp32" if self.grads_in_fp32 else self.params_dtype


@dataclass(frozen=True)
class RecomputeConfig:
    """What :func:`hybrid.activation_checkpointing.apply_activation_checkpointing` needs.

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
