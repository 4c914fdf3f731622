"""Hugging Face Qwen3 and Qwen3-MoE round trips: tiny ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` made and saved by transformers itself -- heads 32 wide on a
hidden size of 64 with 4 heads (``head_dim``: hybrid's --kv-channels, not hidden /
heads), q and k RMS-normalized per head (--qk-layernorm), GQA -- import into hybrid with
the same logits and the same greedy tokens, and both export back bit for bit (the
same attention at TP 2 with SP and under CP: tests/models/test_llama.py,
tests/models/test_gpt_context_parallel.py). The MoE one: routed experts only,
both routers (``norm_topk_prob`` off, --moe-router-pre-softmax, and on), dense layers by
``mlp_only_layers`` and ``decoder_sparse_step``, the router loss. What a Qwen3 cannot
hold, or hybrid cannot express, is refused naming the flag or the field."""


import pytest
import torch

from tests.helpers.launch import script_module
from tests.hf.test_hf_llama import (
    VOCAB,
    _assert_same_model,
    _hybrid,
    _tokens,
    exported_exactly,
    refused_on_export,
    refused_on_import,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

# 4 query heads and 2 key/value heads of 32 channels on a hidden size of 64
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
         "rms_norm_eps": 1e-5, "initializer_range": 0.3, "bos_token_id": None,
         "eos_token_id": None, "pad_token_id": None}


def _qwen3_config(**kw):
    return transformers.Qwen3Config(**{**SHAPE, "num_hidden_layers": 2, **kw})


def _moe_config(**kw):
    return transformers.Qwen3MoeConfig(**{
        **SHAPE, "num_hidden_layers": 3, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "mlp_only_layers": [0], **kw})


def _saved(model_class, config, folder: str):
    """``model_class(config)`` drawn from seed 1, in eval mode, saved by transformers in
    ``folder``. The q and k norms start at one, which would hide a norm read into the
    wrong place: each gets its own values first."""
    torch.manual_seed(1)
    hf = model_class(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape))
    hf.save_pretrained(folder)
    return hf, folder


def _same_logits(back, hf):
    """The exported model computes what the original does: its tensors are the same bits
    (``exported_exactly``), so equal logits show its config.json says the same model
    (head_dim, the norms' epsilon, RoPE, the router) -- without generating again."""
    x = _tokens(VOCAB)
    with torch.no_grad():
        assert torch.equal(back(x).logits, hf(x).logits)


def _imported(hf_dir, save, capsys):
    assert script_module("import_hf").main([hf_dir, save]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen3_from_transformers_imports_and_exports_exactly(tmp_path, tie, capsys):
    hf, hf_dir = _saved(transformers.Qwen3ForCausalLM, _qwen3_config(tie_word_embeddings=tie),
                        str(tmp_path / "qwen3"))
    save, out = str(tmp_path / "imported"), str(tmp_path / "exported")
    printed = _imported(hf_dir, save, capsys)
    assert "--num-attention-heads 4 --kv-channels 32 " in printed, printed
    assert "--group-query-attention --num-query-groups 2" in printed, printed
    assert printed.rstrip().endswith("--disable-bias-linear --qk-layernorm"), printed
    assert ("--untie-embeddings-and-output-weights" in printed) == (not tie)
    model = _hybrid(save)
    attn = model.blocks[1].attn
    assert tuple(attn.qkv.weight.shape) == ((4 + 2 * 2) * 32, 64) and attn.qkv.bias is None
    assert tuple(attn.proj.weight.shape) == (64, 4 * 32)
    assert torch.equal(attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight)
    greedy = _assert_same_model(hf, model, VOCAB)
    assert len(set(greedy[8:])) > 1, greedy  # not one token repeated
    back = exported_exactly(hf, save, out, "Qwen3", capsys)
    assert back.config.head_dim == 32 and back.config.tie_word_embeddings == tie
    assert back.config.layer_types == ["full_attention"] * 2
    _same_logits(back, hf)


@pytest.mark.parametrize("router", ["pre_softmax", "renormalized"])
def test_qwen3_moe_from_transformers_imports_and_exports_exactly(tmp_path, router, capsys):
    """``norm_topk_prob`` off (--moe-router-pre-softmax), a dense first layer and the router
    loss; or on (hybrid's default router) with ``decoder_sparse_step`` 2."""
    kw = ({"norm_topk_prob": False, "output_router_logits": True, "router_aux_loss_coef": 0.02}
          if router == "pre_softmax" else
          {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []})
    hf, hf_dir = _saved(transformers.Qwen3MoeForCausalLM, _moe_config(**kw),
                        str(tmp_path / "qwen3_moe"))
    save, out = str(tmp_path / "imported"), str(tmp_path / "exported")
    printed = _imported(hf_dir, save, capsys)
    pre = router == "pre_softmax"
    for flag in ("--kv-channels 32", "--qk-layernorm", "--num-experts 4",
                 "--moe-router-topk 2", "--moe-ffn-hidden-size 32", "--ffn-hidden-size 96",
                 "--moe-layer-freq [0,1,1]" if pre else "--moe-layer-freq [0,1,0]"):
        assert flag in printed, (flag, printed)
    assert ("--moe-router-pre-softmax" in printed) == pre
    assert ("--moe-aux-loss-coeff 0.02" in printed) == pre
    assert "shared" not in printed and "--add-qkv-bias" not in printed
    model = _hybrid(save)
    assert tuple(model.blocks[1].mlp.experts.fc.shape) == (4, 64, 64)
    assert model.blocks[1].mlp.shared is None
    greedy = _assert_same_model(hf, model, VOCAB)
    assert len(set(greedy[8:])) > 1, greedy
    back = exported_exactly(hf, save, out, "Qwen3Moe", capsys)
    assert back.config.norm_topk_prob == (not pre)
    assert back.config.mlp_only_layers == ([0] if pre else [0, 2])
    _same_logits(back, hf)


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"head_dim": 0}, "head_dim"),
])
def test_qwen3_import_refuses_what_hybrid_cannot_express(tmp_path, capsys, change, field):
    refused_on_import(dict(_qwen3_config().to_dict(), **change), field, tmp_path, capsys)


