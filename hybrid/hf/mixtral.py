"""Name and layout mapping between hybrid's Llama-shaped GPT with MoE layers and Hugging
Face's Mixtral.

A ``MixtralForCausalLM`` is a Llama (RMSNorm, RoPE, GQA, untied output, no biases)
whose every MLP is a mixture of ``num_local_experts`` SwiGLU experts, each token sent to
``num_experts_per_tok`` of them: hybrid's ``--num-experts N --moe-router-topk K`` with the
softmax router (Mixtral's softmax over all experts, then the top k renormalized, is the
softmax of the top k logits: the same gates). The attention and norms map as
:mod:`hybrid.hf.llama` maps them; the experts' weights are stacked alike on both sides,
expert first:

* router: ``mlp.gate.weight`` ``(E, C)`` is ``mlp.experts.router.weight``;
* up-projections: ``mlp.experts.gate_up_proj`` ``(E, 2F, C)``, each expert's rows
  ``[gate; up]``, is ``mlp.experts.fc`` (hybrid's SwiGLU halves in the same order);
* down-projections: ``mlp.experts.down_proj`` ``(E, C, F)`` is ``mlp.experts.proj``.

transformers 4's per-expert names (``block_sparse_moe.gate``,
``block_sparse_moe.experts.<j>.w1 / w3 / w2``) are read too. Pure tensor and dict
functions: no torch.distributed, no transformers import.
"""

from __future__ import annotations

import torch

from hybrid.config.moe import MoEConfig
from hybrid.errors import CheckpointError
from hybrid.hf.llama import (
    _hf_shape_config,
    _llama_shape_flags,
    from_hf_llama,
    hf_getter,
    to_hf_llama,
)


def mixtral_flags(hc: dict) -> dict:
    """hybrid's flags for a Mixtral ``config.json``; CheckpointError naming the field for
    what hybrid cannot express (a sliding window, router jitter)."""
    if hc.get("sliding_window") is not None:
        raise CheckpointError(f"config.json: sliding_window {hc['sliding_window']}; hybrid's "
                              f"attention is full causal attention on every layer")
    if float(hc.get("router_jitter_noise") or 0.0) != 0.0:
        raise CheckpointError("config.json: router_jitter_noise is not 0; hybrid's router "
                              "takes its input as it is")
    flags = dict(_llama_shape_flags(hc), disable_bias_linear=True,
                 num_experts=hc["num_local_experts"],
                 moe_router_topk=hc["num_experts_per_tok"],
                 moe_ffn_hidden_size=hc["intermediate_size"])
    if hc.get("output_router_logits") and hc.get("router_aux_loss_coef"):
        flags["moe_aux_loss_coeff"] = float(hc["router_aux_loss_coef"])
    return flags


def from_hf_mixtral(hf: dict[str, torch.Tensor], hc: dict) -> dict[str, torch.Tensor]:
    """``MixtralForCausalLM`` state dict with ``config.json`` ``hc`` -> hybrid state
    (unpadded vocabulary, fp32)."""
    out = from_hf_llama(hf, hc, dense_mlp=False)
    get, experts = hf_getter(hf), hc["num_local_experts"]
    for i in range(hc["num_hidden_layers"]):
        src, dst = f"layers.{i}.", f"blocks.{i}.mlp.experts."
        if f"{src}mlp.gate.weight" in hf or f"model.{src}mlp.gate.weight" in hf:
            router = get(f"{src}mlp.gate.weight")
            fc, proj = get(f"{src}mlp.experts.gate_up_proj"), get(f"{src}mlp.experts.down_proj")
        else:  # transformers 4: one module per expert
            moe = f"{src}block_sparse_moe."
            router = get(moe + "gate.weight")
            fc = torch.stack([torch.cat([get(f"{moe}experts.{j}.w1.weight"),
                                         get(f"{moe}experts.{j}.w3.weight")])
                              for j in range(experts)])
            proj = torch.stack([get(f"{moe}experts.{j}.w2.weight") for j in range(experts)])
        out[dst + "router.weight"], out[dst + "fc"], out[dst + "proj"] = router, fc, proj
    return {k: v.float().contiguous() for k, v in out.items()}


def to_hf_mixtral(model: dict[str, torch.Tensor], c: dict,
                  vocab_size: int) -> dict[str, torch.Tensor]:
    """hybrid state (full tensors) with saved config ``c`` -> ``MixtralForCausalLM``
    state."""
    out = to_hf_llama(model, c, vocab_size, dense_mlp=False)
    for i in range(c["num_layers"]):
        src, dst = f"blocks.{i}.mlp.experts.", f"model.layers.{i}.mlp."
        out[dst + "gate.weight"] = model[src + "router.weight"]
        out[dst + "experts.gate_up_proj"] = model[src + "fc"]
        out[dst + "experts.down_proj"] = model[src + "proj"]
    return {k: v.contiguous() for k, v in out.items()}


def mixtral_hf_config(c: dict, vocab_size: int) -> dict:
    """``config.json`` of ``MixtralForCausalLM`` for a hybrid saved config ``c``;
    CheckpointError naming the flag for an MoE model Mixtral cannot hold (MoE on some
    layers only, a shared expert, another router, a capacity, biases)."""
    moe = MoEConfig.from_flags(c)
    assert moe is not None and moe.num_experts is not None  # (export_hf asks for MoE)
    defaults = MoEConfig()
    for flag in ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                 "moe_router_score_function",
                 "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                 "moe_router_num_groups",
                 "moe_expert_capacity_factor"):
        if getattr(moe, flag) != getattr(defaults, flag):
            raise CheckpointError(f"--{flag.replace('_', '-')} {getattr(moe, flag)}: a "
                                  f"Hugging Face Mixtral has no such option")
    if not all(moe.layers(c["num_layers"])):
        raise CheckpointError(f"--moe-layer-freq {moe.moe_layer_freq}: a Hugging Face "
                              f"Mixtral's every layer is MoE")
    f, shape = _hf_shape_config(c, vocab_size, "Mixtral")
    if f["add_bias_linear"] or f["add_qkv_bias"]:
        raise CheckpointError("a Hugging Face Mixtral has no biases: it needs "
                              "--disable-bias-linear and no --add-qkv-bias")
    shape = dict(shape, intermediate_size=moe.moe_ffn_hidden_size or c["ffn_hidden_size"])
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **shape,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.moe_router_topk,
            "output_router_logits": moe.moe_aux_loss_coeff > 0,
            "router_aux_loss_coef": moe.moe_aux_loss_coeff or 0.001,
            "router_jitter_noise": 0.0, "sliding_window": None}
