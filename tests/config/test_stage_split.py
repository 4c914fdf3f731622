"""The stage split: Megatron's flags -> the layers of every (virtual) stage.

Each case is written out by hand from Megatron-Core's rules (get_num_layers_to_build and
the layer offsets; PipelineParallelLayerLayout), and every bad split is one ConfigError
naming the flags to change. Torch-free and fast.
"""

import pytest

from hybrid.config.stage_split import StageSplit, parse_layout, split_layers
from hybrid.errors import ConfigError


def _ranges(split: StageSplit) -> list[list[tuple[int, int]]]:
    """[rank][chunk] -> (first layer, count)."""
    return [[(split.layer_ids(p, v).start, len(split.layer_ids(p, v)))
             for v in range(split.vpp)] for p in range(split.pp)]


def test_even_split_gives_consecutive_slices_in_rank_order():
    s = split_layers(8, 4)
    assert (s.pp, s.vpp, s.layers) == (4, 1, (2, 2, 2, 2))
    assert [list(s.layer_ids(p)) for p in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.holds_embedding(0) and not s.holds_embedding(1)
    assert s.holds_loss(3) and not s.holds_loss(2)
    assert split_layers(5, 1).layers == (5,)  # PP 1: one stage holds everything


def test_interleaving_walks_chunk_zero_of_every_rank_first():
    """8 layers, PP 2, V 2: rank 0 holds [0, 1] and [4, 5], rank 1 [2, 3] and [6, 7]
    (Megatron's example); the loss is on the last chunk of the last rank."""
    s = split_layers(8, 2, 2)
    assert _ranges(s) == [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]
    assert s.holds_loss(1, 1) and not s.holds_loss(1, 0) and s.holds_embedding(0, 0)
    assert s.piece(1, 1) == 3 and s.rank_layers(0) == 4
    # --num-layers-per-virtual-pipeline-stage 1: 4 layers per rank -> 4 chunks of 1
    s = split_layers(8, 2, layers_per_virtual_stage=1)
    assert s.vpp == 4 and _ranges(s)[0] == [(0, 1), (2, 1), (4, 1), (6, 1)]
    # the filled flags re-check: the same size twice is fine, two sizes are not
    assert split_layers(8, 2, 4, layers_per_virtual_stage=1) == s
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage 1 makes 4 "
                                          "chunks .* but --virtual-pipeline-model-parallel"
                                          "-size is 2: keep one"):
        split_layers(8, 2, 2, layers_per_virtual_stage=1)


def test_accounting_for_embedding_and_loss_takes_a_layer_off_the_ends():
    # 14 + 2 = 16 places over 4 ranks: 4 each; the first and last give one up
    s = split_layers(14, 4, account_for_embedding=True, account_for_loss=True)
    assert s.layers == (3, 4, 4, 3) and s.num_layers == 14
    # with chunks, only the first chunk of rank 0 and the last of the last rank
    s = split_layers(6, 2, 2, account_for_embedding=True, account_for_loss=True)
    assert _ranges(s) == [[(0, 1), (3, 2)], [(1, 2), (5, 1)]]
    # a chunk may be left with the embedding alone (Megatron allows 0 layers there)
    assert split_layers(3, 4, account_for_embedding=True).layers == (0, 1, 1, 1)
    with pytest.raises(ConfigError, match=r"--num-layers 30 \+ 1 "
                                          r"\(--account-for-embedding-in-pipeline-split\) is "
                                          r"not divisible by --pipeline-model-parallel-size 4"):
        split_layers(30, 4, account_for_embedding=True)


def test_uneven_first_and_last_stages():
    # Megatron's arithmetic: 30 layers, first 6, last 8: 16 over the 2 between
    s = split_layers(30, 4, first=6, last=8)
    assert s.layers == (6, 8, 8, 8) and s.layer_ids(3) == range(22, 30)
    assert split_layers(30, 4, first=9).layers == (9, 7, 7, 7)
    assert split_layers(30, 4, last=3).layers == (9, 9, 9, 3)
    # with V chunks each count is cut in V: first 4 -> 2 + 2, middle 8 -> 4 + 4, last 4
    s = split_layers(24, 3, 2, first=4, last=4)
    assert _ranges(s) == [[(0, 2), (12, 2)], [(2, 8), (14, 8)], [(10, 2), (22, 2)]]
    assert split_layers(6, 2, first=2, last=4).layers == (2, 4)  # PP 2: no stage between


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_layers=30, pp=4), "--num-layers 30 is not divisible by "
     "--pipeline-model-parallel-size 4: set --decoder-first-pipeline-num-layers / "
     "--decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout"),
    (dict(num_layers=8, pp=2, vpp=3), "the 4 layers of each pipeline stage (--num-layers 8 / "
     "--pipeline-model-parallel-size 2) do not split into "
     "--virtual-pipeline-model-parallel-size 3 equal chunks"),
    (dict(num_layers=8, pp=2, layers_per_virtual_stage=3),
     "--num-layers-per-virtual-pipeline-stage 3 does not divide the 4 layers"),
    (dict(num_layers=30, pp=4, first=6, last=8, account_for_loss=True),
     "are exclusive"),
    (dict(num_layers=30, pp=4, first=6, layers_per_virtual_stage=2),
     "give the chunks per rank with --virtual-pipeline-model-parallel-size"),
    (dict(num_layers=30, pp=4, first=0), "--decoder-first-pipeline-num-layers must be >= 1"),
    (dict(num_layers=30, pp=4, first=7, last=8), "the 15 layers after "
     "--decoder-first-pipeline-num-layers 7 + --decoder-last-pipeline-num-layers 8 "
     "(--num-layers 30) are not divisible by the 2 stages between"),
    (dict(num_layers=8, pp=2, first=3, last=4), "= 7 of --num-layers 8: 1 layer left with "
     "no stage (--pipeline-model-parallel-size 2 has none between)"),
    (dict(num_layers=8, pp=3, first=4, last=4), "the 1 stage between get no layers"),
    (dict(num_layers=8, pp=2, first=6, last=4), "= 10 is more than --num-layers 8"),
    (dict(num_layers=12, pp=2, vpp=2, first=3, last=9),
     "--decoder-first-pipeline-num-layers 3 does not split into "
     "--virtual-pipeline-model-parallel-size 2"),
    (dict(num_layers=22, pp=4, vpp=2, first=4, last=4),
     "the 7 layers of each stage between the first and last"),
    (dict(num_layers=8, pp=1, first=2, last=6), "need --pipeline-model-parallel-size >= 2"),
    (dict(num_layers=4, pp=2, layout="Ett|ttL", first=2),
     "places every layer itself: drop --decoder-first-pipeline-num-layers"),
    (dict(num_layers=4, pp=2, layout="Ett|ttL", layers_per_virtual_stage=2),
     "each set the virtual pipeline size"),
])
def test_a_split_megatron_refuses_is_one_error_naming_the_flags(kwargs, message):
    n, pp = kwargs.pop("num_layers"), kwargs.pop("pp")
    with pytest.raises(ConfigError) as e:
        split_layers(n, pp, **kwargs)
    assert message in str(e.value)


