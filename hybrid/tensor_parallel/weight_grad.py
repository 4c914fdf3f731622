"""Deferred weight gradients: the linears' half of a zero-bubble pipeline's split backward.

    store = WeightGradStore()                        # one per model, given to its linears
    with store.deferring() as later:                 # the input-gradient half (I)
        grads = torch.autograd.grad(out, [x, *params], grad, allow_unused=True)
    ...                                              # other actions
    pairs = run_deferred(later)                      # the weight-gradient half (W)
    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

A linear's backward is two independent GEMMs: ``dx = dy W``, which the layer before
it waits for, and ``dW = dy^T x`` (``db = sum dy``), which nothing in the backward
reads. The column- and row-parallel Functions built with a store
(``ColumnParallelLinear(..., weight_grads=store)``, :func:`deferrable_linear`)
check it when their backward runs: while :meth:`WeightGradStore.deferring` is
open they compute ``dx`` (with its TP collective) and push a closure holding
``(x, dy)`` instead of computing ``dW``; the closure, run later, returns
``[(weight, dW), (bias, db)]``. Outside the block they compute both at once, as
without a store, so a model built with a store still runs plain backwards
(GPipe, 1F1B, evaluation) unchanged.

[Note: the one place that decides]
Whether a backward defers is decided by whoever opens :meth:`deferring` -- the
pipeline executor, around an ``I`` action -- on the store the model was built
with (``GPT(split_backward=True)`` makes one and hands it to every linear and
the head: ``model.weight_grads``). The Functions read only the store they were
given when their forward ran; there is no global switch. A block is one
backward: ``deferring`` refuses to nest.

[Note: accumulating through autograd]
The deferred gradients are added into ``.grad`` by ``torch.autograd.backward``
with the parameters themselves as the roots (a leaf's root edge is its
AccumulateGrad node), never by ``p.grad += g``: so every parameter's
post-accumulate-grad hooks fire exactly as in a whole backward, which is how
ZeRO's reducer (:mod:`hybrid.zero.grad_sync`) counts a unit complete, folds a
gradient into its fp32 buffer or reduce-scatters it. The caller sums the
gradients of one parameter first (one the closures return and one the input
half computed, e.g. a tied embedding used by the head and the lookup), so each
parameter's hook fires once per backward. Only the leaves' shapes are read:
stage 3's released parameters (storage freed, shape kept) take their gradient
without being gathered again, and ``dW`` never reads ``W``.

What a deferred closure holds until it runs: the linear's input ``x`` (this
rank's ``(B, T / tp, in)`` under sequence parallelism, all-gathered again when
the closure runs, its TP collective issued in the same order on every TP rank
because every rank defers the same closures in the same order) and the
gradient of its output ``dy``: what the whole backward freed when it passed the
layer lives until ``W``, the zero-bubble schedules' known memory cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from hybrid.kernels import linear
from hybrid.kernels.grouped_linear import grouped_linear, grouped_linear_grads
from hybrid.kernels.linear import linear_grad_input, linear_grad_weight

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, its gradient)
Deferred = Callable[[], Pairs]


class WeightGradStore:
    """The queue a model's linears push their weight gradients to while a split
    backward's input half runs (module doc). One per model (per pipeline stage)."""

    def __init__(self) -> None:
        self._queue: list[Deferred] | None = None

    @contextlib.contextmanager
    def deferring(self) -> Iterator[list[Deferred]]:
        """Inside: the linears' backwards defer their weight gradients into the yielded
        list, in the order they ran (run them with :func:`run_deferred`)."""
        if self._queue is not None:
            raise RuntimeError("WeightGradStore.deferring: one backward at a time (nested)")
        self._queue = []
        try:
            yield self._queue
        finally:
            self._queue = None

    @property
    def active(self) -> bool:
        """A deferring block is open: a backward running now defers."""
        return self._queue is not None

    def defer(self, work: Deferred) -> bool:
        """Keep ``work`` for later if a deferring block is open (True); else False and
        the caller computes its weight gradient now."""
        if self._queue is None:
            return False
        self._queue.append(work)
        return True


def run_deferred(queue: list[Deferred]) -> Pairs:
    """Run the closures a :meth:`WeightGradStore.deferring` block collected, in their
    order, emptying ``queue``: every ``(parameter, gradient)`` they return. Without a
    graph, as a backward computes them."""
    pairs: Pairs = []
    with torch.no_grad():
        for work in queue:
            pairs.extend(work())
    queue.clear()
    return pairs


def leaves(*params: torch.Tensor | None) -> bool:
    """Whether a Function may defer the gradients of ``params``: each is None or a leaf
    (a parameter), so :func:`run_deferred`'s pairs can be accumulated as roots."""
    return all(p is None or p.is_leaf for p in params)


class _DeferrableLinear(torch.autograd.Function):
    """``x W^T`` (no bias), its weight gradient deferred to ``store`` when a deferring
    block is open at backward time (the row-parallel layer's matmul)."""

    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x, weight)
        ctx.store = store if leaves(weight) else None
        ctx.weight = weight if ctx.store is not None else None
        return linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = linear_grad_input(dy, weight) if ctx.needs_input_grad[0] else None
        if ctx.store is not None:
            param = ctx.weight
            if ctx.store.defer(lambda: [(param, linear_grad_weight(dy, x, False)[0])]):
                return dx, None, None
        return dx, linear_grad_weight(dy, x, False)[0], None


class _DeferrableGroupedLinear(torch.autograd.Function):
    """:func:`hybrid.kernels.grouped_linear.grouped_linear` of a stacked ``(G, out, in)``
    weight, the whole stack's gradient deferred to ``store`` when a deferring block is
    open at backward time (an MoE layer's experts: one projection's G matmuls)."""

    @staticmethod
    def forward(ctx, x, weight, counts, store):
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        ctx.store = store if leaves(weight) else None
        ctx.weight = weight if ctx.store is not None else None
        return grouped_linear(x, counts, weight.unbind(0))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        counts = ctx.counts
        if ctx.store is not None:
            param = ctx.weight
            if ctx.store.defer(lambda: [(param, grouped_linear_grads(
                    dy, x, counts, weight, want_input=False)[1])]):
                dx = grouped_linear_grads(dy, x, counts, weight)[0] \
                    if ctx.needs_input_grad[0] else None
                return dx, None, None, None
        dx, dw = grouped_linear_grads(dy, x, counts, weight, ctx.needs_input_grad[0])
        return dx, dw, None, None


def deferrable_grouped_linear(x: torch.Tensor, counts: list[int], weight: torch.Tensor,
                              store: WeightGradStore | None) -> torch.Tensor:
    """Each group of ``x``'s rows (``counts``) times its slice of the stacked ``weight``
    ``(G, out, in)`` (:func:`hybrid.kernels.grouped_linear.grouped_linear`); with a
    ``store``, the stack's weight gradient is what a deferring block takes for later, as
    a linear's is (module doc). Without one, autograd through the stack's split (its
    backward stacks the G gradients once)."""
    if store is None:
        return grouped_linear(x, counts, weight.unbind(0))
    return _DeferrableGroupedLinear.apply(x, weight, counts, store)


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor,
                      store: WeightGradStore | None) -> torch.Tensor:
    """``x W^T`` (:func:`hybrid.kernels.linear`); with a ``store``, an autograd Function
    whose weight gradient a deferring block takes for later (module doc)."""
    if store is None:
        return linear(x, weight)
    return _DeferrableLinear.apply(x, weight, store)
