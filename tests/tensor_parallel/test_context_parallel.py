"""Context parallelism's building blocks: which tokens each CP rank holds (equal causal
work), and all-gather attention against one process's full attention -- outputs and
the gradients of q, k and v -- at CP 2 and 4, with and without grouped-query heads."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.tensor_parallel.context_parallel import (all_gather_attention, causal_pairs,
                                                     cp_positions, cp_shard)

from harness import run_ranks

B, NH, T, HS = 2, 4, 32, 8


def test_positions_of_each_layout():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_positions(8, 2, 1, "striped").tolist() == [1, 3, 5, 7]
    for layout in ("load_balanced", "striped"):  # the ranks' tokens partition the sequence
        got = torch.cat([cp_positions(48, 4, r, layout) for r in range(4)])
        assert sorted(got.tolist()) == list(range(48))
    with pytest.raises(ValueError, match="not a multiple of 2 x the context-parallel size 4"):
        cp_positions(12, 4, 0)
    x = torch.arange(16).view(2, 8)
    assert cp_shard(x, 1, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balanced_layout_gives_every_rank_the_same_causal_work(cp):
    """Counted: the (query, key) pairs under the causal mask per rank are equal in the
    load-balanced layout, within 5% striped, while contiguous slices are far apart."""
    t = 1024
    keys = torch.arange(t)
    lb = [causal_pairs(cp_positions(t, cp, r), keys) for r in range(cp)]
    assert len(set(lb)) == 1 and sum(lb) == t * (t + 1) // 2
    st = [causal_pairs(cp_positions(t, cp, r, "striped"), keys) for r in range(cp)]
    assert max(st) / min(st) <= 1.05
    contiguous = [causal_pairs(keys[r * t // cp:(r + 1) * t // cp], keys) for r in range(cp)]
    assert max(contiguous) / min(contiguous) > 2


def _full(seed, ng):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, T, HS, generator=g)
    k, v = (torch.randn(B, ng, T, HS, generator=g) for _ in range(2))
    dy = torch.randn(B, NH, T, HS, generator=g)
    return q, k, v, dy


def _cp_rank(ps, layout, ng):
    q, k, v, dy = _full(3, ng)
    c, r = ps.cp_size, ps.cp_rank
    mine = [cp_shard(t, 2, c, r, layout).clone().requires_grad_() for t in (q, k, v)]
    y = all_gather_attention(*mine, ps.cp_group, T, layout, enable_gqa=ng < NH)
    y.backward(cp_shard(dy, 2, c, r, layout))
    return y.detach(), [t.grad for t in mine], ps.comm_stats.snapshot()


@pytest.mark.parametrize("cp,layout,ng", [(2, "load_balanced", NH), (4, "load_balanced", 2),
                                           (4, "striped", NH)])
def test_all_gather_attention_is_one_process_attention(cp, layout, ng):
    q, k, v, dy = (t.clone() for t in _full(3, ng))
    for t in (q, k, v):
        t.requires_grad_()
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=ng < NH)
    y.backward(dy)
    # world 4 for both sizes (at CP 2 the two DP replicas do the same work): the pool's
    # CP layouts are built once for the whole suite
    res = run_ranks(_cp_rank, world_size=4, cp=cp, args=(layout, ng))
    for rank, (y_r, grads, comm) in enumerate(res):
        r = rank % cp  # (CP is inside DP in the layout: rank = dp_rank * cp + cp_rank)
        want = [cp_shard(t, 2, cp, r, layout) for t in (y, q.grad, k.grad, v.grad)]
        for got, ref in zip([y_r, *grads], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        # K and V gathered once each, their gradients reduce-scattered once each
        assert comm["all_gather"] > 0 and comm["reduce_scatter"] > 0


@pytest.mark.parametrize("layout", ["load_balanced", "striped"])
def test_rope_on_a_cp_shard_uses_global_positions(layout):
    """Splitting QKV with RoPE on a CP rank's tokens, given their global positions, is
    the full sequence's split restricted to those tokens, forward and backward."""
    from hybrid.kernels.rotary import Rotary, split_qkv
    g = torch.Generator().manual_seed(7)
    groups, per, hs, cp = 2, 2, 8, 4
    qkv = torch.randn(B, T, groups * (per + 2) * hs, generator=g, requires_grad=True)
    rot = Rotary(hs, 10000.0)
    full = split_qkv(qkv, per, hs, rot)
    grads = [torch.randn(t.shape, generator=g) for t in full]
    torch.autograd.backward(full, grads)
    for r in range(cp):
        pos = cp_positions(T, cp, r, layout)
        mine = cp_shard(qkv.detach(), 1, cp, r, layout).requires_grad_()
        got = split_qkv(mine, per, hs, rot, positions=pos)
        for a, b in zip(got, full, strict=True):
            torch.testing.assert_close(a, cp_shard(b.detach(), 2, cp, r, layout))
        torch.autograd.backward(got, [cp_shard(d, 2, cp, r, layout) for d in grads])
        torch.testing.assert_close(mine.grad, cp_shard(qkv.grad, 1, cp, r, layout))
