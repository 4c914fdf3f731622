"""The 2D layout: TP ranks adjacent, DP groups strided; collectives stay in their group."""

import pytest
import torch

from hybrid.errors import ConfigError
from hybrid.parallel.state import check_layout, dp_group_ranks, tp_group_ranks

from harness import run_ranks


def _layout(ps):
    x = torch.tensor([float(ps.rank)])
    ps.tp_group.all_reduce(x)
    y = torch.tensor([float(ps.rank)])
    ps.dp_group.all_reduce(y)
    return {"tp": ps.tp_group.ranks, "dp": ps.dp_group.ranks, "tp_rank": ps.tp_rank,
            "dp_rank": ps.dp_rank, "sizes": (ps.tp_size, ps.dp_size), "tp_sum": x.item(),
            "dp_sum": y.item()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_and_group_collectives(tp):
    res = run_ranks(_layout, world_size=4, tp=tp)
    for rank, r in enumerate(res):
        assert rank == r["dp_rank"] * tp + r["tp_rank"]
        assert r["tp"] == [rank // tp * tp + i for i in range(tp)]
        assert r["dp"] == list(range(rank % tp, 4, tp))
        assert r["sizes"] == (tp, 4 // tp)
        assert r["tp_sum"] == sum(r["tp"]) and r["dp_sum"] == sum(r["dp"])


def test_layout_arithmetic_and_errors():
    assert check_layout(4, 2) == 2
    assert tp_group_ranks(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_group_ranks(8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 3 does not divide "
                                          "the world size 4"):
        check_layout(4, 3)
