"""Hugging Face Qwen2-MoE round trip: a tiny ``Qwen2MoeForCausalLM`` made and saved by
transformers itself (GQA, q/k/v biases, 4 experts with 3 a token, a gated shared expert,
a dense first layer) imports into hybrid with the same logits and the same greedy
tokens, trains from there under ZeRO 2 at DP 2, and exports back to
``Qwen2MoeForCausalLM`` bit for bit; both routers (``norm_topk_prob`` off, Qwen1.5-MoE's,
and on) and ``decoder_sparse_step`` too. transformers 4's per-expert names import alike.
What a Qwen2-MoE cannot hold is refused naming the flag."""


import pytest
import torch

from tests.helpers.launch import script_module
from tests.hf.test_hf_llama import (
    VOCAB,
    _assert_same_model,
    _hybrid,
    exported_exactly,
    refused_on_export,
    refused_on_import,
    saved_tiny,
    trains_from_import,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")


def _config(**kw):
    return transformers.Qwen2MoeConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 3,
        "mlp_only_layers": [0], "rope_parameters": {"rope_type": "default",
                                                    "rope_theta": 50000.0},
        "rms_norm_eps": 1e-5, "initializer_range": 0.3, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None, **kw})


def _tiny(tmp_path, **kw):
    return saved_tiny(transformers.Qwen2MoeForCausalLM, _config(**kw),
                      str(tmp_path / "qwen2_moe"))


def test_qwen2_moe_from_transformers_imports_trains_and_exports_exactly(tmp_path, capsys):
    hf, hf_dir = _tiny(tmp_path, output_router_logits=True, router_aux_loss_coef=0.02)
    save, out = str(tmp_path / "imported"), str(tmp_path / "exported")
    assert script_module("import_hf").main([hf_dir, save]) == 0
    printed = capsys.readouterr().out
    for flag in ("--add-qkv-bias", "--num-experts 4", "--moe-router-topk 3",
                 "--moe-ffn-hidden-size 32", "--moe-router-pre-softmax",
                 "--moe-layer-freq [0,1,1]", "--moe-shared-expert-intermediate-size 48",
                 "--moe-shared-expert-gate", "--moe-aux-loss-coeff 0.02"):
        assert flag in printed, (flag, printed)
    model = _hybrid(save)
    assert tuple(model.blocks[1].mlp.experts.fc.shape) == (4, 64, 64)
    assert tuple(model.blocks[1].mlp.shared.gate.shape) == (1, 64)
    greedy = _assert_same_model(hf, model, VOCAB)
    assert len(set(greedy[8:])) > 1, greedy  # not one token repeated
    # trains from the import (DP 2, ZeRO 2): the flags it printed are the ones to pass
    trains_from_import(printed, save)
    back = exported_exactly(hf, save, out, "Qwen2Moe", capsys)
    assert back.config.mlp_only_layers == [0] and back.config.norm_topk_prob is False
    _assert_same_model(back, model, VOCAB)


def test_the_renormalized_router_and_a_sparse_step_round_trip(tmp_path, capsys):
    """``norm_topk_prob`` (hybrid's default router) and ``decoder_sparse_step`` 2 (MoE on
    layer 1 only, the others dense), no q/k/v biases."""
    hf, hf_dir = _tiny(tmp_path, norm_topk_prob=True, decoder_sparse_step=2,
                       mlp_only_layers=[], qkv_bias=False)
    save, out = str(tmp_path / "imported"), str(tmp_path / "exported")
    assert script_module("import_hf").main([hf_dir, save]) == 0
    printed = capsys.readouterr().out
    assert "--moe-layer-freq [0,1,0]" in printed and "--moe-router-pre-softmax" not in printed
    assert "--add-qkv-bias" not in printed
    model = _hybrid(save)
    _assert_same_model(hf, model, VOCAB)
    back = exported_exactly(hf, save, out, "Qwen2Moe", capsys)
    assert back.config.mlp_only_layers == [0, 2] and back.config.norm_topk_prob is True


def test_transformers_4_per_expert_names_import_alike(tmp_path):
    from hybrid.hf.qwen2_moe import from_hf_qwen2_moe
    hf, _ = _tiny(tmp_path)
    now = dict(hf.state_dict())
    old = {k: v for k, v in now.items() if ".mlp.experts." not in k}
    for i in (1, 2):
        src = f"model.layers.{i}.mlp.experts."
        for j in range(4):
            gate, up = now[src + "gate_up_proj"][j].chunk(2)
            old[f"{src}{j}.gate_proj.weight"], old[f"{src}{j}.up_proj.weight"] = gate, up
            old[f"{src}{j}.down_proj.weight"] = now[src + "down_proj"][j]
    hc = hf.config.to_dict()
    a, b = from_hf_qwen2_moe(now, hc), from_hf_qwen2_moe(old, hc)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_qwen2_moe_import_refuses_sliding_windows(tmp_path, capsys):
    refused_on_import(dict(_config().to_dict(), use_sliding_window=True),
                      "use_sliding_window", tmp_path, capsys)


def test_a_model_qwen2_moe_cannot_hold_refuses_to_export(tmp_path, capsys):
    refused_on_export({"moe_shared_expert_intermediate_size": 8, "moe_shared_expert_gate": True,
                       "moe_expert_capacity_factor": 1.5},
                      "--moe-expert-capacity-factor 1.5: a Hugging Face Qwen2-MoE has no such "
                      "option", tmp_path, capsys)
