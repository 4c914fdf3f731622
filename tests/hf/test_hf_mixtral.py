"""Hugging Face Mixtral round trip: a tiny ``MixtralForCausalLM`` made and saved by
transformers itself (GQA, 4 experts, 2 a token) imports into hybrid as a Llama with
``--num-experts 4 --moe-router-topk 2`` with the same logits and the same 32 greedy
tokens, trains from there under ZeRO 2 at DP 2, and exports back to
``MixtralForCausalLM`` bit for bit; transformers 4's per-expert names import too. What a
Mixtral cannot hold, or hybrid cannot express, is refused naming the flag or field."""


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


def _mixtral_config(**kw):
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, rope_parameters={
            "rope_type": "default", "rope_theta": 50000.0}, rms_norm_eps=1e-5,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw)


def _tiny_mixtral(tmp_path, **kw):
    return saved_tiny(transformers.MixtralForCausalLM, _mixtral_config(**kw),
                      str(tmp_path / "mixtral"))


def test_mixtral_from_transformers_imports_trains_and_exports_exactly(tmp_path, capsys):
    hf, hf_dir = _tiny_mixtral(tmp_path, output_router_logits=True, router_aux_loss_coef=0.02)
    save, out = str(tmp_path / "imported"), str(tmp_path / "exported")
    assert script_module("import_hf").main([hf_dir, save]) == 0
    printed = capsys.readouterr().out
    assert ("--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size "
            "48 --moe-aux-loss-coeff 0.02") in printed, printed
    model = _hybrid(save)
    assert tuple(model.blocks[1].mlp.experts.fc.shape) == (4, 96, 64)
    greedy = _assert_same_model(hf, model, VOCAB)
    assert len(set(greedy[8:])) > 1, greedy  # not one token repeated
    # trains from the import (DP 2, ZeRO 2): the flags it printed are the ones to pass
    trains_from_import(printed, save)
    back = exported_exactly(hf, save, out, "Mixtral", capsys)
    assert back.config.num_local_experts == 4 and back.config.router_aux_loss_coef == 0.02
    _assert_same_model(back, model, VOCAB)


def test_transformers_4_per_expert_names_import_alike(tmp_path):
    """``block_sparse_moe.experts.<j>.w1 / w3 / w2`` (the layout transformers 4 saved)."""
    from hybrid.hf.mixtral import from_hf_mixtral
    hf, _ = _tiny_mixtral(tmp_path)
    now = {k: v for k, v in hf.state_dict().items()}
    old = {k: v for k, v in now.items() if ".mlp." not in k}
    for i in range(2):
        src, dst = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        old[dst + "gate.weight"] = now[src + "gate.weight"]
        for j in range(4):
            gate, up = now[src + "experts.gate_up_proj"][j].chunk(2)
            old[f"{dst}experts.{j}.w1.weight"], old[f"{dst}experts.{j}.w3.weight"] = gate, up
            old[f"{dst}experts.{j}.w2.weight"] = now[src + "experts.down_proj"][j]
    hc = hf.config.to_dict()
    a, b = from_hf_mixtral(now, hc), from_hf_mixtral(old, hc)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change, field", [
    ({"sliding_window": 16}, "sliding_window"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
])
def test_mixtral_import_refuses_what_hybrid_cannot_express(tmp_path, capsys, change, field):
    refused_on_import(dict(_mixtral_config().to_dict(), **change), field, tmp_path, capsys)


@pytest.mark.parametrize("extra, said", [
    ({"moe_shared_expert_intermediate_size": 8}, "--moe-shared-expert-intermediate-size 8: "
                                                 "a Hugging Face Mixtral has no such option"),
    ({"moe_layer_freq": "[0, 1]"}, "--moe-layer-freq [0, 1]: a Hugging Face Mixtral's every "
                                   "layer is MoE"),
])
def test_an_moe_model_mixtral_cannot_hold_refuses_to_export(tmp_path, capsys, extra, said):
    refused_on_export(extra, said, tmp_path, capsys)
