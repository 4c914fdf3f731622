"""The Llama-family flags: Megatron's names map to the model's fields with Megatron's
defaults, bad combinations are one ConfigError naming the flag, and the Llama preset
(examples/pretrain_llama.sh) validates and runs the ZeRO stage the estimator recommends.
Config only: no model is trained here (tests/models/test_llama.py runs the options)."""

import importlib.util
import math
import os
import shlex
from pathlib import Path

import pytest
import torch

from hybrid.config import build_config, parse_args
from hybrid.errors import ConfigError
from tests.helpers.launch import ROOT


# -- flags ----------------------------------------------------------------------------
def _validate(flags, world=4):
    return build_config(parse_args(flags), world)


def test_llama3_rope_scaling_keeps_blends_and_divides_by_wavelength():
    from hybrid.kernels.rotary import llama3_scaled
    f = 2 * math.pi / torch.tensor([100.0, 2047.0, 4096.0, 8193.0, 1e5])  # wavelengths
    want = torch.stack([f[0], f[1], (2 / 3) * f[2] / 8 + (1 / 3) * f[2], f[3] / 8, f[4] / 8])
    torch.testing.assert_close(llama3_scaled(f, 8.0), want, rtol=1e-6, atol=0)


def test_llama_flags_map_to_the_model_and_fill_megatron_defaults():
    cfg = _validate(["--normalization", "RMSNorm", "--swiglu", "--hidden-size", "4096",
                     "--num-attention-heads", "32", "--position-embedding-type", "rope",
                     "--rotary-base", "500000", "--group-query-attention",
                     "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                     "--norm-epsilon", "1e-6"], world=1)
    assert cfg.model.ffn_hidden_size == 10880  # Megatron: int(4 * 4096 * 2 / 3 / 64) * 64
    assert cfg.model.num_query_groups == 1  # Megatron's default with --group-query-attention
    g = cfg.model  # the section GPT is built from
    assert (g.normalization, g.swiglu, g.position_embedding_type, g.rotary_base,
            g.num_query_groups, g.untie_embeddings_and_output_weights, g.add_bias_linear,
            g.norm_epsilon) == ("RMSNorm", True, "rope", 500000.0, 1, True, False, 1e-6)
    assert g.rope_scaling_factor is None and not g.add_qkv_bias and not g.qkv_bias
    scaled = _validate(["--position-embedding-type", "rope", "--use-rope-scaling"], world=1)
    assert scaled.model.rope_scaling_factor == 8.0  # Megatron's default factor
    plain = _validate([], world=1).model  # GPT-2 unchanged
    assert (plain.normalization, plain.swiglu, plain.position_embedding_type,
            plain.query_groups, plain.add_bias_linear, plain.ffn_hidden_size) == \
        ("LayerNorm", False, "learned_absolute", 4, True, 1024)


def test_a_hf_config_without_tie_word_embeddings_is_untied_as_transformers_reads_it():
    from hybrid.hf.llama import llama_flags
    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 96, "max_position_embeddings": 64}
    for model_type in ("llama", "qwen2"):
        hc = dict(base, model_type=model_type)
        assert llama_flags(hc)["untie_embeddings_and_output_weights"] is True, model_type
        assert "untie_embeddings_and_output_weights" not in \
            llama_flags(dict(hc, tie_word_embeddings=True)), model_type


def test_add_qkv_bias_is_megatrons_flag_and_old_checkpoints_read_it_as_off():
    """Qwen2's --disable-bias-linear --add-qkv-bias: the QKV bias alone, through the
    Megatron-flag filter (which refused it before); a saved config without the key
    (a checkpoint from before the flag) reads as no QKV bias."""
    from hybrid.config.architecture import architecture_fields
    from hybrid.config.megatron_flags import split_megatron_flags
    argv = ["--disable-bias-linear", "--add-qkv-bias"]
    assert split_megatron_flags(argv) == (argv, [])
    g = _validate(argv, world=1).model
    assert (g.add_bias_linear, g.add_qkv_bias, g.qkv_bias) == (False, True, True)
    saved = _validate(["--disable-bias-linear"], world=1).to_dict()
    assert "add_qkv_bias" in saved
    del saved["add_qkv_bias"]
    assert architecture_fields(saved)["add_qkv_bias"] is False


def test_openai_gelu_is_megatrons_flag_and_old_checkpoints_read_it_as_on():
    """The exact GELU by default, as Megatron's; --openai-gelu (refused before, when
    the tanh GELU was the only one) through the Megatron-flag filter; a saved config
    without the key (a checkpoint from before the flag, trained with the tanh GELU)
    reads as --openai-gelu."""
    from hybrid.config.architecture import architecture_fields
    from hybrid.config.megatron_flags import split_megatron_flags
    assert split_megatron_flags(["--openai-gelu"]) == (["--openai-gelu"], [])
    assert _validate([], world=1).model.openai_gelu is False
    assert _validate(["--openai-gelu"], world=1).model.openai_gelu is True
    saved = _validate([], world=1).to_dict()
    assert saved["openai_gelu"] is False and architecture_fields(saved)["openai_gelu"] is False
    del saved["openai_gelu"]
    assert architecture_fields(saved)["openai_gelu"] is True


@pytest.mark.parametrize("flags,message", [
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size",
      "4"], "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--group-query-attention", "--tensor-model-parallel-size", "2"],
     "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--normalization", "BatchNorm"], "--normalization must be one of LayerNorm, RMSNorm"),
    (["--position-embedding-type", "alibi"], "--position-embedding-type must be one of"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.01"],
     "RoPE needs an even number"),
    (["--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1]"),
    (["--swiglu", "--hidden-size", "16", "--num-attention-heads", "4"],
     "give --ffn-hidden-size"),
    (["--norm-epsilon", "0"], "--norm-epsilon must be > 0"),
    (["--use-rope-scaling"], "--use-rope-scaling scales RoPE's frequencies: it needs --pos"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor",
      "0.5"], "--rope-scaling-factor must be >= 1"),
    (["--rotary-seq-len-interpolation-factor", "2"], "factor divides RoPE's positions: it needs"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0.5"],
     "--rotary-seq-len-interpolation-factor must be >= 1"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "2",
      "--use-rope-scaling"], "both stretch RoPE to a longer context: give one"),
    (["--swiglu", "--openai-gelu"], "--swiglu's MLP has no GELU: drop one of them"),
])
def test_bad_llama_flags_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _validate(flags)


