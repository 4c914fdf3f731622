"""Context parallelism's building blocks: which tokens each CP rank holds (equal causal
work), and attention over the split -- ring, all-gather and all-to-all -- against one
process's full attention (outputs and the gradients of q, k and v) at CP 2 and 4, with
and without grouped-query heads and dropout."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel.context_parallel import causal_pairs, cp_positions, cp_shard
from hybrid.tensor_parallel.cp_attention import ContextParallel
from tests.helpers.harness import run_ranks

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


def test_every_rank_computes_the_same_attention_blocks():
    """Counted on the blocks the attention really computes (masked pairs inside a
    causal block included): equal per rank in both layouts, and the load-balanced
    layout computes (2C + 1) / (4C) of the T^2 score matrix (2C - 1 full and 2 causal
    chunk blocks per rank), striped all of it."""
    from hybrid.tensor_parallel.context_parallel import attention_work
    t = 1024
    for cp in (2, 4, 8):
        lb = [attention_work(t, cp, r) for r in range(cp)]
        assert len(set(lb)) == 1 and sum(lb) * 4 * cp == t * t * (2 * cp + 1)
        st = [attention_work(t, cp, r, "striped") for r in range(cp)]
        assert len(set(st)) == 1 and sum(st) == t * t


def _full(seed, ng):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, T, HS, generator=g)
    k, v = (torch.randn(B, ng, T, HS, generator=g) for _ in range(2))
    dy = torch.randn(B, NH, T, HS, generator=g)
    return q, k, v, dy


def _attend(q, k, v, group, comm, layout, dropout):
    torch.manual_seed(11)  # the dropout seed each rank draws: the same everywhere
    return ContextParallel(group, comm, layout).attention(q, k, v, dropout_p=dropout)


def _cp_rank(ps, comm, layout, ng, dropout):
    q, k, v, dy = _full(3, ng)
    c, r = ps.cp_size, ps.cp_rank
    mine = [cp_shard(t, 2, c, r, layout).clone().requires_grad_() for t in (q, k, v)]
    ps.comm_stats.reset()
    y = _attend(*mine, ps.cp_group, comm, layout, dropout)
    y.backward(cp_shard(dy, 2, c, r, layout))
    return y.detach(), [t.grad for t in mine], ps.comm_stats.snapshot()


def _one_process(ng, dropout):
    q, k, v, dy = (t.clone().requires_grad_() for t in _full(3, ng))
    if dropout:  # the layout-free mask: one process through the same blocks
        y = _attend(q, k, v, ParallelState.single().cp_group, "p2p", "load_balanced", dropout)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=ng < NH)
    y.backward(dy.detach())
    return y.detach(), q.grad, k.grad, v.grad


# (comm, CP, layout, K/V heads, dropout): a2a needs heads (and groups) divisible by CP
CASES = [("p2p", 2, "load_balanced", NH, 0.0), ("p2p", 4, "load_balanced", 2, 0.2),
         ("p2p", 4, "striped", NH, 0.0), ("all_gather", 2, "striped", 2, 0.2),
         ("all_gather", 4, "load_balanced", NH, 0.0), ("a2a", 2, "load_balanced", 2, 0.0),
         ("a2a", 4, "striped", NH, 0.2)]
MOVED = {"p2p": "p2p", "all_gather": "all_gather", "a2a": "all_to_all"}


@pytest.mark.parametrize("comm,cp,layout,ng,dropout", CASES)
def test_context_parallel_attention_is_one_process_attention(comm, cp, layout, ng, dropout):
    """Outputs and q/k/v gradients of every comm type equal one process's full causal
    attention within fp32 rounding, GQA and dropout included (dropout's mask depends on
    positions only: the CP ranks draw exactly the one-process mask)."""
    ref = _one_process(ng, dropout)
    # world 4 for both sizes (at CP 2 the two DP replicas do the same work): the pool's
    # CP layouts are built once for the whole suite
    res = run_ranks(_cp_rank, world_size=4, cp=cp, args=(comm, layout, ng, dropout))
    for rank, (y_r, grads, moved) in enumerate(res):
        r = rank % cp  # (CP is inside DP in the layout: rank = dp_rank * cp + cp_rank)
        want = [cp_shard(t, 2, cp, r, layout) for t in ref]
        for got, exp in zip([y_r, *grads], want, strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=2e-6)
        # every byte through the comm door, in its own kind
        assert moved[MOVED[comm]] > 0
        assert sum(moved.values()) == moved[MOVED[comm]] + moved.get("reduce_scatter", 0)


def _half_rank(ps):
    q, k, v, dy = _full(3, NH)
    c, r = ps.cp_size, ps.cp_rank
    out = {}
    for dtype, comm in ((torch.bfloat16, "p2p"), (torch.float16, "all_gather")):
        mine = [cp_shard(t, 2, c, r).to(dtype).requires_grad_() for t in (q, k, v)]
        y = _attend(*mine, ps.cp_group, comm, "load_balanced", 0.0)
        y.backward(cp_shard(dy, 2, c, r).to(dtype))
        out[dtype] = [y.detach(), *(t.grad for t in mine)]
    return out


def test_half_precision_inputs_stay_half_and_match_within_their_rounding():
    """bf16 (ring) and fp16 (all-gather) q, k, v: scores, softmax and accumulators run
    in fp32, outputs and gradients come back in the input dtype and agree with fp32
    attention to its rounding."""
    ref = _one_process(NH, 0.0)
    for rank, res in enumerate(run_ranks(_half_rank, world_size=4, cp=2)):
        want = [cp_shard(t, 2, 2, rank % 2) for t in ref]
        for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 3e-3)):
            for got, exp in zip(res[dtype], want, strict=True):
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), exp, rtol=tol, atol=tol)


def test_ring_moves_kv_c_minus_1_times_forward():
    """Forward: C - 1 hops of [K; V]; backward C - 1 more and C of fp32 [dK; dV]."""
    res = run_ranks(_cp_rank, world_size=4, cp=4, args=("p2p", "load_balanced", NH, 0.0))
    kv = 2 * B * NH * (T // 4) * HS * 4  # one [K; V] block, fp32
    assert res[0][2]["p2p"] == 3 * kv + 3 * kv + 4 * kv


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
