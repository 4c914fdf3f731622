#!/usr/bin/env python
"""Turn a Hugging Face GPT-2, Llama, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE or Mixtral model
directory into a hybrid checkpoint.

    python scripts/import_hf.py HF_DIR SAVE_DIR
    bash scripts/pretrain_gpt.sh --load SAVE_DIR --num-layers ... (the flags it prints)

Reads ``config.json`` and ``model.safetensors`` (or the shards a
``model.safetensors.index.json`` lists, or ``pytorch_model.bin``) and writes
``SAVE_DIR/iter_0000000`` with a fresh optimizer; ``--load`` then reads it
into any TP x DP x ZeRO layout. Prints the flags that match the model: for a
``LlamaForCausalLM`` (``model_type`` llama, plain RoPE) those include
``--normalization RMSNorm --swiglu --position-embedding-type rope`` and, as the
model has them, ``--group-query-attention``, ``--untie-embeddings-and-output-
weights`` and ``--disable-bias-linear``; a ``Qwen2ForCausalLM`` (``model_type``
qwen2, Qwen2 and Qwen2.5) adds ``--disable-bias-linear --add-qkv-bias``; a
``Qwen3ForCausalLM`` (``model_type`` qwen3) ``--disable-bias-linear --qk-layernorm``
and ``--kv-channels`` (its ``head_dim``, when that is not hidden / heads); a
``MixtralForCausalLM`` (``model_type`` mixtral) is a Llama with ``--num-experts
--moe-router-topk --moe-ffn-hidden-size`` (and ``--moe-aux-loss-coeff`` when it trains
with its router loss); a ``Qwen2MoeForCausalLM`` and a ``Qwen3MoeForCausalLM``
(``model_type`` qwen2_moe, qwen3_moe) are a Qwen2 and a Qwen3 with such experts
(``--moe-layer-freq`` where some layers are dense; Qwen2-MoE's gated shared expert).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from hybrid.checkpoint.single_rank import write_unsharded_checkpoint
from hybrid.errors import CheckpointError
from hybrid.hf.gpt2 import from_hf
from hybrid.hf.llama import from_hf_llama, llama_flags, qwen2_flags
from hybrid.hf.mixtral import from_hf_mixtral, mixtral_flags
from hybrid.hf.qwen2_moe import from_hf_qwen2_moe, qwen2_moe_flags
from hybrid.hf.qwen3 import qwen3_flags, qwen3_moe_flags


def _read_weights(hf_dir: str) -> dict:
    st = os.path.join(hf_dir, "model.safetensors")
    index = st + ".index.json"
    if os.path.isfile(st) or os.path.isfile(index):
        from safetensors.torch import load_file
        if os.path.isfile(st):
            return load_file(st)
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for shard in shards:
            out.update(load_file(os.path.join(hf_dir, shard)))
        return out
    pt = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise CheckpointError(f"{hf_dir}: no model.safetensors(.index.json) or pytorch_model.bin")


# Hugging Face GPT-2's activation_function -> --openai-gelu (tanh) or not (exact)
_GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


def _gpt2(hf_dir: str, hc: dict) -> tuple[dict, dict]:
    act = hc.get("activation_function", "gelu_new")  # (GPT2Config's default)
    if act not in _GELUS:
        raise CheckpointError(f"{os.path.join(hf_dir, 'config.json')}: activation_function "
                              f"{act!r}; hybrid's GPT-2 MLP computes {', '.join(_GELUS)}")
    flags = {"num_layers": hc["n_layer"], "hidden_size": hc["n_embd"],
             "num_attention_heads": hc["n_head"],
             "ffn_hidden_size": hc.get("n_inner") or 4 * hc["n_embd"],
             "max_position_embeddings": hc["n_positions"], "openai_gelu": _GELUS[act]}
    return flags, from_hf(_read_weights(hf_dir), hc["n_layer"], hc["n_head"])


# the dense Llama-shaped families, whose weights from_hf_llama maps: their flags
_DENSE = {"llama": llama_flags, "qwen2": qwen2_flags, "qwen3": qwen3_flags}


def _flag_words(flags: dict) -> str:
    words = []
    for k, v in flags.items():
        if v is False:  # a store_true flag left off
            continue
        words.append("--" + k.replace("_", "-"))
        if v is not True:  # store_true flags stand alone
            words.append(str(v))
    return " ".join(words)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("save_dir")
    a = ap.parse_args(argv)
    try:
        path = os.path.join(a.hf_dir, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                hc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: missing or unreadable ({e})") from e
        kind = hc.get("model_type")
        if kind == "gpt2":
            flags, model = _gpt2(a.hf_dir, hc)
        elif kind in _DENSE:  # refuse what hybrid cannot express, before reading
            flags = _DENSE[kind](hc)
            model = from_hf_llama(_read_weights(a.hf_dir), hc)
        elif kind == "mixtral":
            flags = mixtral_flags(hc)
            model = from_hf_mixtral(_read_weights(a.hf_dir), hc)
        elif kind in ("qwen2_moe", "qwen3_moe"):  # (the same expert names, Qwen3's unshared)
            flags = qwen2_moe_flags(hc) if kind == "qwen2_moe" else qwen3_moe_flags(hc)
            model = from_hf_qwen2_moe(_read_weights(a.hf_dir), hc)
        else:
            raise CheckpointError(f"{path}: model_type {kind!r}, expected gpt2, llama, qwen2, "
                                  f"qwen3, mixtral, qwen2_moe or qwen3_moe")
        out = write_unsharded_checkpoint(a.save_dir, model, flags, hc["vocab_size"])
    except CheckpointError as e:
        print(f"import_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}; train from it with --load {a.save_dir} {_flag_words(flags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
