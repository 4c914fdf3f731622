"""How a DeepSpeed checkpoint's parameter names become hybrid's: :class:`NameMap`, and the
maps of the Hugging Face models DeepSpeed trains (GPT-2, Llama, Qwen2) through the Hugging
Face import's own tables (:mod:`hybrid.hf.gpt2`, :func:`hybrid.hf.llama.hf_sources`),
with the model's ``config.json``.
"""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from hybrid.checkpoint.peers.deepspeed_files import FORMAT
from hybrid.errors import CheckpointError


@dataclass
class NameMap:
    """How a DeepSpeed model's parameter names and tensors become hybrid's: ``names``
    hybrid name -> DeepSpeed name (in hybrid's order), or the DeepSpeed names it is made
    of (a tuple: a Llama's q, k and v into one QKV); ``convert(hybrid_name, tensor)`` the
    full DeepSpeed tensor in hybrid's layout, or ``convert(hybrid_name, [tensors])`` for
    a tuple; ``shapes`` hybrid's full shapes; ``flags`` the model flags the names and
    shapes determine."""
    names: Mapping[str, str | tuple[str, ...]]
    shapes: dict[str, list[int]]
    convert: Callable | None = None  # None: as they are
    flags: dict = field(default_factory=dict)
    vocab_size: int | None = None


# [Note: whose names]
# A DeepSpeed checkpoint names parameters by the module DeepSpeed trained. Loaded by a
# script under hybrid.deepspeed (engine.load_checkpoint) the module is the same, so the
# names stay as they are (names="module"). Loaded by pretrain_gpt.py --load, the model is
# hybrid's GPT: a transformers GPT2LMHeadModel's names and layouts map through
# hybrid.hf.gpt2's table, a LlamaForCausalLM's or Qwen2ForCausalLM's through
# hybrid.hf.llama's (the ones the Hugging Face import uses; a fused QKV is made of three
# DeepSpeed parameters, and so are its moments), with the model's config.json (heads,
# query groups) beside `latest` or in the tag's directory, where Hugging Face's Trainer
# writes it; other modules' names stay as they are (the load then names what does not
# match).
def hf_names(tag_dir: str, ds_shapes: dict[str, list[int]]) -> NameMap | None:
    """The :class:`NameMap` of a transformers GPT2LMHeadModel's, LlamaForCausalLM's or
    Qwen2ForCausalLM's checkpoint (by its parameter names, its ``config.json`` read);
    None for other models."""
    if "transformer.h.0.attn.c_attn.weight" in ds_shapes:
        family = "gpt2"
    elif "model.layers.0.self_attn.q_proj.weight" in ds_shapes:
        family = "llama"
    else:
        return None
    path, hc = _hf_config(tag_dir, "GPT2LMHeadModel" if family == "gpt2" else
                          "LlamaForCausalLM or Qwen2ForCausalLM")
    return _gpt2_names(tag_dir, ds_shapes, path, hc) if family == "gpt2" else \
        _llama_names(tag_dir, ds_shapes, path, hc)


