"""Hugging Face's Qwen3 and Qwen3-MoE as hybrid flags and ``config.json`` files.

A ``Qwen3ForCausalLM`` is a Llama-shaped model without biases whose attention heads are
``head_dim`` wide (hybrid's ``--kv-channels`` when that is not hidden / heads) and whose
query and key heads are each RMS-normalized over their ``head_dim`` channels before
RoPE (``--qk-layernorm``; one weight vector for q and one for k per layer, the
model's ``rms_norm_eps``). A ``Qwen3MoeForCausalLM`` is that attention with a
Qwen2-MoE's routed experts and no shared expert: ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob`` (True:
hybrid's default router, the softmax of the top k logits; False:
``--moe-router-pre-softmax``), ``decoder_sparse_step`` and ``mlp_only_layers`` as
``--moe-layer-freq``'s list, ``router_aux_loss_coef`` as ``--moe-aux-loss-coeff`` when
``output_router_logits`` trains with it.

The weights are named as Llama's and Qwen2-MoE's, so the tensor mapping is theirs
(:func:`hybrid.hf.llama.from_hf_llama` and ``to_hf_llama`` carry ``self_attn.q_norm``
and ``k_norm``; :mod:`hybrid.hf.qwen2_moe` the experts); this module holds only the
configs. What a Qwen3 cannot hold is refused naming the flag on export, and what
hybrid cannot express naming the field on import. Pure dict functions: no
torch.distributed, no transformers import.
"""

from __future__ import annotations

from hybrid.errors import CheckpointError
from hybrid.hf.llama import (
    _hf_shape_config,
    _llama_shape_flags,
    check_full_attention,
    llama_shaped,
)
from hybrid.hf.qwen2_moe import checked_moe, routed_expert_config, routed_expert_flags


def _qwen3_attention_flags(hc: dict) -> dict:
    """The flags a Qwen3 and a Qwen3-MoE ``config.json`` share; CheckpointError naming
    the field for sliding windows and for ``attention_bias`` (biases on q, k, v and o
    with none in the MLP, which hybrid's bias flags cannot say)."""
    check_full_attention(hc)
    if hc.get("attention_bias", False):
        raise CheckpointError("config.json: attention_bias is true; hybrid biases the "
                              "attention's output projection only with the MLP's "
                              "(--disable-bias-linear covers both)")
    return dict(_llama_shape_flags(hc), disable_bias_linear=True, qk_layernorm=True)


def qwen3_flags(hc: dict) -> dict:
    """hybrid's flags for a Qwen3 ``config.json``."""
    return _qwen3_attention_flags(hc)


def qwen3_moe_flags(hc: dict) -> dict:
    """hybrid's flags for a Qwen3-MoE ``config.json``: the Qwen3 attention and the
    routed experts (a Qwen3-MoE has no shared expert)."""
    return dict(_qwen3_attention_flags(hc), **routed_expert_flags(hc))


def _qwen3_shape(c: dict, vocab_size: int, family: str) -> dict:
    """The ``config.json`` keys a Qwen3 and a Qwen3-MoE share; CheckpointError naming the
    flag for what neither holds (biases, no q/k norms)."""
    f = llama_shaped(c, family)
    if not f["qk_layernorm"]:
        raise CheckpointError(f"a Hugging Face {family} normalizes q and k: it needs "
                              f"--qk-layernorm")
    if f["add_bias_linear"] or f["add_qkv_bias"]:
        raise CheckpointError(f"a Hugging Face {family} has no biases: it needs "
                              f"--disable-bias-linear and no --add-qkv-bias")
    _, shape = _hf_shape_config(c, vocab_size, family, qk_norm=True)
    return dict(shape, attention_bias=False, use_sliding_window=False, sliding_window=None)


def qwen3_hf_config(c: dict, vocab_size: int) -> dict:
    """``config.json`` of ``Qwen3ForCausalLM`` for a hybrid saved config ``c``: full
    attention on every layer."""
    layers = c["num_layers"]
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            **_qwen3_shape(c, vocab_size, "Qwen3"), "max_window_layers": layers,
            "layer_types": ["full_attention"] * layers}


def qwen3_moe_hf_config(c: dict, vocab_size: int) -> dict:
    """``config.json`` of ``Qwen3MoeForCausalLM`` for a hybrid saved config ``c`` (an MoE
    model with --qk-layernorm); CheckpointError naming the flag for what a Qwen3-MoE
    cannot hold (a shared expert, another router, a capacity, biases)."""
    moe = checked_moe(c, "Qwen3-MoE", also=("moe_shared_expert_intermediate_size",
                                            "moe_shared_expert_gate"))
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            **_qwen3_shape(c, vocab_size, "Qwen3-MoE"), **routed_expert_config(moe, c)}
