"""Name and layout mapping between hybrid's GPT and Hugging Face's GPT-2.

The architectures are the same; three things differ:

* HF's ``Conv1D`` stores weights as ``(in, out)``, the transpose of ``nn.Linear``;
* HF's fused ``c_attn`` lays its 3C output columns out as ``[q | k | v]``, each
  over all heads, while hybrid lays QKV rows out per head (``[q k v]`` of head 0,
  then head 1, ...) so any TP split keeps whole heads;
* hybrid's embedding has padding rows past the vocabulary, HF's does not.

Pure tensor functions: no torch.distributed, no transformers import.
"""

from __future__ import annotations

import torch
from einops import rearrange

from hybrid.config.architecture import architecture_fields
from hybrid.errors import CheckpointError


def _per_head_to_qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(nh*3*hs, ...) per-head rows -> (3*nh*hs, ...) [q|k|v] rows."""
    return rearrange(t, "(nh three hs) ... -> (three nh hs) ...", nh=heads, three=3)


def _qkv_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    return rearrange(t, "(three nh hs) ... -> (nh three hs) ...", nh=heads, three=3)


def to_hf(model: dict[str, torch.Tensor], num_layers: int, heads: int,
          vocab_size: int) -> dict[str, torch.Tensor]:
    """hybrid state (full tensors) -> ``GPT2LMHeadModel`` state dict."""
    out = {"transformer.wte.weight": model["wte.weight"][:vocab_size],
           "transformer.wpe.weight": model["wpe.weight"],
           "transformer.ln_f.weight": model["ln_f.weight"],
           "transformer.ln_f.bias": model["ln_f.bias"]}
    for i in range(num_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[dst + ln + ".weight"] = model[src + ln + ".weight"]
            out[dst + ln + ".bias"] = model[src + ln + ".bias"]
        out[dst + "attn.c_attn.weight"] = _per_head_to_qkv(
            model[src + "attn.qkv.weight"], heads).t()
        out[dst + "attn.c_attn.bias"] = _per_head_to_qkv(model[src + "attn.qkv.bias"], heads)
        out[dst + "attn.c_proj.weight"] = model[src + "attn.proj.weight"].t()
        out[dst + "attn.c_proj.bias"] = model[src + "attn.proj.bias"]
        out[dst + "mlp.c_fc.weight"] = model[src + "mlp.fc.weight"].t()
        out[dst + "mlp.c_fc.bias"] = model[src + "mlp.fc.bias"]
        out[dst + "mlp.c_proj.weight"] = model[src + "mlp.proj.weight"].t()
        out[dst + "mlp.c_proj.bias"] = model[src + "mlp.proj.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, torch.Tensor], num_layers: int, heads: int) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel`` state dict -> hybrid state (unpadded vocabulary)."""
    def get(k):
        return hf[k] if k in hf else hf["transformer." + k]
    out = {"wte.weight": get("wte.weight"), "wpe.weight": get("wpe.weight"),
           "ln_f.weight": get("ln_f.weight"), "ln_f.bias": get("ln_f.bias")}
    for i in range(num_layers):
        src, dst = f"h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            out[dst + ln + ".weight"] = get(src + ln + ".weight")
            out[dst + ln + ".bias"] = get(src + ln + ".bias")
        out[dst + "attn.qkv.weight"] = _qkv_to_per_head(get(src + "attn.c_attn.weight").t(), heads)
        out[dst + "attn.qkv.bias"] = _qkv_to_per_head(get(src + "attn.c_attn.bias"), heads)
        out[dst + "attn.proj.weight"] = get(src + "attn.c_proj.weight").t()
        out[dst + "attn.proj.bias"] = get(src + "attn.c_proj.bias")
        out[dst + "mlp.fc.weight"] = get(src + "mlp.c_fc.weight").t()
        out[dst + "mlp.fc.bias"] = get(src + "mlp.c_fc.bias")
        out[dst + "mlp.proj.weight"] = get(src + "mlp.c_proj.weight").t()
        out[dst + "mlp.proj.bias"] = get(src + "mlp.c_proj.bias")
    return {k: v.float().contiguous() for k, v in out.items()}


def hf_config(cfg: dict, vocab_size: int) -> dict:
    """GPT-2 ``config.json`` fields for a checkpoint's flat config dict; CheckpointError
    for ``--kv-channels`` other than hidden / heads (a GPT-2's heads are that wide)."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    width = cfg.get("kv_channels")
    if width is not None and width * heads != hidden:
        raise CheckpointError(f"--kv-channels {width}: a Hugging Face GPT-2's heads are "
                              f"--hidden-size / --num-attention-heads wide")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": vocab_size, "n_positions": cfg["max_position_embeddings"],
            "n_embd": cfg["hidden_size"], "n_layer": cfg["num_layers"],
            "n_head": cfg["num_attention_heads"], "n_inner": cfg["ffn_hidden_size"],
            # --openai-gelu: GPT-2's tanh GELU (architecture_fields: what old checkpoints used)
            "activation_function": ("gelu_new" if architecture_fields(cfg)["openai_gelu"]
                                    else "gelu"),
            "layer_norm_epsilon": cfg.get("norm_epsilon") or 1e-5,
            "resid_pdrop": cfg["hidden_dropout"], "embd_pdrop": cfg["hidden_dropout"],
            "attn_pdrop": cfg["attention_dropout"], "initializer_range": cfg["init_method_std"],
            "tie_word_embeddings": True, "scale_attn_weights": True, "use_cache": True,
            "bos_token_id": vocab_size - 1, "eos_token_id": vocab_size - 1}