# -- the preset --------------------------------------------------------------------------
def _preset_flags():
    """The flags examples/pretrain_llama.sh passes to scripts/pretrain_gpt.sh."""
    root = ROOT
    text = Path(root, "examples", "pretrain_llama.sh").read_text(encoding="utf-8")
    cmd = text[text.index('pretrain_gpt.sh"') + len('pretrain_gpt.sh"'):]
    return root, [w for w in shlex.split(cmd.replace("\\\n", " ")) if w != "$@"]


@pytest.mark.parametrize("world", [8, 32])
def test_llama_preset_validates_and_runs_the_stage_the_estimator_recommends(world, capsys):
    """Llama-3.2-1B's shape (untied), config only: the flags validate at 8 and 32 ranks,
    and scripts/estimate_memory.py takes them as they are and recommends the preset's
    ZeRO stage for an 80 GiB device."""
    from hybrid.estimate.memory import choose_stage, workload
    root, flags = _preset_flags()
    cfg = build_config(parse_args(flags), world)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups,
            m.ffn_hidden_size, m.rotary_base, m.normalization, m.swiglu,
            m.position_embedding_type, m.untie_embeddings_and_output_weights,
            m.add_bias_linear, cfg.tokenizer.type) == \
        (16, 2048, 32, 8, 8192, 500000.0, "RMSNorm", True, "rope", True, False,
         "HuggingFaceTokenizer")
    w = workload(cfg, 128256)
    assert w.psi == 749_275_136  # per TP rank at TP 2; 1.50B in all
    assert choose_stage(w, 80 * 2 ** 30, runtime_bytes=int(1.5 * 2 ** 30)) == cfg.zero.stage
    spec = importlib.util.spec_from_file_location(
        "estimate_memory", os.path.join(root, "scripts", "estimate_memory.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    assert script.main(flags + ["--world-size", str(world), "--vocab-size", "128256",
                                "--gpu-memory-gb", "80"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"recommended_zero_stage": 1' in last and cfg.zero.stage == 1
