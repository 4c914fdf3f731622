"""f/g and scatter/gather against hand-computed all-reduce semantics at TP=2 and 4."""

import pytest
import torch

from hybrid.tensor_parallel import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from tests.helpers.harness import run_ranks


def _rank_tensor(rank, shape=(3, 8)):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g)


def _mappings_worker(ps):
    g = ps.tp_group
    out = {}
    # Every rank feeds its own input and its own upstream gradient.
    for name, op in [("f", copy_to_tp), ("g", reduce_from_tp),
                     ("scatter", scatter_to_tp), ("gather", gather_from_tp)]:
        x = _rank_tensor(g.rank).requires_grad_()
        y = op(x, g)
        dy = _rank_tensor(1000 + g.rank, y.shape)
        y.backward(dy)
        out[name] = (y.detach(), x.grad)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_conjugate_ops_match_hand_computed_collectives(tp):
    res = run_ranks(_mappings_worker, world_size=tp, tp=tp)
    xs = [_rank_tensor(r) for r in range(tp)]
    for r in range(tp):
        y, gx = res[r]["f"]  # f: identity forward, all-reduce backward
        assert torch.equal(y, xs[r])
        dys = [_rank_tensor(1000 + q, y.shape) for q in range(tp)]
        torch.testing.assert_close(gx, sum(dys), rtol=1e-6, atol=1e-6)

        y, gx = res[r]["g"]  # g: all-reduce forward, identity backward
        torch.testing.assert_close(y, sum(xs), rtol=1e-6, atol=1e-6)
        assert torch.equal(gx, _rank_tensor(1000 + r, y.shape))

        y, gx = res[r]["scatter"]  # keep own chunk of last dim; backward gathers grads
        assert torch.equal(y, xs[r].chunk(tp, -1)[r])
        dys = [_rank_tensor(1000 + q, y.shape) for q in range(tp)]
        assert torch.equal(gx, torch.cat(dys, -1))

        y, gx = res[r]["gather"]  # concat all ranks along last dim; backward keeps own chunk
        assert torch.equal(y, torch.cat(xs, -1))
        assert torch.equal(gx, _rank_tensor(1000 + r, y.shape).chunk(tp, -1)[r])


def _comm_bytes_worker(ps):
    x = torch.ones(1000)
    ps.comm_stats.reset()
    ps.tp_group.all_reduce(x)
    return ps.comm_stats.snapshot()


def test_comm_counts_ring_volume_per_rank():
    res = run_ranks(_comm_bytes_worker, world_size=4, tp=4)
    # all-reduce of 4000 bytes over 4 ranks: each rank sends 2 * 4000 * 3/4 bytes
    assert all(r["all_reduce"] == 6000 for r in res)


def _inplace_worker(ps):
    g = ps.tp_group
    out = {}
    for inplace in (False, True):
        w = _rank_tensor(g.rank, (8, 8)).requires_grad_()
        x = _rank_tensor(50 + g.rank)
        partial = x @ w  # a fresh matmul output, as in RowParallelLinear
        y = reduce_from_tp(partial, g, inplace=inplace)
        out[inplace] = {"y": y.detach().clone(), "same": y.data_ptr() == partial.data_ptr()}
        (y * _rank_tensor(1000 + g.rank, y.shape)).sum().backward()
        out[inplace]["grad"] = w.grad.clone()
    # a tensor autograd saved (exp saves its output) may not be reduced in place:
    # backward refuses instead of using the reduced values
    a = _rank_tensor(g.rank).requires_grad_()
    saved = a.exp()
    y = reduce_from_tp(saved, g, inplace=True)
    try:
        y.sum().backward()
        out["refused"] = False
    except RuntimeError as e:
        out["refused"] = "inplace" in str(e)
    return out


def test_in_place_forward_all_reduce_is_exact_and_guarded():
    """reduce_from_tp(..., inplace=True) reduces the partial sums in their own buffer
    (no clone) with the same values and gradients as the copying path; on a tensor
    autograd saved, backward raises instead of silently using reduced values."""
    for r in run_ranks(_inplace_worker, world_size=2, tp=2):
        assert r[True]["same"] and not r[False]["same"]
        assert torch.equal(r[True]["y"], r[False]["y"])
        assert torch.equal(r[True]["grad"], r[False]["grad"])
        assert r["refused"]
