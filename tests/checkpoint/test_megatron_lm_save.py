"""A checkpoint written by Megatron-LM's own ``save_checkpoint`` (not by the Megatron
recorder's rebuild of its contents) is read and continued exactly.

The fixture tests/fixtures/peers/megatron_lm_save/ is recorded by
benchmarks/peers/record_megatron_lm_save.py: Megatron-LM's ``megatron/training`` at the
tag core_v0.16.1 -- its argument parser, ``validate_args``, global variables and
``checkpointing.save_checkpoint`` -- over megatron-core 0.16.1's GPT-2-family GPTModel
and DistributedOptimizer (dp_reshardable, one bucket) at TP 1 x DP 2 on the CPU, after 3
steps, with the losses of megatron-core's next 10. Megatron-LM is not installed in CI, so
the fixture is committed and the recorder regenerates it given ``--megatron-lm DIR``.
"""

from __future__ import annotations

import argparse
import os

import pytest

from hybrid.checkpoint.peers import open_peer
from hybrid.checkpoint.peers.megatron_args import check_run_numbers, tokenizer_vocab
from hybrid.checkpoint.peers.megatron_dist import load_common
from hybrid.errors import CheckpointError
from tests.checkpoint.test_peer_megatron import TOL, _continue, _record
from tests.helpers.harness import run_ranks

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "peers",
                       "megatron_lm_save")


def test_megatron_lm_s_own_save_continues_within_2e_6(tmp_path):
    """hybrid imports Megatron-LM's save at its layout (TP 1 x DP 2, ZeRO 1: the optimizer
    sharded as Megatron's) and its 10 losses equal megatron-core's own continuation's
    within 2e-6, from iteration 3 and the 12 samples consumed."""
    rec = _record(FIXTURE)
    assert rec["writer"] == "megatron.training.checkpointing.save_checkpoint"
    assert (rec["tp"], rec["dp"], rec["distributed_optimizer"]) == (1, 2, "dp_reshardable")
    it, consumed, losses = run_ranks(_continue, world_size=2, tp=1,
                                     args=(FIXTURE, str(tmp_path / "save"), 1, rec))[0]
    assert (it, consumed) == (3, 3 * rec["shape"]["micro"] * rec["dp"])
    diff = max(abs(a - b) for a, b in zip(losses, rec["losses"]))
    assert len(losses) == 10 and diff <= TOL, (diff, losses, rec["losses"])


def test_what_megatron_lm_s_save_holds_beyond_the_recorder_s_is_read_right():
    """Its ``args`` are Megatron-LM's whole Namespace: ``--tokenizer-type NullTokenizer
    --vocab-size 63`` records the vocabulary before the EOD token the tokenizer adds (64
    tokens, the model's 64 rows); ``common.pt`` also holds ``content_metadata`` and the
    FLOPs so far, which change nothing read."""
    peer = open_peer(FIXTURE)
    try:
        assert (peer.args.tokenizer_type, peer.args.vocab_size) == ("NullTokenizer", 63)
        assert peer.vocab_size == 64 == peer.shapes["wte.weight"][0]
        assert (peer.iteration, peer.consumed_samples, peer.step) == (3, 12, 3)
        # (its args hold megatron-core's AttnBackend enum: read as a stub, nothing imported)
        common = load_common(os.path.join(FIXTURE, "iter_0000003"))
        stub = type(common["args"].attention_backend)
        assert stub.__module__ == "hybrid.checkpoint.peers.megatron_files", stub
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
        assert common["num_floating_point_operations_so_far"] > 0
        assert peer.columns == ("master", "exp_avg", "exp_avg_sq")
    finally:
        peer.close()


