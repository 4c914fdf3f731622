"""Which slice of a full tensor a TP rank holds.

A TP-split parameter carries a :class:`ShardSpec` (``param.tp_spec``): the full
shape, the split dimension, and this rank's index among ``size`` equal chunks.
A parameter without one is replicated on every TP rank (LayerNorm, position
embeddings, row-parallel biases). The local tensor flattened is always chunk
``rank`` of the full tensor seen as a ``(prod(full_shape[:dim]),
prod(full_shape[dim:]))`` matrix, cut along its columns; its own shape may
merge the leading dims (a fused ``[gate; up]`` weight is ``(2F/tp, C)`` locally,
``(2, F, C)`` split along dim 1 in full).

Initial values are defined on the full tensor and drawn slice by slice:
see :mod:`hybrid.tensor_parallel.init`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds chunk ``rank`` of ``size`` along ``dim`` of a ``full_shape`` tensor."""

    full_shape: tuple[int, ...]
    dim: int
    rank: int
    size: int
    # [Note: experts under ETP] (rows R, r, n): the full tensor seen as R rows, this
    # rank's block of them (chunk ``rank`` of ``size`` along dim 0) cut again into n
    # equal column chunks, chunk r here; None: whole rows
    inner: tuple[int, int, int] | None = None

    @property
    def offset(self) -> int:
        return self.rank * (self.full_shape[self.dim] // self.size)


def mark_split(param: nn.Parameter, full_shape, dim: int, rank: int, size: int) -> nn.Parameter:
    # an attribute of the tensor (as Megatron's tensor_model_parallel): torch's stubs
    # declare none beyond its own
    param.tp_spec = ShardSpec(tuple(full_shape), dim, rank, size)  # type: ignore[attr-defined]
    return param


def mark_expert_split(param: nn.Parameter, full_shape, rank: int, size: int,
                      inner: tuple[int, int, int] | None = None) -> nn.Parameter:
    """``param`` holds experts ``[rank E / size, (rank + 1) E / size)`` of a ``full_shape``
    tensor stacked expert first (an MoE layer's experts over the EP group):
    ``param.ep_spec``, split along dim 0; ``inner`` (expert tensor parallelism): only a
    column chunk of those experts' rows (:class:`ShardSpec`). Its initial values are the
    full tensor's (:func:`hybrid.tensor_parallel.init.local_values`), so they do not
    depend on EP or ETP."""
    param.ep_spec = ShardSpec(tuple(full_shape), 0, rank, size,  # type: ignore[attr-defined]
                              inner)
    return param


class Block(NamedTuple):
    """The local tensor as a block of the full one seen as a ``rows x cols`` matrix:
    local rows ``[row0, row0 + nrows)``, columns ``[col0, col0 + width)``, row-major."""

    rows: int
    cols: int
    row0: int
    nrows: int
    col0: int
    width: int


def local_block(spec: ShardSpec) -> Block:
    """Where the local tensor of ``spec`` sits in the full one (:class:`Block`). A TP
    split along ``dim``: every row of the ``prod(full[:dim])``, the rank's column chunk;
    experts over EP: one row, the rank's chunk; under ETP: the rank's block of ``R``
    rows, its column chunk."""
    numel = 1
    for s in spec.full_shape:
        numel *= s
    if spec.inner is None:
        rows = 1
        for s in spec.full_shape[:spec.dim]:
            rows *= s
        cols = numel // rows
        width = cols // spec.size
        return Block(rows, cols, 0, rows, spec.rank * width, width)
    rows_all, r, n = spec.inner
    cols = numel // rows_all
    local_rows, width = rows_all // spec.size, cols // n
    return Block(rows_all, cols, spec.rank * local_rows, local_rows, r * width, width)


def is_tp_split(param: torch.Tensor) -> bool:
    """True when the parameter is a TP shard (its grads differ per TP rank)."""
    spec = getattr(param, "tp_spec", None)
    return spec is not None and spec.size > 1


def split_spec(param: torch.Tensor) -> ShardSpec | None:
    """How ``param`` is a slice of a fuller tensor: its ``tp_spec`` (a TP split) or its
    ``ep_spec`` (experts over EP); None when whole here. A parameter is never both (the
    experts split over EP run at TP 1)."""
    return getattr(param, "tp_spec", None) or getattr(param, "ep_spec", None)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    spec = split_spec(param)
    return spec.full_shape if spec is not None else tuple(param.shape)


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``full`` for ``param`` (``full`` itself when replicated)."""
    spec = getattr(param, "tp_spec", None)
    if spec is None:
        return full
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(f"full tensor {tuple(full.shape)} does not match {spec.full_shape}")
    # reshape: a fused parameter (ColumnParallelLinear's parts) is 2-D locally
    return full.chunk(spec.size, dim=spec.dim)[spec.rank].reshape(param.shape)


def unshard(parts: list[torch.Tensor], spec: ShardSpec | None) -> torch.Tensor:
    """The full tensor from every TP rank's local one, in TP rank order (``parts[0]``
    when replicated): the inverse of :func:`shard_of`."""
    if spec is None:
        return parts[0]
    shape = spec.full_shape
    return torch.cat([p.reshape(*shape[:spec.dim], -1, *shape[spec.dim + 1:]) for p in parts],
                     dim=spec.dim)


