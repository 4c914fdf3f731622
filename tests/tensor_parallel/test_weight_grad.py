"""Deferred weight gradients (hybrid/tensor_parallel/weight_grad.py): a column- or
row-parallel matmul built with a store computes only its input gradient while the store
defers, leaving a closure whose ``dW`` (``db``) are the whole backward's bits; outside a
deferring block it is the plain backward; and the closures' gradients, accumulated
through autograd, fire each parameter's post-accumulate-grad hook once.

The column layer runs over the stand-in TP group of two of test_column_linear.py, which
records the collectives: under SP the all-gather ``dW`` needs moves into the closure."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.tensor_parallel import column_parallel_linear
from hybrid.tensor_parallel.weight_grad import WeightGradStore, deferrable_linear, run_deferred
from tests.tensor_parallel.test_column_linear import _grads, _recorded_case


@pytest.mark.parametrize("sp,rows", [(False, None), (True, None), (False, 9), (True, 9)])
def test_column_parallel_defers_its_weight_gradient_to_the_bit(monkeypatch, sp, rows):
    group, x, w, b, dy, ref = _recorded_case(monkeypatch, sp, rows)
    store = WeightGradStore()
    y = column_parallel_linear(x, w, b, group, sequence_parallel=sp, rows=rows,
                               weight_grads=store)
    group.events.clear()
    with store.deferring() as later:
        assert store.active
        (dx,) = torch.autograd.grad(y, x, dy)
    assert not store.active and len(later) == 1 and w.grad is None
    # only the input gradient's collective (synchronous: no GEMM left to overlap)
    assert group.events == (["reduce_scatter"] if sp else ["start all_reduce",
                                                           "wait all_reduce"])
    assert torch.equal(dx, ref[0])
    group.events.clear()
    pairs = run_deferred(later)
    assert later == [] and group.events == (["all_gather"] if sp else []) + ["weight grad"]
    assert [p for p, _ in pairs] == [w] + ([] if b is None else [b])
    for (_, g), r in zip(pairs, ref[1:]):
        assert torch.equal(g, r)
    # outside a deferring block the same Function is the whole backward
    got = _grads(x, w, b, column_parallel_linear(x, w, b, group, sequence_parallel=sp,
                                                 rows=rows, weight_grads=store), dy)
    for a, r in zip(got, ref):
        assert torch.equal(a, r)


def test_row_parallel_matmul_defers_and_accumulates_through_the_hooks():
    """The row layer's matmul at TP 1: input gradient now, ``dW`` later, autograd's
    bits; accumulated by autograd with the parameter as the root, so its
    post-accumulate-grad hook fires once per backward and ``.grad`` adds up."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(12, 16, generator=g))
    dy = torch.randn(2, 8, 12, generator=g)
    ref = _grads(x, w, None, F.linear(x, w), dy)
    fired = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    store = WeightGradStore()
    for k in range(2):
        with store.deferring() as later:
            (dx,) = torch.autograd.grad(deferrable_linear(x, w, store), x, dy)
        assert torch.equal(dx, ref[0])  # and .grad untouched until W
        assert w.grad is None if k == 0 else torch.equal(w.grad, ref[1])
        ((p, dw),) = run_deferred(later)
        assert p is w and torch.equal(dw, ref[1])
        torch.autograd.backward([p], [dw])
        assert len(fired) == k + 1
    assert torch.equal(w.grad, 2 * ref[1])


def test_deferring_is_one_backward_at_a_time():
    store = WeightGradStore()
    with store.deferring(), pytest.raises(RuntimeError, match="nested"), store.deferring():
        pass
    assert not store.active and not store.defer(lambda: [])
