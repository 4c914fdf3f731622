"""PP as the outermost dimension: rank = ((pp * DP + dp) * CP + cp) * TP + tp.

The arithmetic at PP 2 and 4 against the formula, the groups a ParallelState builds (gloo at
4 ranks; torch's fake process group at 1,024: PP 8 x TP 8 x DP 16), the embedding group of
the first and last stages, the stage neighbours, and PP 1 leaving every rank and group as
it was.
"""

import datetime

import pytest
import torch
import torch.distributed as dist

from hybrid.errors import ConfigError
from hybrid.parallel.layout import KINDS, Layout, check_layout
from hybrid.parallel.state import ParallelState
from tests.helpers.harness import run_ranks


def _scan_groups(layout: Layout, kind: str) -> list[list[int]]:
    """The groups of ``kind`` found the slow way: ranks sharing every coordinate the kind
    does not vary, grouped in rank order (the reference for Layout.groups)."""
    vary = KINDS[kind]
    groups: dict[tuple, list[int]] = {}
    for r in range(layout.world_size):
        c = layout.coords_of(r)
        key = tuple(v for name, v in zip("tcdp", c) if name not in vary)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


@pytest.mark.parametrize("world,tp,cp,pp", [(8, 2, 1, 2), (16, 2, 2, 2), (16, 1, 1, 4),
                                            (32, 2, 2, 4), (24, 3, 1, 4), (8, 2, 2, 1)])
