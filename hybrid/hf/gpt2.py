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


# hybrid's names of one block -> Hugging Face's (under ``transformer.h.N.``)
_BLOCK = {"ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
          "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
          "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
          "attn.proj.weight": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
          "mlp.fc.weight": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
          "mlp.proj.weight": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias"}
_TOP = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
        "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
# Conv1D weights, stored (in, out): the transpose of hybrid's nn.Linear layout
_CONV1D = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")


def hf_names(num_layers: int) -> dict[str, str]:
    """hybrid parameter name -> ``GPT2LMHeadModel`` name (``transformer.``...), in
    hybrid's order: the one name table of GPT-2 (the weight import and export, and the
    peers' checkpoints of a GPT-2, :mod:`hybrid.checkpoint.peers`)."""
    out = dict(_TOP)
    for i in range(num_layers):
        out.update({f"blocks.{i}.{k}": f"transformer.h.{i}.{v}" for k, v in _BLOCK.items()})
    return out


def param_from_hf(name: str, t: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's tensor of hybrid parameter ``name``, in hybrid's layout (the
    Conv1D weights transposed, c_attn's rows per head)."""
    part = name.split(".", 2)[-1] if name.startswith("blocks.") else name
    if part in _CONV1D:
        t = t.t()
    if part in ("attn.qkv.weight", "attn.qkv.bias"):
        t = _qkv_to_per_head(t, heads)
    return t


def param_to_hf(name: str, t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`param_from_hf` (the vocabulary's padding rows kept)."""
    part = name.split(".", 2)[-1] if name.startswith("blocks.") else name
    if part in ("attn.qkv.weight", "attn.qkv.bias"):
        t = _per_head_to_qkv(t, heads)
    if part in _CONV1D:
        t = t.t()
    return t


def to_hf(model: dict[str, torch.Tensor], num_layers: int, heads: int,
          vocab_size: int) -> dict[str, torch.Tensor]:
    """hybrid state (full tensors) -> ``GPT2LMHeadModel`` state dict."""
    out = {}
    for name, hf in hf_names(num_layers).items():
        t = param_to_hf(name, model[name], heads)
        out[hf] = t[:vocab_size] if name == "wte.weight" else t
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, torch.Tensor], num_layers: int, heads: int) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel`` state dict -> hybrid state (unpadded vocabulary); its names with
    or without the ``transformer.`` prefix."""
    def get(k):
        return hf[k] if k in hf else hf[k.removeprefix("transformer.")]
    return {name: param_from_hf(name, get(k), heads).float().contiguous()
            for name, k in hf_names(num_layers).items()}


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
