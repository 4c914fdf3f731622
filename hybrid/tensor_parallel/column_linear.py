"""The column-parallel matmul with its TP collective overlapped in backward.

``y = f(x) W^T + b`` (Megatron's f, then this rank's rows of W) is one autograd
Function here rather than :func:`~hybrid.tensor_parallel.mappings.copy_to_tp`
followed by a linear, so its backward can order the work itself:

    dx = dy W                 the input gradient, a partial sum over TP ranks
    start all-reduce(dx)      over the TP group, asynchronously
    dW = dy^T x, db = sum dy  computed while dx is on the wire
    wait                      before dx is handed back to autograd

With sequence parallelism (``x`` is this rank's ``(B, T / tp, in)``):

    start all-gather(x)       the full sequence, needed for dW only
    dx = dy W                 meanwhile
    wait; start reduce-scatter(dx)
    dW = dy^T x_full          meanwhile
    wait

[Note: overlap without changing a bit]
The collectives and GEMMs are the very ones the unfused path runs, on the same
operands (:func:`hybrid.kernels.linear.linear_grad_input` /
``linear_grad_weight`` give autograd's bits), so the result is unchanged; only
the time the rank spends blocked shrinks. ``dx`` is this Function's own fresh
tensor, so it is reduced in place, where f alone must clone the incoming
gradient (autograd may hand that one tensor to another branch too). Every TP
rank issues the same collectives in the same order, and nothing else is issued
on the TP group between a start and its wait, so the group's sequence stays
identical on all ranks.

Given a :class:`~hybrid.tensor_parallel.weight_grad.WeightGradStore`, a backward that
runs while the store defers (a zero-bubble schedule's input half) computes ``dx`` and
its collective only, and leaves ``dW``, ``db`` -- under SP with the all-gather they
need -- to a closure the weight half runs (:mod:`hybrid.tensor_parallel.weight_grad`).
"""

from __future__ import annotations

import torch

from hybrid.kernels import linear
from hybrid.kernels.linear import linear_grad_input, linear_grad_weight
from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.mappings import all_gather_sequence, reduce_scatter_sequence
from hybrid.tensor_parallel.weight_grad import WeightGradStore, leaves


def _used_rows(weight: torch.Tensor, rows: int | None) -> torch.Tensor:
    return weight if rows is None else weight[:rows]


def _weight_grad(dy, x, weight, rows: int | None, bias: bool):
    """(dW (weight's shape), db): rows past ``rows`` were not used and get zeros; the
    used ones are written in place, so the gradient is never copied."""
    if rows is None:
        return linear_grad_weight(dy, x, bias)
    dw = torch.empty_like(weight)
    dw[rows:].zero_()
    return dw, linear_grad_weight(dy, x, bias, out=dw[:rows])[1]


def _keep_params(ctx, weight, bias, store: WeightGradStore | None) -> None:
    """Remember the store (and the parameters its closures name) when the weight gradient
    may be deferred: a store was given and the weight and bias are leaves."""
    ctx.store = store if store is not None and leaves(weight, bias) else None
    ctx.params = (weight, bias) if ctx.store is not None else None


def _defer(ctx, compute) -> bool:
    """Push ``compute() -> (dW, db)`` to the Function's store if a deferring block is open
    ([Note: the one place that decides] in :mod:`hybrid.tensor_parallel.weight_grad`)."""
    if ctx.store is None:
        return False
    weight, bias = ctx.params

    def later():
        dw, db = compute()
        return [(weight, dw)] + ([(bias, db)] if bias is not None else [])
    return ctx.store.defer(later)


