"""Name and layout mapping between hybrid's Llama-shaped GPT with MoE layers and Hugging
Face's Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B).

A ``Qwen2MoeForCausalLM`` is a Qwen2 (biases on q, k and v only, by its ``qkv_bias``)
whose MoE layers hold ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``,
each token sent to ``num_experts_per_tok`` of them, and a shared expert of width
``shared_expert_intermediate_size`` every token goes through, its output times a sigmoid
gate (one weight vector): hybrid's ``--num-experts``, ``--moe-router-topk``,
``--moe-ffn-hidden-size``, ``--moe-shared-expert-intermediate-size`` and
``--moe-shared-expert-gate``. Its router takes a softmax over all experts, then the top
k: renormalized (``norm_topk_prob``, hybrid's default, the softmax of the top k logits),
or not (``--moe-router-pre-softmax``). Which layers are MoE: ``mlp_only_layers`` and
``decoder_sparse_step`` (layer i when ``(i + 1) % step == 0``), written as
``--moe-layer-freq``'s list; the others are dense MLPs of width ``intermediate_size``
(``--ffn-hidden-size``).

* router: ``mlp.gate.weight`` ``(E, C)`` is ``mlp.experts.router.weight``;
* experts: ``mlp.experts.gate_up_proj`` ``(E, 2F, C)`` and ``mlp.experts.down_proj``
  ``(E, C, F)`` are ``mlp.experts.fc`` and ``mlp.experts.proj`` (transformers 4's
  ``mlp.experts.<j>.gate_proj / up_proj / down_proj`` are read too);
* shared expert: ``mlp.shared_expert.gate_proj`` and ``up_proj`` stacked are
  ``mlp.shared.fc``, ``down_proj`` is ``mlp.shared.proj``, ``mlp.shared_expert_gate``
  ``(1, C)`` is ``mlp.shared.gate``.

Pure tensor and dict functions: no torch.distributed, no transformers import.
"""

from __future__ import annotations

import torch

from hybrid.config.moe import MoEConfig
from hybrid.errors import CheckpointError
from hybrid.hf.llama import (
    _hf_shape_config,
    _llama_shape_flags,
    check_full_attention,
    from_hf_llama,
    hf_getter,
    to_hf_llama,
)


def num_experts(hc: dict) -> int:
    """``num_experts`` of a Qwen2-MoE or Qwen3-MoE ``config.json`` (transformers 5 saves a
    Qwen3-MoE's as ``num_local_experts``, the hub's files say ``num_experts``)."""
    if "num_experts" in hc:
        return int(hc["num_experts"])
    if "num_local_experts" in hc:
        return int(hc["num_local_experts"])
    raise CheckpointError("config.json: num_experts is missing (nor num_local_experts)")


def moe_layers(hc: dict) -> list[bool]:
    """Which of a Qwen2-MoE's (or Qwen3-MoE's) layers are MoE (its decoder layer's own
    rule)."""
    only = set(hc.get("mlp_only_layers") or ())
    step = int(hc.get("decoder_sparse_step", 1))
    return [i not in only and num_experts(hc) > 0 and (i + 1) % step == 0
            for i in range(hc["num_hidden_layers"])]


def routed_expert_flags(hc: dict) -> dict:
    """The MoE flags a Qwen2-MoE and a Qwen3-MoE ``config.json`` share: the routed
    experts, their router (``norm_topk_prob``), which layers are MoE, the router loss."""
    layers = moe_layers(hc)
    flags = {"num_experts": num_experts(hc), "moe_router_topk": hc["num_experts_per_tok"],
             "moe_ffn_hidden_size": hc["moe_intermediate_size"],
             "moe_router_pre_softmax": not hc.get("norm_topk_prob", False)}
    if not all(layers):
        flags["moe_layer_freq"] = "[" + ",".join(str(int(m)) for m in layers) + "]"
    # trained with the router loss only when transformers adds it (output_router_logits)
    if hc.get("output_router_logits") and hc.get("router_aux_loss_coef"):
        flags["moe_aux_loss_coeff"] = float(hc["router_aux_loss_coef"])
    return flags


def qwen2_moe_flags(hc: dict) -> dict:
    """hybrid's flags for a Qwen2-MoE ``config.json``; CheckpointError naming the field
    for what hybrid cannot express (sliding-window attention)."""
    check_full_attention(hc)
    flags = dict(_llama_shape_flags(hc), disable_bias_linear=True, **routed_expert_flags(hc))
    if hc.get("qkv_bias", True):
        flags["add_qkv_bias"] = True
    if hc.get("shared_expert_intermediate_size"):
        flags.update(moe_shared_expert_intermediate_size=hc["shared_expert_intermediate_size"],
                     moe_shared_expert_gate=True)
    return flags