def test_rank_order_and_groups_follow_the_formula(world, tp, cp, pp):
    lay = Layout(world, tp, cp, pp)
    dp = world // (tp * cp * pp)
    assert lay.dp == dp == check_layout(world, tp, cp, pp)
    seen = set()
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    r = lay.rank_of(t, c, d, p)
                    assert r == ((p * dp + d) * cp + c) * tp + t
                    assert lay.coords_of(r) == (t, c, d, p)
                    seen.add(r)
    assert seen == set(range(world))
    for kind in KINDS:
        groups = lay.groups(kind)
        assert groups == _scan_groups(lay, kind), kind
        for g in groups:  # a rank's own group, found without listing the others
            assert all(lay.group_of(kind, r) == g for r in g)
    # a stage spans whole blocks of world / PP consecutive ranks: whole nodes
    stage = world // pp
    assert all(lay.coords_of(r).pp == r // stage for r in range(world))


def test_the_issues_example_at_pp_2():
    lay = Layout(8, tp=2, pp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.embedding_groups() == lay.groups("pp")  # PP 2: first and last are all


def test_embedding_groups_and_stage_neighbours_at_pp_4():
    lay = Layout(16, tp=2, pp=4)  # DP 2, stages of 4 ranks
    assert lay.group_of("pp", 1) == [1, 5, 9, 13]
    assert lay.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert lay.embedding_group_of(13) == [1, 13] and lay.embedding_group_of(5) == [5]
    assert lay.stage_neighbours(5) == (1, 9)
    assert lay.stage_neighbours(1) == (13, 5) and lay.stage_neighbours(13) == (9, 1)  # a ring
    one = Layout(4, tp=2)  # PP 1: a rank is its own pipeline
    assert one.embedding_group_of(3) == [3] and one.stage_neighbours(3) == (3, 3)


def test_pp_1_groups_are_todays():
    """The TP x CP x DP groups as the code before PP listed them (tests/parallel/
    test_parallel_state.py holds the same lists)."""
    from hybrid.parallel.layout import cp_group_ranks, dp_cp_group_ranks, dp_group_ranks
    assert dp_group_ranks(8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert cp_group_ranks(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dp_cp_group_ranks(8, 2, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert Layout(8, 2, 2).groups("pp") == [[r] for r in range(8)]


def test_a_pp_that_does_not_divide_is_named():
    with pytest.raises(ConfigError, match=r"^--pipeline-model-parallel-size 3 does not divide "
                                          r"the world size 8 \(nodes x processes per node\): "
                                          r"use one of 1, 2, 4, 8$"):
        check_layout(8, 1, 1, 3)
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size 2 x "
                                          r"--context-parallel-size 2 x "
                                          r"--pipeline-model-parallel-size 4 = 16 does not "
                                          r"divide the world size 8"):
        check_layout(8, 2, 2, 4)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size must be >= 1"):
        Layout(8, pp=0)


# -- the groups a ParallelState builds --------------------------------------------------------

def _pipeline_groups(ps):
    out = {}
    for name in ("tp", "dp", "pp", "embedding", "dp_cp"):
        g = getattr(ps, f"{name}_group")
        x = torch.tensor([float(ps.rank)])
        g.all_reduce(x)
        out[name] = (g.ranks, x.item())
    out["stage"] = (ps.pp_size, ps.pp_rank, ps.is_first_stage, ps.is_last_stage,
                    ps.in_embedding_group, ps.prev_stage_rank, ps.next_stage_rank)
    out["describe"] = ps.describe()
    return out


def test_gloo_groups_at_pp_4_and_their_collectives():
    """World 4 as one pipeline of 4 stages: the PP group is the world in stage order, the
    embedding group the ends, a middle stage's embedding group itself; an all-reduce over
    each stays inside it."""
    res = run_ranks(_pipeline_groups, world_size=4, pp=4)
    for rank, r in enumerate(res):
        assert r["pp"] == ([0, 1, 2, 3], 6.0)
        ends = [0, 3] if rank in (0, 3) else [rank]
        assert r["embedding"] == (ends, float(sum(ends)))
        assert r["tp"] == r["dp"] == r["dp_cp"] == ([rank], float(rank))
        assert r["stage"] == (4, rank, rank == 0, rank == 3, rank in (0, 3),
                              (rank - 1) % 4, (rank + 1) % 4)
    assert "world 4 = TP 1 x DP 1 x PP 4" in res[0]["describe"]
    assert "embedding groups: [[0, 3]]" in res[0]["describe"]


def test_single_process_state_is_one_whole_pipeline():
    ps = ParallelState.single()
    assert (ps.pp_size, ps.pp_rank, ps.is_first_stage, ps.is_last_stage) == (1, 0, True, True)
    assert ps.embedding_group.ranks == [0] and ps.prev_stage_rank == ps.next_stage_rank == 0
    ps.embedding_group.all_reduce(torch.ones(2))  # one rank: returns at once
    ps.close()


# -- 1,024 ranks through torch's fake process group ------------------------------------------

@pytest.fixture
def fake_world(monkeypatch):
    """Join a fake world of ``size`` ranks as ``rank`` (no peers exist: every collective
    returns at once); the group creations are recorded, each as its ranks and whether
    only its members create it (``use_local_synchronization``). Left again after the
    test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls: list[tuple[list[int], bool]] = []
    real = dist.new_group

    def new_group(ranks, **kw):
        calls.append((list(ranks), kw.get("use_local_synchronization", False)))
        return real(ranks, **kw)

    monkeypatch.setattr(dist, "new_group", new_group)

    def join(rank: int, size: int):
        calls.clear()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        return calls

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def test_pp8_tp8_dp16_builds_its_groups_at_1024_ranks(fake_world):
    """PP 8 x TP 8 x DP 16: every rank of one pipeline (and one more) builds its state; each
    group is the layout's, and a rank creates only its own groups (the time to build
    is the bench's to measure: python -m benchmarks.bench_pipeline_scale prints it)."""
    lay = Layout(1024, tp=8, pp=8)
    assert lay.dp == 16
    for rank in [*lay.group_of("pp", 517), 1023]:
        calls = fake_world(rank, 1024)
        ps = ParallelState.build(8, pipeline_model_parallel_size=8)
        try:
            assert (ps.tp_size, ps.dp_size, ps.pp_size, ps.cp_size) == (8, 16, 8, 1)
            assert ps.tp_group.ranks == lay.group_of("tp", rank)
            assert ps.dp_group.ranks == lay.group_of("dp", rank)
            assert ps.pp_group.ranks == lay.group_of("pp", rank)
            assert ps.embedding_group.ranks == lay.embedding_group_of(rank)
            assert (ps.prev_stage_rank, ps.next_stage_rank) == lay.stage_neighbours(rank)
            assert ps.pp_rank == rank // 128 and ps.tp_rank == rank % 8
            # each rank creates its own group of each kind, only its members taking part
            # (not the 128 TP, 64 DP, 128 PP and 128 embedding groups of the world); a
            # middle stage's embedding group is itself alone, with no process group
            assert calls == [(lay.group_of(k, rank), True) for k in ("tp", "dp", "pp")] + [
                (lay.embedding_group_of(rank), True)]
            assert (ps.embedding_group.pg is None) == (0 < ps.pp_rank < 7)
        finally:
            ps.release()
            dist.destroy_process_group()


def test_pp_1_creates_the_same_groups_in_the_same_order_as_before(fake_world):
    """No PP group, no embedding group: the process groups (and so every collective
    numbering and test that depends on them) are those of TP x CP x DP."""
    calls = fake_world(5, 16)
    ps = ParallelState.build(2, context_parallel_size=2)
    try:
        lay = Layout(16, 2, 2)
        assert calls == [(lay.group_of(k, 5), True) for k in ("tp", "dp", "cp", "dp_cp")]
        assert [c[0] for c in calls] == [[4, 5], [1, 5, 9, 13], [5, 7],
                                         [1, 3, 5, 7, 9, 11, 13, 15]]
        assert ps.pp_group.ranks == ps.embedding_group.ranks == [5] and ps.pp_group.pg is None
    finally:
        ps.release()


# -- groups made by their members alone (use_local_synchronization) -----------------------

_LAYOUTS = ((2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4), (4, 1, 1), (1, 4, 1))


def _every_kind(tp: int, cp: int, pp: int) -> dict:
    """This rank's ranks and all-reduced rank sum over each kind's group."""
    ps = ParallelState.build(tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                             timeout=datetime.timedelta(seconds=60))
    try:
        out = {}
        for name in ("tp", "cp", "dp", "dp_cp", "pp", "embedding", "world"):
            g = getattr(ps, f"{name}_group")
            x = torch.tensor([float(ps.rank)])
            g.all_reduce(x)
            out[name] = (g.ranks, x.item())
        return out
    finally:
        ps.release()


def _layouts_in_one_world(ps, first_only_on: list[int]) -> dict:
    """Every layout of _LAYOUTS built in turn in this world, after the ranks in
    ``first_only_on`` made a group of their own (so the ranks hold unequal numbers of
    groups, which member-only creation cannot take: build falls back); the warnings."""
    import warnings

    if first_only_on and ps.rank in first_only_on:
        dist.new_group(first_only_on, use_local_synchronization=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = {lay: _every_kind(*lay) for lay in _LAYOUTS}
    return {"res": res, "warned": [str(w.message) for w in seen
                                   if "process groups" in str(w.message)]}


def _both_ways(ps) -> dict:
    """_layouts_in_one_world with no groups made before, then after ranks 0 and 1 made
    one: two scenarios in one fresh world (the first leaves every rank as many groups)."""
    return {"local": _layouts_in_one_world(ps, []),
            "fallback": _layouts_in_one_world(ps, [0, 1])}


def test_gloo_groups_of_every_layout_at_world_4():
    """Six layouts built one after another on four gloo ranks: each group is the layout's
    and an all-reduce over it sums its ranks. With no groups made before, no rank falls
    back (a middle stage's one-rank embedding group keeps the counts equal build after
    build); after ranks 0 and 1 made one, every build falls back to every rank creating
    every group, and still gives the same groups."""
    res = run_ranks(_both_ways, world_size=4, reuse=False)
    for rank, both in enumerate(res):
        for way, r in both.items():
            assert len(r["warned"]) == (len(_LAYOUTS) if way == "fallback" else 0), \
                (way, r["warned"])
            for (tp, cp, pp), got in r["res"].items():
                lay = Layout(4, tp, cp, pp)
                want = {k: lay.group_of(k, rank) for k in ("tp", "cp", "dp", "dp_cp", "pp")}
                want["embedding"] = lay.embedding_group_of(rank)
                want["world"] = [0, 1, 2, 3]
                for name, ranks in want.items():
                    assert got[name] == (ranks, float(sum(ranks))), \
                        (way, rank, (tp, cp, pp), name)
