"""Which slice of a full tensor a TP rank holds.

A TP-split parameter carries a :class:`ShardSpec` (``param.tp_spec``): the full
shape, the split dimension, and this rank's index among ``size`` equal chunks.
A parameter without one is replicated on every TP rank (LayerNorm, position
embeddings, row-parallel biases).

Initial values are defined on the full tensor and drawn slice by slice:
see :mod:`hybrid.tensor_parallel.init`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds chunk ``rank`` of ``size`` along ``dim`` of a ``full_shape`` tensor."""

    full_shape: tuple[int, ...]
    dim: int
    rank: int
    size: int

    @property
    def offset(self) -> int:
        return self.rank * (self.full_shape[self.dim] // self.size)


def mark_split(param: nn.Parameter, full_shape, dim: int, rank: int, size: int) -> nn.Parameter:
    param.tp_spec = ShardSpec(tuple(full_shape), dim, rank, size)
    return param


def is_tp_split(param: torch.Tensor) -> bool:
    """True when the parameter is a TP shard (its grads differ per TP rank)."""
    spec = getattr(param, "tp_spec", None)
    return spec is not None and spec.size > 1


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    spec = getattr(param, "tp_spec", None)
    return spec.full_shape if spec is not None else tuple(param.shape)


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``full`` for ``param`` (``full`` itself when replicated)."""
    spec = getattr(param, "tp_spec", None)
    if spec is None:
        return full
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(f"full tensor {tuple(full.shape)} does not match {spec.full_shape}")
    return full.chunk(spec.size, dim=spec.dim)[spec.rank]


