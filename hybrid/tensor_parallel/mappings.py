"""The communication ops that join tensor-parallel regions, as autograd Functions.

Megatron's conjugate pair:

* ``f`` = :func:`copy_to_tp`      forward: identity,    backward: all-reduce
* ``g`` = :func:`reduce_from_tp`  forward: all-reduce,  backward: identity

and the last-dimension split/concat pair:

* :func:`scatter_to_tp`   forward: keep this rank's chunk of the last dim, backward: all-gather
* :func:`gather_from_tp`  forward: all-gather along the last dim,           backward: keep own chunk

and the sequence-parallel ops (Korthikanti et al. 2022), which split the
sequence dimension (dim 1 of ``(B, T, C)``) over the TP group in the regions TP
leaves replicated (norms, dropout, residual adds):

* :func:`scatter_to_sequence`        forward: keep own sequence chunk,   backward: all-gather
* :func:`gather_from_sequence`       forward: all-gather the sequence,   backward: reduce-scatter
* :func:`reduce_scatter_to_sequence` forward: reduce-scatter the sequence, backward: all-gather

With sequence parallelism ``gather_from_sequence`` takes f's place before a
column-parallel layer and ``reduce_scatter_to_sequence`` takes g's after a
row-parallel one: an all-reduce is a reduce-scatter plus an all-gather, so the
bytes on the wire are the same, and the activations between them are 1/tp.

Every collective runs over the ``group`` passed in (the TP group of this rank).
"""

from __future__ import annotations

import torch
from einops import rearrange

from hybrid.parallel.comm import CommGroup


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
    """A reduced copy: for gradients in backward. The incoming gradient may be the
    very tensor autograd hands to another branch too (an add's backward passes
    one tensor to both inputs), so it is never reduced in place."""
    if group.size == 1:
        return x
    out = x.contiguous().clone()
    group.all_reduce(out)
    return out


def _split_sequence(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if x.shape[1] % group.size:
        raise ValueError(f"sequence length {x.shape[1]} not divisible by TP size {group.size}")
    return x.chunk(group.size, dim=1)[group.rank].contiguous()


class Pending:
    """An async collective's result: ``wait()`` blocks until it has arrived, then
    returns it (the verb pair of ``async_op=True``)."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._finish()


def all_gather_sequence(x: torch.Tensor, group: CommGroup, async_op: bool = False):
    """(B, T / tp, ...) -> (B, T, ...): rank chunks one after another along dim 1.
    A plain collective over ``group`` (no autograd), for the ops' own backward passes;
    ``async_op``: a :class:`Pending` of it."""
    x = x.contiguous()
    buf = torch.empty((group.size, *x.shape), dtype=x.dtype, device=x.device)
    work = group.all_gather(buf, x, async_op=async_op)
    finish = lambda: rearrange(buf, "r b t ... -> b (r t) ...")  # noqa: E731
    return Pending(work, finish) if async_op else finish()


def reduce_scatter_sequence(x: torch.Tensor, group: CommGroup, async_op: bool = False):
    """(B, T, ...) summed over TP ranks, this rank's (B, T / tp, ...) chunk of the sum.
    A plain collective over ``group`` (no autograd); ``async_op``: a :class:`Pending`."""
    if x.shape[1] % group.size:
        raise ValueError(f"sequence length {x.shape[1]} not divisible by TP size {group.size}")
    # batch-first tensors: a rank's chunk is strided in memory, so pack chunks rank-major
    parts = rearrange(x, "b (r t) ... -> r b t ...", r=group.size).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    work = group.reduce_scatter(out, parts, async_op=async_op)
    # (parts must outlive the collective: the closure keeps it until the wait)
    return Pending(work, lambda: (parts, out)[1]) if async_op else out


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
    """forward: all-reduce over the TP group; backward: identity.

    [Note: the in-place forward all-reduce]
    With ``inplace`` the partial sums are reduced in their own buffer instead of a
    clone, saving a copy of the activation per row-parallel layer. That is safe
    only for a tensor nobody else reads afterwards, and autograd must not have
    saved it for a backward: the callers pass it for a fresh matmul output (a
    matmul saves its inputs, not its output) and for the embedding's
    masked_fill output (which saves only the mask), never for a leaf or a tensor
    they keep. ``mark_dirty`` bumps its version, so had anything saved it,
    backward would raise "modified by an inplace operation" rather than compute
    with reduced values.
    """

    @staticmethod
    def forward(ctx, x, group, inplace=False):
        if inplace and x.is_contiguous():
            group.all_reduce(x)
            ctx.mark_dirty(x)
            return x
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


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


class _ScatterToSequence(torch.autograd.Function):
    """forward: keep this rank's chunk of the sequence; backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather the sequence; backward: reduce-scatter the sequence.

    The consumer is tensor-parallel (a column-parallel linear, the head), so each
    rank's input gradient is a partial sum over TP: reduce-scatter adds the parts
    and leaves each rank its own chunk.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter the sequence; backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _SumKeepLocalGrad(torch.autograd.Function):
    """Forward: all-reduce (sum) over ``group``; backward: identity."""

    @staticmethod
    def forward(ctx, x, group: CommGroup):
        out = x.clone()
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def sum_over_group(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group`` (a rank's part of a quantity split over the group:
    a loss over CP's share of the sequence, an MoE layer's routing statistics), whose
    backward is the identity: each rank's gradient is the total's through its own terms
    only, and summing the ranks' gradients later (ZeRO's reduction over DP x CP; f on a
    sequence-parallel parameter over TP) makes the whole gradient."""
    return _SumKeepLocalGrad.apply(x, group) if group.size > 1 else x


def copy_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Megatron's f: enter a TP region (identity forward, all-reduce backward)."""
    return _CopyToTP.apply(x, group) if group.size > 1 else x


def reduce_from_tp(x: torch.Tensor, group: CommGroup, inplace: bool = False) -> torch.Tensor:
    """Megatron's g: leave a TP region by summing partial results (all-reduce forward).

    ``inplace``: ``x`` is a temporary only the caller holds and autograd did not save;
    it is reduced in its own memory and returned (see [Note: the in-place forward
    all-reduce])."""
    return _ReduceFromTP.apply(x, group, inplace) if group.size > 1 else x


def scatter_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Split the last dim over TP ranks (..., d) -> (..., d / tp)."""
    return _ScatterToTP.apply(x, group) if group.size > 1 else x


def gather_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Concatenate TP chunks along the last dim (..., d / tp) -> (..., d)."""
    return _GatherFromTP.apply(x, group) if group.size > 1 else x


def scatter_to_sequence(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Keep this rank's sequence chunk: (B, T, ...) -> (B, T / tp, ...)."""
    return _ScatterToSequence.apply(x, group) if group.size > 1 else x


def gather_from_sequence(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Enter a TP region from a sequence-parallel one: (B, T / tp, ...) -> (B, T, ...)."""
    return _GatherFromSequence.apply(x, group) if group.size > 1 else x


def reduce_scatter_to_sequence(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Leave a TP region into a sequence-parallel one by summing partial results:
    (B, T, ...) partial on each rank -> this rank's (B, T / tp, ...) of the sum."""
    return _ReduceScatterToSequence.apply(x, group) if group.size > 1 else x


def sequence_parallel_param(p: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """A replicated parameter used on this rank's tokens only (norms, row-parallel
    biases, positions under sequence parallelism): forward identity, backward
    all-reduce over TP -- f applied to the parameter -- so every replica gets the
    gradient of the whole sequence and the replicas stay equal."""
    return copy_to_tp(p, group)