class _ColumnParallelLinear(torch.autograd.Function):
    """forward: ``x W^T + b``; backward: the input gradient all-reduced over TP while
    the weight gradient is computed (see the module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, rows, store=None):
        ctx.group, ctx.has_bias, ctx.rows = group, bias is not None, rows
        ctx.save_for_backward(x, weight)
        _keep_params(ctx, weight, bias, store)
        return linear(x, _used_rows(weight, rows), bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = work = None
        if ctx.needs_input_grad[0]:
            dx = linear_grad_input(dy, _used_rows(weight, ctx.rows))
            work = ctx.group.all_reduce(dx, async_op=True)
        rows, has_bias = ctx.rows, ctx.has_bias
        later = _defer(ctx, lambda: _weight_grad(dy, x, weight, rows, has_bias))
        dw, db = (None, None) if later else _weight_grad(dy, x, weight, rows, has_bias)
        if work is not None:
            work.wait()
        return dx, dw, db, None, None, None


class _SequenceGatheredLinear(torch.autograd.Function):
    """``y = all_gather_sequence(x) W^T (+ b)``, saving only this rank's ``x``.

    Saving the local ``(B, T / tp, in)`` rather than the gathered ``(B, T, in)``
    is what divides a layer's stored activations by TP under sequence
    parallelism; the price is a second all-gather in backward, overlapped with
    the input gradient's GEMM.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, rows, store=None):
        ctx.group, ctx.has_bias, ctx.rows = group, bias is not None, rows
        ctx.save_for_backward(x, weight)
        _keep_params(ctx, weight, bias, store)
        return linear(all_gather_sequence(x, group), _used_rows(weight, rows), bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group, rows, has_bias = ctx.group, ctx.rows, ctx.has_bias
        # deferred: the gather for dW runs with it, later (every TP rank in one order)
        if _defer(ctx, lambda: _weight_grad(dy, all_gather_sequence(x, group), weight, rows,
                                            has_bias)):
            partial = linear_grad_input(dy, _used_rows(weight, rows))
            return reduce_scatter_sequence(partial, group), None, None, None, None, None
        gathering = all_gather_sequence(x, group, async_op=True)  # (B, T, in) for dW
        # (B, T, in), a partial sum over TP
        partial = linear_grad_input(dy, _used_rows(weight, rows))
        full = gathering.wait()
        scattering = reduce_scatter_sequence(partial, group, async_op=True)
        dw, db = _weight_grad(dy, full, weight, rows, has_bias)
        return scattering.wait(), dw, db, None, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: CommGroup, sequence_parallel: bool = False,
                           rows: int | None = None,
                           weight_grads: WeightGradStore | None = None) -> torch.Tensor:
    """``x W^T (+ b)`` for this rank's rows ``weight (out / tp, in)`` of a column-parallel
    layer: ``x (..., in)`` identical on every TP rank, or with ``sequence_parallel``
    this rank's ``(B, T / tp, in)``, all-gathered along the sequence. Output
    ``(..., out / tp)`` (``(B, T, out / tp)``). Backward returns the input gradient
    summed over ``group`` (reduce-scattered under SP), its collective overlapped with
    the weight gradient's GEMM.

    ``rows``: use only ``weight[:rows]`` (the head over the real vocabulary, its
    padding rows left out): output ``(..., rows)``, and the unused rows' gradient
    is zeros. Bias-free only. (On one rank the Function runs too, its collectives
    returning at once.)

    ``weight_grads``: the model's :class:`~hybrid.tensor_parallel.weight_grad.WeightGradStore`;
    a backward run while it is deferring computes the input gradient only and leaves
    ``dW``, ``db`` to a closure (the Function runs then at any TP size)."""
    if rows is not None and bias is not None:
        raise ValueError("column_parallel_linear: rows= needs bias=None")
    if rows is not None and rows >= weight.shape[0]:
        rows = None  # every row is used
    if group.size == 1 and rows is None and weight_grads is None:
        return linear(x, weight, bias)
    if sequence_parallel:
        return _SequenceGatheredLinear.apply(x, weight, bias, group, rows, weight_grads)
    return _ColumnParallelLinear.apply(x, weight, bias, group, rows, weight_grads)
