"""An MoE layer's experts split over expert-parallel ranks (models/moe.py with
``ep_group``; the exchange: hybrid/tensor_parallel/experts.py) against the layer with
every expert on one process, in fp64: each rank's outputs, its tokens' input gradients,
the router's gradient (summed over the ranks) and every expert's weight gradients (its
rank's, summed over the ranks holding the same experts) equal the one-process layer's
on all ranks' tokens, to rounding. At EP 2 and EP 4 of 4 ranks, and with a batch routed
so that one rank's experts get no tokens."""

import pytest
import torch

from hybrid.testing.pool import run_ranks
from models.moe import MoE

E, K, C, F, T = 8, 2, 16, 24, 10


def _tokens(rank: int, starve: bool) -> torch.Tensor:
    x = torch.randn(T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    if starve:
        x[:, 0] = 10.0  # with the router below: only experts 0-3 are ever chosen
    return x.requires_grad_()


def _full(starve: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(C, F, E, K, swiglu=True, init_method_std=0.3).double()
    if starve:
        with torch.no_grad():
            moe.router.weight[:4, 0] = 5.0
            moe.router.weight[4:, 0] = -5.0
    return moe


def _ep_vs_one_process(ps, starve: bool):
    full = _full(starve)
    mine = MoE(C, F, E, K, swiglu=True, ep_group=ps.ep_group).double()
    local = E // ps.ep_size
    first = ps.ep_rank * local
    with torch.no_grad():
        mine.router.weight.copy_(full.router.weight)
        mine.fc.copy_(full.fc[first: first + local])
        mine.proj.copy_(full.proj[first: first + local])
    assert mine.fc.ep_spec.full_shape == tuple(full.fc.shape)
    x = _tokens(ps.rank, starve)
    target = torch.randn(T, C, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(100 + ps.rank))
    y, routing = mine(x)
    (y * target).sum().backward()
    # the one-process layer on every rank's tokens (the same on every rank)
    loss = 0
    for r in range(ps.world_size):
        xr = _tokens(r, starve)
        yr, _ = full(xr)
        tr = torch.randn(T, C, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(100 + r))
        loss = loss + (yr * tr).sum()
        if r == ps.rank:
            y_ref, x_ref = yr.detach(), xr
    loss.backward()
    router = mine.router.weight.grad.clone()
    ps.world_group.all_reduce(router)  # every rank's tokens' share
    # (experts that got no rows took no part in the graph: no gradient, i.e. zero)
    fc, proj = (torch.zeros_like(w) if w.grad is None else w.grad.clone()
                for w in (mine.fc, mine.proj))
    ps.edp_group.all_reduce(fc)  # the ranks holding the same experts
    ps.edp_group.all_reduce(proj)
    return {
        "out": float((y.detach() - y_ref).abs().max()),
        "x_grad": float((x.grad - x_ref.grad).abs().max()),
        "router_grad": float((router - full.router.weight.grad).abs().max()),
        "fc_grad": float((fc - full.fc.grad[first: first + local]).abs().max()),
        "proj_grad": float((proj - full.proj.grad[first: first + local]).abs().max()),
        "my_experts_rows": int(routing.tokens_per_expert.sum()),
        "expert_grad_norm": 0.0 if mine.fc.grad is None else float(mine.fc.grad.norm()),
        "all_to_all_bytes": ps.comm_stats.bytes["all_to_all"],
    }


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("starve", [False, True], ids=["spread", "starved"])
def test_experts_over_ep_ranks_are_the_one_process_layer(world, ep, starve):
    results = run_ranks(_ep_vs_one_process, world_size=world, ep=ep, args=(starve,))
    for rank, r in enumerate(results):
        for key in ("out", "x_grad", "router_grad", "fc_grad", "proj_grad"):
            assert r[key] <= 1e-12, (rank, key, r)
        assert r["all_to_all_bytes"] > 0, r
    if starve:  # the last EP rank's experts (4-7 of 8) got no tokens: zero gradients
        for rank, r in enumerate(results):
            assert (r["expert_grad_norm"] == 0.0) == (rank % ep >= ep // 2), (rank, r)


def test_an_experts_slice_draws_the_full_tensors_init():
    """An EP rank's experts start as its slice of the full tensor (block-seeded init): the
    same values at every EP size."""
    from torch import nn

    from hybrid.tensor_parallel.init import Init, local_values
    from hybrid.tensor_parallel.sharding import mark_expert_split
    full = local_values(7, "blocks.1.mlp.experts.fc", Init("normal", 0.1),
                        torch.empty(E, 2 * F, C), 0, E * 2 * F * C).view(E, 2 * F, C)
    for ep in (2, 4):
        for rank in range(ep):
            p = mark_expert_split(nn.Parameter(torch.empty(E // ep, 2 * F, C)),
                                  (E, 2 * F, C), rank, ep)
            got = local_values(7, "blocks.1.mlp.experts.fc", Init("normal", 0.1), p, 0,
                               p.numel()).view(p.shape)
            assert torch.equal(got, full[rank * E // ep: (rank + 1) * E // ep]), (ep, rank)
