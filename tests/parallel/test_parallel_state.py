"""The 2D layout: TP ranks adjacent, DP groups strided; collectives stay in their group."""

import pytest
import torch

from hybrid.errors import ConfigError
from hybrid.parallel.layout import check_layout, dp_group_ranks, tp_group_ranks
from tests.helpers.harness import run_ranks


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


def test_three_dimensional_layout_arithmetic():
    """TP adjacent, then CP, then DP (Megatron's order), and the DP x CP groups ZeRO uses."""
    from hybrid.parallel.layout import coords_of, cp_group_ranks, dp_cp_group_ranks, rank_of
    assert check_layout(8, 2, 2) == 2
    assert tp_group_ranks(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cp_group_ranks(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dp_group_ranks(8, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dp_cp_group_ranks(8, 2, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dp_cp_group_ranks(8, 2) == dp_group_ranks(8, 2)  # CP 1: DP x CP is DP
    for world, tp, cp in ((8, 2, 2), (12, 1, 3), (16, 4, 2)):
        groups = [tp_group_ranks(world, tp, cp), cp_group_ranks(world, tp, cp),
                  dp_group_ranks(world, tp, cp)]
        for g in groups:  # each kind of group partitions the world
            assert sorted(r for grp in g for r in grp) == list(range(world))
        for r in range(world):
            assert rank_of(*coords_of(r, tp, cp), tp, cp) == r
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 2 x "
                                          "--context-parallel-size 3 = 6 does not divide "
                                          "the world size 8"):
        check_layout(8, 2, 3)
    with pytest.raises(ConfigError, match="--context-parallel-size must be >= 1"):
        check_layout(8, 2, 0)


def _cp_layout(ps):
    out = {}
    for name in ("tp", "cp", "dp", "dp_cp"):
        g = getattr(ps, f"{name}_group")
        x = torch.tensor([float(ps.rank)])
        g.all_reduce(x)
        out[name] = (g.ranks, x.item())
    out["coords"] = (ps.tp_rank, ps.cp_rank, ps.dp_rank)
    out["describe"] = ps.describe()
    return out


def test_context_parallel_groups_and_their_collectives():
    """World 4 at CP 2 x DP 2: each group is the layout's, and a collective stays inside
    it. (One layout: building one costs a few seconds of gloo connections per rank;
    the arithmetic test above covers TP > 1.)"""
    from hybrid.parallel.layout import coords_of, cp_group_ranks, dp_cp_group_ranks
    tp = 1
    res = run_ranks(_cp_layout, world_size=4, tp=tp, cp=2)
    want = {"tp": tp_group_ranks(4, tp, 2), "cp": cp_group_ranks(4, tp, 2),
            "dp": dp_group_ranks(4, tp, 2), "dp_cp": dp_cp_group_ranks(4, tp, 2)}
    for rank, r in enumerate(res):
        assert r["coords"] == coords_of(rank, tp, 2)
        for name, groups in want.items():
            mine = next(g for g in groups if rank in g)
            assert r[name] == (mine, float(sum(mine))), (rank, name)
        assert "CP 2" in r["describe"] and "CP groups: " in r["describe"]
