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