def test_the_tokenizer_vocabulary_megatron_lm_s_args_record():
    """``vocab_size`` per Megatron-LM's tokenizers: before EOD for the Null ones, the whole
    vocabulary for TikTokenizer's, unused (None) by those read from files; without
    ``tokenizer_type`` as it is."""
    def ns(**kw):
        return argparse.Namespace(**kw)
    assert tokenizer_vocab(ns(tokenizer_type="NullTokenizer", vocab_size=63)) == 64
    assert tokenizer_vocab(ns(tokenizer_type="NullMultimodalTokenizer", vocab_size=9)) == 10
    assert tokenizer_vocab(ns(tokenizer_type="TikTokenizer", vocab_size=131072)) == 131072
    assert tokenizer_vocab(ns(tokenizer_type="GPT2BPETokenizer", vocab_size=50000)) is None
    assert tokenizer_vocab(ns(tokenizer_type="GPT2BPETokenizer", vocab_size=None)) is None
    assert tokenizer_vocab(ns(vocab_size=64)) == 64
    assert tokenizer_vocab(None) is None


def test_the_legacy_format_s_distributed_optimizer_file_is_one_line(tmp_path):
    """Megatron-LM's ``--ckpt-format torch --use-distributed-optimizer`` keeps the
    moments in ``mp_rank_XX/distrib_optim.pt`` beside a ``model_optim_rng.pt`` whose
    optimizer holds param groups only: the reader says in one line that it does not read
    that file (weights only), rather than taking the save for one without optimizer."""
    import shutil

    import torch
    legacy = os.path.join(os.path.dirname(FIXTURE), "megatron_legacy")
    it = tmp_path / "iter_0000003"
    shutil.copytree(os.path.join(legacy, "iter_0000003"), it)
    for rank in sorted(it.iterdir()):
        sd = torch.load(rank / "model_optim_rng.pt", weights_only=False)
        sd["optimizer"] = {"param_groups": sd["optimizer"]["param_groups"]}
        torch.save(sd, rank / "model_optim_rng.pt")
        torch.save({"buckets_coalesced": True}, rank / "distrib_optim.pt")
    peer = open_peer(str(it))
    try:
        assert peer.columns == ("master",)
        lines = [n for n in peer.notes if "distrib_optim.pt" in n]
        assert len(lines) == 1 and "not read" in lines[0], peer.notes
    finally:
        peer.close()


def test_a_norm_epsilon_or_rope_other_than_the_run_s_is_one_error_naming_the_flag():
    """Megatron-LM's args record the norm epsilon (``layernorm_epsilon`` in its own save,
    ``norm_epsilon`` before) and RoPE's base and percent, which hybrid takes from the
    run's flags: another value than the run's is one error naming the flag; the same,
    or a field not recorded, passes. A switch of the same shapes' computation hybrid does
    not have (interleaved RoPE, LayerNorm 1p, squared ReLU) is one error naming it."""
    peer = open_peer(FIXTURE)
    try:
        assert peer.args.layernorm_epsilon == 1e-5 and not hasattr(peer.args, "norm_epsilon")
        peer.configure({"norm_epsilon": 1e-5, "rotary_base": 500000.0})  # (GPT-2: no RoPE)
        with pytest.raises(CheckpointError, match=r"args\.layernorm_epsilon is 1e-05, this "
                           r"run's --norm-epsilon 1e-06: give --norm-epsilon 1e-05"):
            peer.configure({"norm_epsilon": 1e-6})
    finally:
        peer.close()
    rope = argparse.Namespace(position_embedding_type="rope", norm_epsilon=1e-6,
                              rotary_base=500000, rotary_percent=1.0)
    check_run_numbers(rope, {"norm_epsilon": 1e-6, "rotary_base": 5e5}, "x")
    check_run_numbers(rope, {}, "x")
    with pytest.raises(CheckpointError, match=r"x: its args\.rotary_base is 500000, this "
                       r"run's --rotary-base 10000: give --rotary-base 500000"):
        check_run_numbers(rope, {"norm_epsilon": 1e-6, "rotary_base": 1e4}, "x")
    half = argparse.Namespace(position_embedding_type="rope", rotary_percent=0.5)
    with pytest.raises(CheckpointError, match="give --rotary-percent 0.5"):
        check_run_numbers(half, {"rotary_percent": 1.0}, "x")
    for switch in ("rotary_interleaved", "apply_layernorm_1p", "squared_relu"):
        on = argparse.Namespace(position_embedding_type="rope", **{switch: True})
        with pytest.raises(CheckpointError, match=rf"x: its args\.{switch} is on"):
            check_run_numbers(on, {}, "x")