def from_hf_qwen2_moe(hf: dict[str, torch.Tensor], hc: dict) -> dict[str, torch.Tensor]:
    """``Qwen2MoeForCausalLM`` state dict with ``config.json`` ``hc`` -> hybrid state
    (unpadded vocabulary, fp32)."""
    layers = moe_layers(hc)
    out = from_hf_llama(hf, hc, dense_mlp={i for i, m in enumerate(layers) if not m})
    get, experts = hf_getter(hf), num_experts(hc)
    shared = bool(hc.get("shared_expert_intermediate_size"))
    for i in (i for i, m in enumerate(layers) if m):
        src, dst = f"layers.{i}.mlp.", f"blocks.{i}.mlp."
        out[dst + "experts.router.weight"] = get(src + "gate.weight")
        if f"{src}experts.gate_up_proj" in hf or f"model.{src}experts.gate_up_proj" in hf:
            fc, proj = get(src + "experts.gate_up_proj"), get(src + "experts.down_proj")
        else:  # transformers 4: one module per expert
            fc = torch.stack([torch.cat([get(f"{src}experts.{j}.gate_proj.weight"),
                                         get(f"{src}experts.{j}.up_proj.weight")])
                              for j in range(experts)])
            proj = torch.stack([get(f"{src}experts.{j}.down_proj.weight")
                                for j in range(experts)])
        out[dst + "experts.fc"], out[dst + "experts.proj"] = fc, proj
        if shared:
            out[dst + "shared.fc"] = torch.cat([get(src + "shared_expert.gate_proj.weight"),
                                                get(src + "shared_expert.up_proj.weight")])
            out[dst + "shared.proj"] = get(src + "shared_expert.down_proj.weight")
            out[dst + "shared.gate"] = get(src + "shared_expert_gate.weight")
    return {k: v.float().contiguous() for k, v in out.items()}


def to_hf_qwen2_moe(model: dict[str, torch.Tensor], c: dict,
                    vocab_size: int) -> dict[str, torch.Tensor]:
    """hybrid state (full tensors) with saved config ``c`` -> ``Qwen2MoeForCausalLM``
    state (``Qwen3MoeForCausalLM``'s too: the same names, no shared expert, q and k
    norms)."""
    moe = MoEConfig.from_flags(c)
    assert moe is not None  # (export_hf asks for MoE)
    layers = moe.layers(c["num_layers"])
    out = to_hf_llama(model, c, vocab_size,
                      dense_mlp={i for i, m in enumerate(layers) if not m})
    for i in (i for i, m in enumerate(layers) if m):
        src, dst = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        out[dst + "gate.weight"] = model[src + "experts.router.weight"]
        out[dst + "experts.gate_up_proj"] = model[src + "experts.fc"]
        out[dst + "experts.down_proj"] = model[src + "experts.proj"]
        if src + "shared.fc" not in model:  # (a Qwen3-MoE: routed experts only)
            continue
        gate, up = model[src + "shared.fc"].chunk(2)
        out[dst + "shared_expert.gate_proj.weight"] = gate
        out[dst + "shared_expert.up_proj.weight"] = up
        out[dst + "shared_expert.down_proj.weight"] = model[src + "shared.proj"]
        out[dst + "shared_expert_gate.weight"] = model[src + "shared.gate"]
    return {k: v.contiguous() for k, v in out.items()}


def checked_moe(c: dict, family: str, also: tuple[str, ...] = ()) -> MoEConfig:
    """The MoE section of saved config ``c``; CheckpointError naming the first flag off
    its default that a Hugging Face ``family`` has no option for: another router, a
    capacity, and the flags ``also`` lists."""
    moe = MoEConfig.from_flags(c)
    assert moe is not None and moe.num_experts is not None  # (export_hf asks for MoE)
    defaults = MoEConfig()
    for flag in ("moe_router_score_function", "moe_router_topk_scaling_factor",
                 "moe_router_num_groups", "moe_expert_capacity_factor", *also):
        if getattr(moe, flag) != getattr(defaults, flag):
            raise CheckpointError(f"--{flag.replace('_', '-')} {getattr(moe, flag)}: a "
                                  f"Hugging Face {family} has no such option")
    return moe


def routed_expert_config(moe: MoEConfig, c: dict) -> dict:
    """The ``config.json`` keys of the routed experts a Qwen2-MoE and a Qwen3-MoE share
    (the inverse of :func:`routed_expert_flags`)."""
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.moe_router_topk,
            "moe_intermediate_size": moe.moe_ffn_hidden_size or c["ffn_hidden_size"],
            "norm_topk_prob": not moe.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, m in enumerate(moe.layers(c["num_layers"]))
                                if not m],
            "output_router_logits": moe.moe_aux_loss_coeff > 0,
            # (off, transformers' default: what it reads when training turns it on)
            "router_aux_loss_coef": moe.moe_aux_loss_coeff or 0.001}


def qwen2_moe_hf_config(c: dict, vocab_size: int) -> dict:
    """``config.json`` of ``Qwen2MoeForCausalLM`` for a hybrid saved config ``c`` (an MoE
    model with a gated shared expert); CheckpointError naming the flag for what a
    Qwen2-MoE cannot hold (another router, a capacity, biases beyond q, k and v)."""
    moe = checked_moe(c, "Qwen2-MoE")
    f, shape = _hf_shape_config(c, vocab_size, "Qwen2-MoE")
    if f["add_bias_linear"]:
        raise CheckpointError("a Hugging Face Qwen2-MoE has biases on q, k and v only: it "
                              "needs --disable-bias-linear")
    layers = c["num_layers"]
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **shape,
            "qkv_bias": bool(f["add_qkv_bias"]), **routed_expert_config(moe, c),
            "shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
            "layer_types": ["full_attention"] * layers}
