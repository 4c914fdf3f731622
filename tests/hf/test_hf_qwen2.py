"""Hugging Face Qwen2 round trip: a tiny ``Qwen2ForCausalLM`` made and saved by
transformers itself (GQA, tied and untied, nonzero q/k/v biases) imports into
hybrid as ``--disable-bias-linear --add-qkv-bias`` with the same logits and the
same 32 greedy tokens, loads at TP 2 under ZeRO-3 with those logits, and exports
back to ``Qwen2ForCausalLM`` bit for bit. What hybrid cannot express (sliding
windows, other rope types, a head_dim that is no width) is refused naming the field."""


import pytest
import torch

from tests.helpers.launch import script_module
from tests.hf.test_hf_llama import (
    VOCAB,
    _assert_same_model,
    _hybrid,
    assert_same_at_tp2,
    exported_exactly,
    refused_on_import,
)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")


def _qwen2_config(tie, **kw):
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, initializer_range=0.3, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **kw)


def _tiny_qwen2(tmp_path, tie):
    """transformers initializes biases to zero, which would hide a dropped or misplaced
    bias: each q, k and v bias gets its own nonzero values before saving."""
    torch.manual_seed(1)
    hf = transformers.Qwen2ForCausalLM(_qwen2_config(tie)).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    hf_dir = str(tmp_path / f"qwen2_tie{tie}")
    hf.save_pretrained(hf_dir)
    return hf, hf_dir


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen2_from_transformers_imports_and_exports_exactly(tmp_path, tie, capsys):
    hf, hf_dir = _tiny_qwen2(tmp_path, tie)
    save, out = str(tmp_path / "imported"), str(tmp_path / "exported")
    assert script_module("import_hf").main([hf_dir, save]) == 0
    printed = capsys.readouterr().out
    assert ("--swiglu --position-embedding-type rope --rotary-base 50000.0 "
            "--group-query-attention --num-query-groups 2") in printed, printed
    assert printed.rstrip().endswith("--disable-bias-linear --add-qkv-bias"), printed
    assert ("--untie-embeddings-and-output-weights" in printed) == (not tie)
    model = _hybrid(save)
    assert model.blocks[0].attn.qkv.bias is not None and model.blocks[0].attn.proj.bias is None
    greedy = _assert_same_model(hf, model, VOCAB)
    assert len(set(greedy[8:])) > 1, greedy  # not one token repeated
    if tie:  # the imported QKV biases at TP 2 (one query group per rank), ZeRO-3
        from hybrid.hf.llama import qwen2_flags
        flags = qwen2_flags(hf.config.to_dict())
        assert_same_at_tp2(hf, save, flags)
    back = exported_exactly(hf, save, out, "Qwen2", capsys)
    assert back.config.tie_word_embeddings == tie and not back.config.use_sliding_window
    assert back.config.layer_types == ["full_attention"] * 2
    _assert_same_model(back, model, VOCAB)


@pytest.mark.parametrize("change, field", [
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"head_dim": -8}, "head_dim"),  # (another positive head_dim is --kv-channels)
])
def test_qwen2_import_refuses_what_hybrid_cannot_express(tmp_path, capsys, change, field):
    """config.json alone: refused before any weight is read, nothing written."""
    refused_on_import(dict(_qwen2_config(False).to_dict(), **change), field, tmp_path, capsys)


def test_qwen2_flags_that_are_not_llama_shaped_refuse_to_export(tmp_path, capsys):
    from hybrid.checkpoint.single_rank import write_unsharded_checkpoint
    odd = str(tmp_path / "odd")
    write_unsharded_checkpoint(odd, {}, {"num_layers": 0, "hidden_size": 8,
                                         "num_attention_heads": 1, "swiglu": True,
                                         "position_embedding_type": "rope",
                                         "disable_bias_linear": True, "add_qkv_bias": True},
                               257)
    capsys.readouterr()
    assert script_module("export_hf").main([odd, str(tmp_path / "odd_hf")]) == 2
    assert ("neither GPT-2 nor Llama-shaped: a Hugging Face Qwen2 needs --normalization "
            "RMSNorm") in capsys.readouterr().err