def test_layout_strings_unroll_as_megatrons():
    assert parse_layout("Ettt|(tt|)*3,tL") == ["Ettt", "tt", "tt", "tt", "tL"]
    assert parse_layout("E|t*3|L") == ["E", "ttt", "L"]
    assert parse_layout("E|t|*2tL") == ["E", "t", "", "tL"]  # 'x*n' repeats a '|' too
    assert parse_layout("((t|)*2t)*2") == ["t", "t", "tt", "t", "t"]  # (groups nest here)


def test_layout_places_each_piece_in_model_order():
    # 4 pieces on PP 2: V 2; piece i is chunk i // 2 of rank i % 2; empty pieces allowed
    s = split_layers(5, 2, layout="Et|tt||ttL")
    assert (s.vpp, s.layers) == (2, (1, 2, 0, 2))
    assert _ranges(s) == [[(0, 1), (3, 0)], [(1, 2), (3, 2)]]
    assert s.how == "--pipeline-model-parallel-layout Et|tt||ttL"
    assert split_layers(4, 1, layout="EttttL").layers == (4,)
    assert split_layers(4, 2, 2, layout="Et|t|t|tL").vpp == 2  # an agreeing size is fine


@pytest.mark.parametrize("layout,message", [
    ("Ett|tL", "places 3 transformer layers ('t'), but --num-layers is 4: each layer needs "
               "one stage"),
    ("Ett|tt|tL", "has 3 stages ('|'-separated), not a multiple of "
                  "--pipeline-model-parallel-size 2"),
    ("tEt|ttL", "'E' (the embedding) must open the first stage"),
    ("Ett|tLt", "'L' (the loss) must close the last stage"),
    ("EEtt|ttL", "holds 2 'E' (embedding): give exactly one"),
    ("Ett|tt", "holds 0 'L' (loss)"),
    ("Ett|tm|tL", "'m' (a multi-token-prediction layer) is not in hybrid"),
    ("Ett|tx|tL", "'x' is not a layout character"),
    ("E(tt|ttL", "'(' without its ')'"),
    ("Ett)|ttL", "unmatched ')'"),
    ("Et*|tttL", "'*' needs a count"),
])
def test_a_bad_layout_is_one_error_naming_the_flag(layout, message):
    with pytest.raises(ConfigError) as e:
        split_layers(4, 2, layout=layout)
    assert str(e.value).startswith(f"--pipeline-model-parallel-layout {layout!r}")
    assert message in str(e.value)
    with pytest.raises(ConfigError, match="has 4 stages = --pipeline-model-parallel-size 2 x "
                                          "2 virtual stages, but "
                                          "--virtual-pipeline-model-parallel-size is 3"):
        split_layers(4, 2, 3, layout="Et|t|t|tL")


def test_the_start_up_text_lists_every_stage():
    text = split_layers(30, 4, first=6, last=8).describe()
    assert text.splitlines() == [
        "layers per pipeline stage (PP 4; 30 layers, --decoder-first-pipeline-num-layers 6 + "
        "--decoder-last-pipeline-num-layers 8):",
        "  stage 0: embedding + 6 layers (0-5)",
        "  stage 1: 8 layers (6-13)",
        "  stage 2: 8 layers (14-21)",
        "  stage 3: 8 layers (22-29) + loss"]
    text = split_layers(5, 2, layout="E|tt|t|ttL").describe()
    assert text.splitlines()[1:] == ["  stage 0: embedding + no layers | 1 layer (2)",
                                     "  stage 1: 2 layers (0-1) | 2 layers (3-4) + loss"]
    assert "2 virtual stages each" in text.splitlines()[0]
