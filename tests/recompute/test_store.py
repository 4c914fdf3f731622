"""The activation checkpoint store (hybrid/recompute/store.py): partitioned over TP
with padding, on the host, in contiguous slots allocated once; misuse raises."""

import pytest
import torch

from hybrid.recompute.checkpointing import CheckpointStore
from tests.helpers.harness import run_ranks


def _store_round_trip(ps):
    x = torch.arange(105, dtype=torch.float32).view(3, 5, 7)  # 105 = 4 * 27 - 3
    store = CheckpointStore(ps, partition=True, cpu=True, contiguous=True, num_slots=2)
    s0, s1 = store.stash(0, x), store.stash(1, x * 2)
    held = store.stored_bytes()
    back1 = store.restore(s1).clone()
    back0 = store.restore(s0).clone()
    s2 = store.stash(0, x[:1])  # a smaller input reuses slot 0
    again = store.restore(s2).clone()
    return held, back0, back1, again, store.allocations, store.stored_bytes()


def test_partition_pads_sizes_that_do_not_divide_by_tp():
    """105 elements over TP 4: chunks of 27, the last rank's holds 24 real ones."""
    x = torch.arange(105, dtype=torch.float32).view(3, 5, 7)
    for held, back0, back1, again, allocs, left in run_ranks(_store_round_trip, world_size=4,
                                                             tp=4):
        assert held == 2 * 27 * 4 and left == 0
        assert torch.equal(back0, x) and torch.equal(back1, 2 * x) and torch.equal(again, x[:1])
        assert allocs == {"gather": 1, "staging": 1, "contiguous": 1, "tensor": 0}


def test_misuse_fails_loudly_instead_of_wrong_gradients():
    """In-place change of a held input, and a second restore, raise."""
    from hybrid.parallel.state import ParallelState
    store = CheckpointStore(ParallelState.single(), partition=False, cpu=False,
                            contiguous=False, num_slots=1)
    x = torch.ones(2, 3)
    s = store.stash(0, x)
    assert store.stored_bytes() == 24 and store.allocations["tensor"] == 0  # x itself
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        store.restore(s)
    with pytest.raises(RuntimeError, match="already restored"):
        store.restore(s)