def _hf_config(tag_dir: str, what: str) -> tuple[str, dict]:
    """(path, contents) of the Hugging Face model's ``config.json``, beside ``latest`` or
    in the tag's directory."""
    where = [os.path.join(tag_dir, "config.json"),
             os.path.join(os.path.dirname(tag_dir.rstrip(os.sep)), "config.json")]
    path = next((p for p in where if os.path.isfile(p)), None)
    if path is None:
        raise CheckpointError(f"{tag_dir}: a transformers {what}'s {FORMAT} checkpoint; "
                              f"hybrid needs the model's config.json (its heads, ...) beside "
                              f"'latest' or in that directory, as Hugging Face's Trainer "
                              f"saves it: model.config.save_pretrained(dir)")
    try:
        with builtins.open(path, encoding="utf-8") as f:
            hc = json.load(f)
        if not isinstance(hc, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable config.json ({e})") from None
    return path, hc


def _llama_names(tag_dir: str, ds_shapes: dict[str, list[int]], path: str,
                 hc: dict) -> NameMap:
    """A LlamaForCausalLM's or Qwen2ForCausalLM's checkpoint through hybrid.hf.llama's
    table (:func:`~hybrid.hf.llama.hf_sources`; q, k and v fused per query group, gate and
    up stacked, their moments alike)."""
    from hybrid.hf.llama import hf_sources, llama_flags, param_from_hf, qwen2_flags
    kind = hc.get("model_type")
    if kind not in ("llama", "qwen2"):
        raise CheckpointError(f"{path}: model_type {kind!r}; hybrid reads DeepSpeed "
                              f"checkpoints of GPT-2, Llama and Qwen2 models by name")
    try:
        flags = llama_flags(hc) if kind == "llama" else qwen2_flags(hc)
        sources = hf_sources(hc)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a {kind} config.json hybrid reads ({e})") from None

    def ds_name(hf: str) -> str:
        return hf if hf in ds_shapes else "model." + hf
    names = {h: tuple(ds_name(s) for s in srcs) for h, srcs in sources.items()}
    used = {d for srcs in names.values() for d in srcs}  # (all tuples here)
    missing = sorted(used - set(ds_shapes))
    extra = sorted(set(ds_shapes) - used)
    if missing or extra:
        raise CheckpointError(f"{tag_dir}: its parameters are not those of the "
                              f"{hc.get('num_hidden_layers')}-layer {kind} of {path}: "
                              f"missing {missing[:4]}, extra {extra[:4]}")
    shapes = {h: list(param_from_hf(h, [torch.empty(ds_shapes[d], device="meta")
                                        for d in srcs], hc).shape)
              for h, srcs in names.items()}

    def convert(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return param_from_hf(name, parts, hc)
    return NameMap(names, shapes, convert, flags, int(hc["vocab_size"]))


def _gpt2_names(tag_dir: str, ds_shapes: dict[str, list[int]], path: str,
                hc: dict) -> NameMap:
    """A GPT2LMHeadModel's checkpoint through hybrid.hf.gpt2's table."""
    from hybrid.hf.gpt2 import hf_names, param_from_hf
    try:
        layers, heads = int(hc["n_layer"]), int(hc["n_head"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable GPT-2 config.json ({e})") from None
    if hc.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{path}: model_type {hc.get('model_type')!r}, but the "
                              f"checkpoint's parameters are GPT-2's")
    table = hf_names(layers)
    missing = [d for d in table.values() if d not in ds_shapes]
    extra = [d for d in ds_shapes if d not in table.values() and d != "lm_head.weight"]
    if missing or extra:
        raise CheckpointError(f"{tag_dir}: its parameters are not those of the {layers}-layer "
                              f"GPT-2 of {path}: missing {missing[:4]}, extra {extra[:4]}")
    shapes = {h: list(param_from_hf(h, torch.empty(ds_shapes[d], device="meta"), heads).shape)
              for h, d in table.items()}
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                "add_cross_attention"):
        if hc.get(key):
            raise CheckpointError(f"{path}: {key} is true; hybrid's GPT-2 has no such option")
    if hc.get("scale_attn_weights") is False:
        raise CheckpointError(f"{path}: scale_attn_weights is false; hybrid's attention "
                              f"scales by 1/sqrt(head size)")
    act = hc.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise CheckpointError(f"{path}: activation_function {act!r}; hybrid's GPT-2 MLP "
                              f"computes gelu_new, gelu_pytorch_tanh or gelu")
    flags = {"num_layers": layers, "hidden_size": int(hc["n_embd"]),
             "num_attention_heads": heads,
             "ffn_hidden_size": int(hc.get("n_inner") or 4 * int(hc["n_embd"])),
             "max_position_embeddings": int(hc["n_positions"]),
             "openai_gelu": act != "gelu"}

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        return param_from_hf(name, t, heads).contiguous()
    return NameMap(table, shapes, convert, flags, int(hc["vocab_size"]))
