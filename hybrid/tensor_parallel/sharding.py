"""Which slice of a full tensor a TP rank holds, and layout-independent init.

A TP-split parameter carries a :class:`ShardSpec` (``param.tp_spec``): the full
shape, the split dimension, and this rank's index among ``size`` equal chunks.
A parameter without one is replicated on every TP rank (LayerNorm, position
embeddings, row-parallel biases).

[Note: layout-independent init]
Each parameter's *full* value is drawn from its own generator, seeded by the
run seed and the parameter's name, and each rank keeps its slice. So with the
same ``--seed`` the model is the same function whatever the TP x DP layout and
whatever order modules were built in. That is what lets every parallel run be
checked against a one-process reference.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

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


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator owned by one named parameter, independent of build order."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


InitFn = Callable[[str, tuple, torch.Generator], torch.Tensor]


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, init_fn: InitFn) -> None:
    """Fill every parameter with its slice of ``init_fn(name, full_shape, generator)``.

    ``init_fn`` returns the full fp32 CPU tensor; it is drawn on CPU so the values
    do not depend on the device either.
    """
    for name, p in module.named_parameters():
        full = init_fn(name, full_shape(p), param_generator(seed, name))
        p.copy_(shard_of(full, p).to(device=p.device, dtype=p.dtype))
