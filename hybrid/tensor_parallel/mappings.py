"""The communication ops that join tensor-parallel regions, as autograd Functions.

Megatron's conjugate pair:

* ``f`` = :func:`copy_to_tp`      forward: identity,    backward: all-reduce
* ``g`` = :func:`reduce_from_tp`  forward: all-reduce,  backward: identity

and the last-dimension split/concat pair:

* :func:`scatter_to_tp`   forward: keep this rank's chunk of the last dim,  backward: all-gather
* :func:`gather_from_tp`  forward: all-gather along the last dim,            backward: keep own chunk

Every collective runs over the ``group`` passed in (the TP group of this rank).
"""

from __future__ import annotations

import torch
from einops import rearrange

from hybrid.comm import CommGroup


def _split_last(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    if x.shape[-1] % group.size:
        raise ValueError(f"last dim {x.shape[-1]} not divisible by TP size {group.size}")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous()
    buf = torch.empty((group.size, *x.shape), dtype=x.dtype, device=x.device)
    group.all_gather(buf, x)
    return rearrange(buf, "r ... d -> ... (r d)")  # rank chunks side by side


def _all_reduce(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    out = x.contiguous().clone()  # never reduce in place into a tensor autograd saved
    group.all_reduce(out)
    return out


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce over the TP group; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """forward: keep this rank's chunk of the last dim; backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Megatron's f: enter a TP region (identity forward, all-reduce backward)."""
    return _CopyToTP.apply(x, group) if group.size > 1 else x


def reduce_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Megatron's g: leave a TP region by summing partial results (all-reduce forward)."""
    return _ReduceFromTP.apply(x, group) if group.size > 1 else x


def scatter_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Split the last dim over TP ranks (..., d) -> (..., d / tp)."""
    return _ScatterToTP.apply(x, group) if group.size > 1 else x


def gather_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Concatenate TP chunks along the last dim (..., d / tp) -> (..., d)."""
    return _GatherFromTP.apply(x, group) if group.size > 1 else x
