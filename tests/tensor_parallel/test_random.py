"""Dropout under TP: same masks on replicated regions, different ones in split regions."""

import torch
import torch.nn.functional as F

from hybrid.tensor_parallel import seed_all
from tests.helpers.harness import run_ranks


def _masks(ps):
    rng = seed_all(123, ps.tp_rank, ps.dp_rank, ps.device)
    ones = torch.ones(64, 64)
    replicated = F.dropout(ones, 0.5)
    with rng.fork():
        split = F.dropout(ones, 0.5)
    after_fork = F.dropout(ones, 0.5)
    # the same draws without forking: the fork must not disturb the default stream
    seed_all(123, ps.tp_rank, ps.dp_rank, ps.device)
    F.dropout(ones, 0.5)
    no_fork = F.dropout(ones, 0.5)
    saved = rng.get_states()
    with rng.fork():
        a = F.dropout(ones, 0.5)
    rng.set_states(saved)
    with rng.fork():
        b = F.dropout(ones, 0.5)
    return replicated, split, torch.equal(after_fork, no_fork), torch.equal(a, b)


def test_tracker_masks_by_region():
    r = run_ranks(_masks, world_size=4, tp=2)  # TP groups [0,1] [2,3]
    for tp_pair in ((0, 1), (2, 3)):
        i, j = tp_pair
        assert torch.equal(r[i][0], r[j][0]), "replicated region must match across TP"
        assert not torch.equal(r[i][1], r[j][1]), "split region must differ across TP"
    assert not torch.equal(r[0][0], r[2][0]), "DP replicas draw their own masks"
    assert all(x[2] for x in r), "forking changed the default stream"
    assert all(x[3] for x in r), "get_states/set_states must replay the same mask"
