"""The MoE flags (hybrid/config/moe.py): Megatron's names into ``ModelConfig.moe``, the
layer pattern, and each bad combination one ConfigError naming the flag to change."""

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.moe import MoEConfig, moe_layer_pattern
from hybrid.errors import ConfigError

MOE = ["--num-layers", "4", "--num-experts", "8"]


def _cfg(*argv: str, world: int = 1):
    return build_config(parse_args(list(argv)), world_size=world)


def test_megatrons_flags_fill_the_models_moe_section():
    cfg = _cfg(*MOE, "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
               "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
               "--moe-ffn-hidden-size", "96", "--moe-layer-freq", "([0]*1+[1]*1)*2",
               "--moe-permute-fusion", "--moe-router-dtype", "fp32")
    moe = cfg.model.moe
    assert isinstance(moe, MoEConfig) and moe.num_experts == 8 and moe.moe_router_topk == 2
    assert moe.moe_aux_loss_coeff == 1e-2 and cfg.model.expert_ffn_size == 96
    assert moe.layers(4) == (False, True, False, True)
    assert [cfg.model.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert "--moe-permute-fusion" in cfg.flags.ignored_megatron_flags
    assert _cfg("--num-layers", "4").model.moe is None


def test_the_saved_config_reads_back_as_the_same_section():
    from hybrid.config.model import ModelConfig
    cfg = _cfg(*MOE, "--moe-z-loss-coeff", "1e-3")
    saved = cfg.to_dict()
    assert ModelConfig.from_flags(saved).moe == cfg.model.moe
    dense = {k: v for k, v in saved.items() if not k.startswith(("num_experts", "moe_"))}
    assert ModelConfig.from_flags(dense).moe is None  # (a checkpoint older than MoE)


@pytest.mark.parametrize(("freq", "layers", "want"), [
    ("1", 3, (True, True, True)), ("2", 5, (True, False, True, False, True)),
    ("[0, 1, 1]", 3, (False, True, True)), ("([1]*2+[0])*2", 6, (True, True, False) * 2)])
def test_the_layer_pattern_is_megatrons(freq, layers, want):
    assert moe_layer_pattern(freq, layers) == want


@pytest.mark.parametrize(("argv", "said"), [
    (["--moe-aux-loss-coeff", "0.1"], "--moe-aux-loss-coeff: options of MoE layers, and the "
                                      "model has none: add --num-experts N"),
    ([*MOE, "--moe-router-topk", "9"], "--moe-router-topk 9 is more than --num-experts 8"),
    ([*MOE, "--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor must be > 0"),
    ([*MOE, "--moe-expert-capacity-factor", "-1"], "--moe-expert-capacity-factor must be > 0"),
    ([*MOE, "--moe-layer-freq", "[1, 0]"], "names 2 layers; the model has --num-layers 4"),
    ([*MOE, "--moe-layer-freq", "[1, 2, 0, 1]"], "a list must hold 0s and 1s only"),
    ([*MOE, "--moe-layer-freq", "__import__('os')"], "give an int N or a list of 0/1"),
    ([*MOE, "--moe-router-enable-expert-bias"], "add --moe-router-score-function sigmoid"),
    ([*MOE, "--moe-router-load-balancing-type", "sinkhorn"], "no Sinkhorn routing"),
    ([*MOE, "--moe-router-num-groups", "2"], "--moe-router-num-groups without "
                                             "--moe-router-group-topk"),
    ([*MOE, "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups 3 does not divide --num-experts 8"),
    ([*MOE, "--moe-router-num-groups", "2", "--moe-router-group-topk", "4"],
     "--moe-router-group-topk 4 is more than --moe-router-num-groups 2"),
    ([*MOE, "--moe-router-topk", "3", "--moe-router-num-groups", "4",
      "--moe-router-group-topk", "2"], "--moe-router-topk 3 must split evenly over "
                                       "--moe-router-group-topk 2 groups of 2 experts each"),
    ([*MOE, "--moe-unknown-thing", "1"], "hybrid's MoE layers do not have this option"),
    ([*MOE, "--expert-model-parallel-size", "3"], "--num-experts 8 is not divisible by "
                                                  "--expert-model-parallel-size 3"),
    ([*MOE, "--moe-router-dtype", "fp64"], "hybrid decides routing in fp32"),
    ([*MOE, "--moe-pad-expert-input-to-capacity"], "add --moe-expert-capacity-factor"),
])
def test_each_bad_moe_combination_names_the_flag(argv, said):
    with pytest.raises(ConfigError) as e:
        _cfg(*argv)
    assert said in str(e.value), str(e.value)


def test_moe_under_tp_needs_the_sequence_parallel_split_and_folds_ep_over_tp_and_cp():
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 2 with "
                                          r"--num-experts: .*add --sequence-parallel"):
        _cfg(*MOE, "--tensor-model-parallel-size", "2", world=2)
    cfg = _cfg(*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--context-parallel-size", "2", "--expert-model-parallel-size", "4", world=4)
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size,
            cfg.parallel.expert_model_parallel_size) == (2, 2, 4)


def test_etp_splits_whole_hidden_units_and_etp_x_ep_fits_a_stage():
    cfg = _cfg(*MOE, "--moe-ffn-hidden-size", "96", "--expert-tensor-parallel-size", "2",
               "--expert-model-parallel-size", "2", world=4)
    assert cfg.parallel.expert_tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"--moe-ffn-hidden-size 96 \(each expert's hidden "
                                          r"units\) is not divisible by "
                                          r"--expert-tensor-parallel-size 5"):
        _cfg(*MOE, "--moe-ffn-hidden-size", "96", "--expert-tensor-parallel-size", "5", world=5)
    with pytest.raises(ConfigError, match=r"--expert-tensor-parallel-size 2 x "
                                          r"--expert-model-parallel-size 4 = 8 does not divide"):
        _cfg(*MOE, "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "4",
             world=4)


def test_ep_must_fit_a_pipeline_stage():
    assert _cfg(*MOE, "--expert-model-parallel-size", "4", world=4).parallel \
        .expert_model_parallel_size == 4
    with pytest.raises(ConfigError, match=r"--expert-tensor-parallel-size 1 x "
                                          r"--expert-model-parallel-size 4 = 4 does not divide "
                                          r"a pipeline stage's 2 ranks"):
        _cfg(*MOE, "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
             world=4)
