"""Megatron's recompute and sequence-parallel flags resolve into one plan, or one error
naming the flag to change."""

import pytest

from hybrid.config import parse_args
from hybrid.errors import ConfigError

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32"]


def _cfg(*flags, world=2, tp=2):
    return parse_args(BASE + ["--tensor-model-parallel-size", str(tp), *flags]).validate(world)


@pytest.mark.parametrize("flags,granularity,num_layers,per_checkpoint", [
    ([], None, None, 1),
    (["--recompute-activations"], "selective", None, 1),  # Megatron's shorthand
    (["--recompute-granularity", "selective"], "selective", None, 1),
    (["--checkpoint-activations"], "full", None, 1),  # the older Megatron name
    (["--recompute-granularity", "full"], "full", None, 1),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "full", None, 1),
    # uniform N: every layer checkpointed, in groups of N that store one input each
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "3"], "full", None, 3),
    (["--checkpoint-activations", "--recompute-method", "uniform",
      "--recompute-num-layers", "4"], "full", None, 4),
    (["--recompute-granularity", "full", "--recompute-num-layers", "3"], "full", 3, 1),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"], "full", 2, 1),
])
def test_recompute_flags_resolve_to_granularity_and_layers(flags, granularity, num_layers,
                                                           per_checkpoint):
    rc = _cfg(*flags).recompute
    assert (rc.granularity, rc.num_layers, rc.layers_per_checkpoint) == (
        granularity, num_layers, per_checkpoint)


def test_distribute_saved_activations_is_partitioning_and_moot_under_sp():
    cfg = _cfg("--recompute-granularity", "full", "--distribute-saved-activations")
    assert cfg.partition_activations and cfg.recompute.partition_activations
    cfg = _cfg("--recompute-granularity", "full", "--distribute-saved-activations",
               "--sequence-parallel")
    assert not cfg.recompute.partition_activations  # the block input is already 1/TP


@pytest.mark.parametrize("flags,message", [
    (["--recompute-granularity", "some"], "--recompute-granularity must be full or selective"),
    (["--recompute-activations", "--recompute-granularity", "full"],
     "--recompute-activations means --recompute-granularity selective"),
    (["--recompute-num-layers", "2"], "need --recompute-granularity full"),
    (["--recompute-activations", "--recompute-method", "block"],
     "need --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "5"],
     "--recompute-num-layers must be in [1, --num-layers 4]"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "0"], "--recompute-num-layers must be in [1, --num-layers 4]"),
    (["--recompute-granularity", "full", "--recompute-method", "every"],
     "--recompute-method must be uniform or block"),
    (["--recompute-activations", "--cpu-checkpointing"],
     "--cpu-checkpointing needs --recompute-granularity full"),
    (["--sequence-parallel", "--seq-length", "33", "--max-position-embeddings", "64"],
     "use a multiple of 2"),
])
def test_bad_recompute_and_sp_flags_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _cfg(*flags)


def test_sequence_parallel_needs_tp():
    with pytest.raises(ConfigError, match="--sequence-parallel needs "
                                          "--tensor-model-parallel-size > 1"):
        _cfg("--sequence-parallel", world=1, tp=1)


@pytest.mark.parametrize("flag", ["--lr", "--min-lr", "--clip-grad", "--hidden-dropout",
                                  "--loss-scale", "--adam-eps", "--init-method-std"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_float_flags_are_refused(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be a finite number"):
        _cfg(f"{flag}={value}")  # "=": argparse reads a bare -inf as a flag
