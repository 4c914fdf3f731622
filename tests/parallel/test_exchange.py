"""CommGroup.exchange: batched point-to-point sends and receives between named ranks of a
group, as a pipeline's neighbouring stages trade activations and gradients: the values
arrive, async handles complete on wait, only the sends are counted (p2p bytes), and a
rank with nothing to trade moves nothing."""

import torch

from tests.helpers.harness import run_ranks


def _trade(ps):
    g = ps.world_group
    before = dict(g.stats.bytes)
    mine = torch.arange(6, dtype=torch.float32) + 10 * g.rank
    other = torch.empty(6)
    # both directions in one launch: each rank sends to and receives from the other
    g.exchange([(mine, 1 - g.rank)], [(other, 1 - g.rank)], what="send/recv test")
    got_sync = other.clone()
    # one direction, asynchronously: rank 0 sends two tensors, rank 1 receives them
    a, b = torch.empty(3, 2), torch.empty(4)
    if g.rank == 0:
        work = g.exchange([(torch.ones(3, 2), 1), (torch.full((4,), 7.0), 1)], [],
                          what="send act", async_op=True)
    else:
        work = g.exchange([], [(a, 0), (b, 0)], what="recv act", async_op=True)
    work.wait()
    g.exchange([], [], what="nothing")  # no peer: returns at once
    sent = g.stats.bytes["p2p"] - before["p2p"]
    return got_sync, a, b, sent


def test_exchange_trades_between_named_ranks_and_counts_what_it_sends():
    (r0, _, _, sent0), (r1, a, b, sent1) = run_ranks(_trade, world_size=2)
    assert torch.equal(r0, torch.arange(6.0) + 10) and torch.equal(r1, torch.arange(6.0))
    assert torch.equal(a, torch.ones(3, 2)) and torch.equal(b, torch.full((4,), 7.0))
    assert sent0 == 6 * 4 + 6 * 4 + 4 * 4 and sent1 == 6 * 4  # sends only