def test_qwen3_moe_import_refuses_attention_biases(tmp_path, capsys):
    refused_on_import(dict(_moe_config().to_dict(), attention_bias=True), "attention_bias",
                      tmp_path, capsys)


@pytest.mark.parametrize("extra, said", [
    ({"qk_layernorm": True, "moe_shared_expert_intermediate_size": 8},
     "--moe-shared-expert-intermediate-size 8: a Hugging Face Qwen3-MoE has no such option"),
    ({"qk_layernorm": True, "moe_router_pre_softmax": True, "moe_expert_capacity_factor": 1.5},
     "--moe-expert-capacity-factor 1.5: a Hugging Face Qwen3-MoE has no such option"),
    ({"qk_layernorm": True, "disable_bias_linear": False},
     "a Hugging Face Qwen3-MoE has no biases: it needs --disable-bias-linear"),
    ({"moe_shared_expert_intermediate_size": 8, "moe_shared_expert_gate": True,
      "qk_layernorm": True}, "--moe-shared-expert-intermediate-size 8: a Hugging Face "
                             "Qwen3-MoE has no such option"),
])
def test_a_model_qwen3_moe_cannot_hold_refuses_to_export(tmp_path, capsys, extra, said):
    refused_on_export(extra, said, tmp_path, capsys)


def test_kv_channels_is_head_dim_in_every_llama_shaped_export():
    """--kv-channels without --qk-layernorm is no Qwen3: a Llama (or Qwen2, Qwen2-MoE,
    Mixtral) whose ``head_dim`` is written; one with --qk-layernorm is refused by them."""
    from hybrid.errors import CheckpointError
    from hybrid.hf.llama import llama_hf_config, qwen2_hf_config
    c = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "swiglu": True,
         "normalization": "RMSNorm", "position_embedding_type": "rope",
         "disable_bias_linear": True, "ffn_hidden_size": 16, "max_position_embeddings": 16}
    assert llama_hf_config(c, 257)["head_dim"] == 4
    assert llama_hf_config(dict(c, kv_channels=16), 257)["head_dim"] == 16
    assert qwen2_hf_config(dict(c, kv_channels=16, add_qkv_bias=True), 257)["head_dim"] == 16
    with pytest.raises(CheckpointError, match="--qk-layernorm: a Hugging Face Llama has no "):
        llama_hf_config(dict(c, qk_layernorm=True), 257)


@pytest.mark.parametrize("extra, said", [
    ({"qk_layernorm": True, "add_qkv_bias": True},
     "a Hugging Face Qwen3 has no biases: it needs --disable-bias-linear and no "
     "--add-qkv-bias"),
    ({"qk_layernorm": True, "normalization": "LayerNorm"},
     "neither GPT-2 nor Llama-shaped: a Hugging Face Qwen3 needs --normalization RMSNorm"),
])
def test_a_dense_model_qwen3_cannot_hold_refuses_to_export(tmp_path, capsys, extra, said):
    from hybrid.checkpoint.single_rank import write_unsharded_checkpoint
    odd = str(tmp_path / "odd")
    write_unsharded_checkpoint(odd, {}, {"num_layers": 0, "hidden_size": 8,
                                         "num_attention_heads": 1, "swiglu": True,
                                         "normalization": "RMSNorm",
                                         "position_embedding_type": "rope",
                                         "disable_bias_linear": True, **extra}, 257)
    capsys.readouterr()
    assert script_module("export_hf").main([odd, str(tmp_path / "odd_hf")]) == 2
    assert said in capsys.readouterr().err


def test_qk_layernorm_refuses_to_export_as_a_family_without_q_k_norms(tmp_path, capsys):
    """A GPT-2-shaped model with --qk-layernorm is no GPT-2 (its norms would be dropped):
    it goes the Llama-shaped way and is refused naming what that needs."""
    from hybrid.checkpoint.single_rank import write_unsharded_checkpoint
    odd = str(tmp_path / "odd")
    write_unsharded_checkpoint(odd, {}, {"num_layers": 0, "hidden_size": 8,
                                         "num_attention_heads": 1, "qk_layernorm": True},
                               257)
    capsys.readouterr()
    assert script_module("export_hf").main([odd, str(tmp_path / "odd_hf")]) == 2
    assert "a Hugging Face Qwen3 needs --normalization RMSNorm" in capsys.readouterr().err
