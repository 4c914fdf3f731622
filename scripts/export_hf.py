#!/usr/bin/env python
"""Export a hybrid checkpoint (any layout) as a Hugging Face model directory.

    python scripts/export_hf.py SAVE_DIR_OR_CHECKPOINT OUT_DIR

Writes ``OUT_DIR/config.json`` and ``OUT_DIR/model.safetensors``: a
``GPT2LMHeadModel`` for a GPT-2-shaped run, a ``LlamaForCausalLM`` for a
Llama-shaped one (``--normalization RMSNorm --swiglu --position-embedding-type
rope``, with or without GQA, untied output and biases), a ``Qwen2ForCausalLM``
for a Llama-shaped one with Qwen2's biases (``--disable-bias-linear
--add-qkv-bias``: q, k and v only), a ``MixtralForCausalLM`` for a Llama-shaped one
with MoE layers (``--num-experts``, every layer, no shared expert), a
``Qwen2MoeForCausalLM`` for one whose MoE layers have a gated shared expert
(``--moe-shared-expert-gate``; dense layers where ``--moe-layer-freq`` says), a
``Qwen3ForCausalLM`` for a bias-free Llama-shaped one with ``--qk-layernorm`` (heads
``--kv-channels`` wide), a ``Qwen3MoeForCausalLM`` for that with MoE layers (routed
experts only), which
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads. A Llama or
Qwen2 export leaves ``bos_token_id`` / ``eos_token_id`` unset: hybrid does not
know the tokenizer's special ids. Needs the ``safetensors`` package (``pip
install -e '.[dev]'`` has it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hybrid.checkpoint import iter_full_params, resolve_checkpoint
from hybrid.config.architecture import architecture_fields, is_gpt2, is_qwen2
from hybrid.config.model import ModelConfig
from hybrid.errors import CheckpointError
from hybrid.hf.gpt2 import hf_config, to_hf
from hybrid.hf.llama import llama_hf_config, qwen2_hf_config, to_hf_llama
from hybrid.hf.mixtral import mixtral_hf_config, to_hf_mixtral
from hybrid.hf.qwen2_moe import qwen2_moe_hf_config, to_hf_qwen2_moe
from hybrid.hf.qwen3 import qwen3_hf_config, qwen3_moe_hf_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("output_dir")
    a = ap.parse_args(argv)
    try:
        from safetensors.torch import save_file
    except ImportError:
        print("export_hf.py: error: needs the safetensors package (pip install safetensors)",
              file=sys.stderr)
        return 2
    try:
        ckpt = resolve_checkpoint(a.checkpoint)
        if os.path.exists(os.path.join(a.output_dir, "model.safetensors")):
            raise CheckpointError(f"{a.output_dir}: already holds a model; not overwriting it")
        meta, params = iter_full_params(ckpt, ("master",))  # one parameter at a time
        cfg, vocab = meta["config"], meta["vocab_size"]
        fields = architecture_fields(cfg)
        if is_gpt2(fields):
            # the MLP width the model was built with (the flag may be unset: 4 x hidden)
            cfg = dict(cfg, ffn_hidden_size=ModelConfig.from_flags(cfg).ffn_hidden_size)
            kind, config = "GPT-2", hf_config(cfg, vocab)
        elif cfg.get("num_experts") and fields["qk_layernorm"]:  # q/k norms: Qwen3-MoE
            kind, config = "Qwen3Moe", qwen3_moe_hf_config(cfg, vocab)
        elif cfg.get("num_experts") and cfg.get("moe_shared_expert_gate"):  # a gated shared
            kind, config = "Qwen2Moe", qwen2_moe_hf_config(cfg, vocab)       # expert: Qwen2-MoE
        elif cfg.get("num_experts"):  # MoE layers: a Mixtral, or refused naming the flag
            kind, config = "Mixtral", mixtral_hf_config(cfg, vocab)
        elif fields["qk_layernorm"]:  # q and k normalized: a Qwen3, or refused naming why
            kind, config = "Qwen3", qwen3_hf_config(cfg, vocab)
        elif is_qwen2(fields):  # biases on q, k and v only
            kind, config = "Qwen2", qwen2_hf_config(cfg, vocab)
        else:  # CheckpointError naming the flags when it is not a Llama either
            kind, config = "Llama", llama_hf_config(cfg, vocab)
        weights = {n: s["master"] for n, s in params}
        if kind == "GPT-2":  # HF ties lm_head to wte, so only the embedding is stored
            tensors = to_hf(weights, cfg["num_layers"], cfg["num_attention_heads"], vocab)
        elif kind == "Mixtral":
            tensors = to_hf_mixtral(weights, cfg, vocab)
        elif kind in ("Qwen2Moe", "Qwen3Moe"):  # (Qwen3-MoE's: no shared expert)
            tensors = to_hf_qwen2_moe(weights, cfg, vocab)
        else:  # Qwen2 and Qwen3 name their weights as Llama (Qwen3 adds q/k norms)
            tensors = to_hf_llama(weights, cfg, vocab)
    except CheckpointError as e:
        print(f"export_hf.py: error: {e}", file=sys.stderr)
        return 2
    try:
        os.makedirs(a.output_dir, exist_ok=True)
        save_file(tensors, os.path.join(a.output_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(a.output_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
    except OSError as e:
        print(f"export_hf.py: error: {a.output_dir}: cannot write the model there ({e})",
              file=sys.stderr)
        return 2
    print(f"wrote {a.output_dir} ({kind}, {cfg['num_layers']} layers, hidden "
          f"{cfg['hidden_size']}, vocab {vocab}) from {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
