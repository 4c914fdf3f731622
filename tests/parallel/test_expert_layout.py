"""The MoE layers' rank layout (hybrid/parallel/layout.py, [Note: the expert layout]):
Megatron's parallel folding, written out by hand for small worlds, and equal to
megatron-core's own RankGenerator on many settings (a peer test); the dense and the
expert layout hold the same ranks in each pipeline stage; a layout that does not fit is
one ConfigError naming the flags."""

import itertools

import pytest

from hybrid.errors import ConfigError
from hybrid.parallel.layout import ExpertLayout, Layout


def test_ep_4_of_8_ranks_by_hand():
    e = ExpertLayout(8, ep=4)
    assert e.edp == 2 and e.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert e.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert e.coords_of(6) == (0, 2, 1, 0) and e.group_of("edp", 6) == [2, 6]


def test_etp_2_ep_2_pp_2_of_16_ranks_by_hand():
    e = ExpertLayout(16, etp=2, ep=2, pp=2)
    assert e.edp == 2
    assert e.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                               [14, 15]]
    assert e.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                              [13, 15]]
    assert e.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                               [11, 15]]
    assert e.groups("etp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # the pipeline groups are the dense layout's: a stage holds the same ranks
    assert e.groups("pp") == Layout(16, tp=2, pp=2).groups("pp")


SETTINGS = [(w, etp, ep, pp) for w in (1, 2, 4, 8, 16, 32, 64) for etp, ep, pp in
            itertools.product((1, 2, 4), (1, 2, 4, 8), (1, 2, 4))
            if w % (etp * ep * pp) == 0]


@pytest.mark.parametrize(("world", "tp", "cp", "pp"), [
    (w, tp, cp, pp) for w in (8, 16, 32) for tp, cp, pp in
    itertools.product((1, 2, 4), (1, 2), (1, 2, 4)) if w % (tp * cp * pp) == 0])
def test_every_expert_layout_of_a_dense_layout_keeps_the_stages(world, tp, cp, pp):
    """For every ETP x EP that fits a stage, each expert group lies inside one pipeline
    stage, and the stages are the dense layout's."""
    dense = Layout(world, tp, cp, pp)
    stage = {r: dense.coords_of(r).pp for r in range(world)}
    for etp, ep in itertools.product((1, 2, 4), (1, 2, 4, 8)):
        if (world // pp) % (etp * ep):
            continue
        e = ExpertLayout(world, etp, ep, pp)
        assert e.groups("pp") == dense.groups("pp")
        for kind in ("etp", "ep", "edp", "etp_ep"):
            for g in e.groups(kind):
                assert len({stage[r] for r in g}) == 1, (kind, g)


@pytest.mark.peer("megatron.core")
def test_the_groups_are_megatron_cores_on_many_settings():
    """megatron-core's RankGenerator for the expert layout (its initialize_model_parallel's
    ``expert_decoder_rank_generator``: tp=ETP, ep=EP, dp=EDP, pp=PP, cp=1, the default
    order "tp-cp-ep-dp-pp"), group by group."""
    from megatron.core.parallel_state import RankGenerator
    names = {"etp": "tp", "ep": "ep", "edp": "dp", "etp_ep": "tp-ep", "pp": "pp"}
    for world, etp, ep, pp in SETTINGS:
        e = ExpertLayout(world, etp, ep, pp)
        theirs = RankGenerator(tp=etp, ep=ep, dp=e.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for kind, name in names.items():
            assert e.groups(kind) == sorted(theirs.get_ranks(name)), (world, etp, ep, pp, kind)
    assert len(SETTINGS) > 100


@pytest.mark.parametrize(("args", "said"), [
    ((8, 1, 3, 1), "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 3 = 3 does "
                   "not divide a pipeline stage's 8 ranks"),
    ((8, 2, 4, 2), "= 8 does not divide a pipeline stage's 4 ranks (the world size 8 / "
                   "--pipeline-model-parallel-size 2): use one of 1, 2, 4"),
    ((8, 1, 0, 1), "--expert-model-parallel-size must be >= 1, got 0"),
])
def test_a_layout_that_does_not_fit_names_the_flags(args, said):
    with pytest.raises(ConfigError) as e:
        ExpertLayout(*args)
    assert said in str(e.value), str(e.value)
