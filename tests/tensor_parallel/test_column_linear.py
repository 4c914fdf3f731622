"""The column-parallel matmul: its backward starts the TP collective before the weight
gradient and waits after it, and gives the unfused path's bits (f, then a linear).

One process, a stand-in TP group of two whose collectives act as if the other rank
held the same tensors (sum = 2x, gather = two copies): the order of the work and
the bits are what is checked here; the real collectives are covered at TP 2 and 4
by the model tests.
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid.tensor_parallel import column_linear, column_parallel_linear, copy_to_tp
from hybrid.tensor_parallel.mappings import all_gather_sequence, reduce_scatter_sequence


class _Done:
    def __init__(self, events, name):
        self.events, self.name = events, name

    def wait(self):
        self.events.append(f"wait {self.name}")


class _TwinGroup:
    """Two ranks holding the same tensors; records what is issued, and how."""

    size, rank = 2, 0

    def __init__(self):
        self.events = []

    def _issued(self, name, async_op):
        self.events.append(f"start {name}" if async_op else name)
        return _Done(self.events, name) if async_op else None

    def all_reduce(self, t, async_op=False):
        t.mul_(2)
        return self._issued("all_reduce", async_op)

    def all_gather(self, out, inp, async_op=False):
        out.copy_(torch.stack([inp, inp]).reshape(out.shape))
        return self._issued("all_gather", async_op)

    def reduce_scatter(self, out, inp, async_op=False):
        out.copy_(inp.reshape(2, -1).sum(0).reshape(out.shape))
        return self._issued("reduce_scatter", async_op)


def _inputs(seq_parallel, rows=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4 if seq_parallel else 8, 16, generator=g).requires_grad_()
    w = torch.randn(12, 16, generator=g).requires_grad_()
    b = None if rows is not None else torch.randn(12, generator=g).requires_grad_()
    dy = torch.randn(2, 8, 12 if rows is None else rows, generator=g)
    return x, w, b, dy


def _grads(x, w, b, y, dy):
    y.backward(dy)
    out = [x.grad, w.grad] + ([] if b is None else [b.grad])
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    return out


def _unfused(x, w, b, group, sp, rows):
    """What the layer did before: autograd's linear on f(x), or the plain collectives."""
    w_used = w if rows is None else w[:rows]
    if not sp:
        return F.linear(copy_to_tp(x, group), w_used, b)

    class Gathered(torch.autograd.Function):  # all-gather forward, reduce-scatter backward
        @staticmethod
        def forward(ctx, t):
            return all_gather_sequence(t, group)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter_sequence(grad, group)
    return F.linear(Gathered.apply(x), w_used, b)


def _recorded_case(monkeypatch, sp, rows):
    """(stand-in TP group, x, w, b, dy, the unfused reference's gradients), with every
    weight-gradient computation recorded in the group's events."""
    group = _TwinGroup()
    x, w, b, dy = _inputs(sp, rows)
    ref = _grads(x, w, b, _unfused(x, w, b, group, sp, rows), dy)
    weight_grad = column_linear.linear_grad_weight

    def recorded(*a, **k):
        group.events.append("weight grad")
        return weight_grad(*a, **k)
    monkeypatch.setattr(column_linear, "linear_grad_weight", recorded)
    return group, x, w, b, dy, ref


@pytest.mark.parametrize("sp,rows", [(False, None), (True, None), (False, 9), (True, 9)])
def test_backward_overlaps_the_collective_and_keeps_every_bit(monkeypatch, sp, rows):
    group, x, w, b, dy, ref = _recorded_case(monkeypatch, sp, rows)
    group.events.clear()
    y = column_parallel_linear(x, w, b, group, sequence_parallel=sp, rows=rows)
    forward = list(group.events)
    got = _grads(x, w, b, y, dy)
    backward = group.events[len(forward):]
    if sp:  # gather for dW while dx's GEMM runs, reduce-scatter dx while dW's does
        assert forward == ["all_gather"]
        assert backward == ["start all_gather", "wait all_gather", "start reduce_scatter",
                            "weight grad", "wait reduce_scatter"]
    else:  # dx's all-reduce is on the wire while dW is computed
        assert forward == [] and backward == ["start all_reduce", "weight grad",
                                              "wait all_reduce"]
    for a, r in zip(got, ref):
        assert torch.equal(a, r)
    if rows is not None:  # the rows left out (the vocabulary padding) get zeros
        assert got[1].shape == w.shape and not got[1][rows:].any() and got[1][:rows].any()


def test_one_rank_head_over_the_real_rows_only():
    """TP 1 (no collective): the cut head is autograd's linear over the kept rows."""
    from hybrid.parallel.state import ParallelState
    group = ParallelState.single().tp_group
    x, w, _, dy = _inputs(False, rows=9)
    ref = _grads(x, w, None, F.linear(x, w[:9]), dy)
    got = _grads(x, w, None, column_parallel_linear(x, w, None, group, rows=9), dy)
    for a, r in zip(got, ref):
        assert torch.equal(a, r)
