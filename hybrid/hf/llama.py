"""Name and layout mapping between hybrid's Llama-shaped GPT and Hugging Face's Llama,
Qwen2 and (its attention) Qwen3.

A hybrid model with ``--normalization RMSNorm --swiglu --position-embedding-type
rope`` (and optionally GQA, untied output, no biases) is ``LlamaForCausalLM``;
with ``--disable-bias-linear --add-qkv-bias`` (biases on q, k and v only) it is
``Qwen2ForCausalLM``, whose weights are named as Llama's. ``head_dim`` is
``--kv-channels`` (given when it is not hidden / heads). A Qwen3 adds
``self_attn.q_norm`` and ``k_norm``, hybrid's ``attn.q_norm`` and ``attn.k_norm``
(``--qk-layernorm``; :mod:`hybrid.hf.qwen3` has its config). What differs is only
where the numbers sit:

* hybrid fuses Q, K and V into one weight laid out per query group --
  ``[the group's query heads | its key head | its value head]``, group after
  group -- so a TP split keeps whole groups; HF keeps ``q_proj``, ``k_proj`` and
  ``v_proj`` apart, head-major;
* hybrid fuses gate and up into ``mlp.fc.weight`` ``(2, F, C)`` (``[gate; up]``);
  HF has ``gate_proj`` and ``up_proj``;
* hybrid's embedding and output layer have padding rows past the vocabulary.

Both use RoPE's rotate-half convention on every head (no permutation of the
Q/K rows) and the same RMSNorm, so logits agree to rounding. Pure tensor and
dict functions: no torch.distributed, no transformers import.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from hybrid.config.architecture import architecture_fields, is_llama
from hybrid.errors import CheckpointError
from hybrid.kernels.rotary import HIGH_FREQ_FACTOR, LOW_FREQ_FACTOR, ORIGINAL_CONTEXT


def _qkv_from_hf(q, k, v, groups: int) -> torch.Tensor:
    """(nq hs, ...), (g hs, ...), (g hs, ...) -> per-group (g (r + 2) hs, ...)."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _qkv_to_hf(qkv, groups: int, heads: int):
    """Inverse of :func:`_qkv_from_hf`: (q, k, v)."""
    r = heads // groups
    x = qkv.reshape(groups, r + 2, -1, *qkv.shape[1:])  # (g, r + 2, hs, ...)
    rest = qkv.shape[1:]
    return (x[:, :r].reshape(-1, *rest), x[:, r].reshape(-1, *rest),
            x[:, r + 1].reshape(-1, *rest))


def _kinds(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


# the Hugging Face families whose attention normalizes q and k heads (--qk-layernorm)
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def _has_dense(dense_mlp: bool | Collection[int], layer: int) -> bool:
    return dense_mlp if isinstance(dense_mlp, bool) else layer in dense_mlp


def hf_getter(hf: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """``get(name)``: ``hf[name]`` or ``hf["model." + name]``; CheckpointError naming it
    when neither is there."""
    def get(k: str) -> torch.Tensor:
        for key in (k, "model." + k):
            if key in hf:
                return hf[key]
        raise CheckpointError(f"the Hugging Face weights have no {k!r}")
    return get


def to_hf_llama(model: dict[str, torch.Tensor], c: dict, vocab_size: int,
                dense_mlp: bool | Collection[int] = True) -> dict[str, torch.Tensor]:
    """hybrid state (full tensors) with saved config ``c`` -> ``LlamaForCausalLM`` state
    (``Qwen2ForCausalLM``'s too: the same names, q/k/v biases with --add-qkv-bias).
    ``dense_mlp``: the layers whose MLP is a dense one (True: all; False: none, a
    Mixtral's experts, :mod:`hybrid.hf.mixtral`); the others' MLPs are left out."""
    f = architecture_fields(c)
    qkv_bias, bias = f["add_bias_linear"] or f["add_qkv_bias"], f["add_bias_linear"]
    heads = c["num_attention_heads"]
    groups = f["num_query_groups"] or heads
    out = {"model.embed_tokens.weight": model["wte.weight"][:vocab_size],
           "model.norm.weight": model["ln_f.weight"]}
    if f["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = model["output_layer.weight"][:vocab_size]
    for i in range(c["num_layers"]):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = model[src + "ln_1.weight"]
        out[dst + "post_attention_layernorm.weight"] = model[src + "ln_2.weight"]
        if f["qk_layernorm"]:
            for n in ("q_norm", "k_norm"):
                out[f"{dst}self_attn.{n}.weight"] = model[f"{src}attn.{n}.weight"]
        for kind in _kinds(qkv_bias):
            q, k, v = _qkv_to_hf(model[f"{src}attn.qkv.{kind}"], groups, heads)
            for name, t in (("q", q), ("k", k), ("v", v)):
                out[f"{dst}self_attn.{name}_proj.{kind}"] = t
        for kind in _kinds(bias):
            out[f"{dst}self_attn.o_proj.{kind}"] = model[f"{src}attn.proj.{kind}"]
            if not _has_dense(dense_mlp, i):
                continue
            gate, up = model[f"{src}mlp.fc.{kind}"]  # (2, F, ...)
            out[f"{dst}mlp.gate_proj.{kind}"] = gate
            out[f"{dst}mlp.up_proj.{kind}"] = up
            out[f"{dst}mlp.down_proj.{kind}"] = model[f"{src}mlp.proj.{kind}"]
    return {k: v.contiguous() for k, v in out.items()}


def _qkv_bias_only(hc: dict) -> bool:
    """Whether q, k and v alone have biases: a Qwen2's always, a Qwen2-MoE's by its
    ``qkv_bias`` (transformers 4's: always)."""
    kind = hc.get("model_type")
    return kind == "qwen2" or (kind == "qwen2_moe" and bool(hc.get("qkv_bias", True)))


def _tied(hc: dict) -> bool:
    """``tie_word_embeddings``; absent, untied, as transformers reads a Llama or Qwen2
    ``config.json`` (saved ones always carry it)."""
    return bool(hc.get("tie_word_embeddings", False))


def hf_sources(hc: dict, dense_mlp: bool | Collection[int] = True
               ) -> dict[str, tuple[str, ...]]:
    """hybrid parameter name -> the Hugging Face weights it is made of (names without the
    ``model.`` prefix a state dict may add), in hybrid's order, for ``LlamaForCausalLM``
    or ``Qwen2ForCausalLM`` with ``config.json`` ``hc``: the one table of the Llama
    family (:func:`param_from_hf` makes each parameter of its sources).
    ``dense_mlp``: the layers whose MLP is a dense one (True: all; False: none, a
    Mixtral's experts, :mod:`hybrid.hf.mixtral`); the others' MLPs are left out."""
    # the Qwen family: q/k/v have biases, o_proj and the MLP never
    qwen = hc.get("model_type") in ("qwen2", "qwen2_moe")
    bias = bool(hc.get("attention_bias", False)) and not qwen
    qkv_bias = bias or _qkv_bias_only(hc)
    out: dict[str, tuple[str, ...]] = {"wte.weight": ("embed_tokens.weight",),
                                       "ln_f.weight": ("norm.weight",)}
    if not _tied(hc):
        out["output_layer.weight"] = ("lm_head.weight",)
    for i in range(hc["num_hidden_layers"]):
        src, dst = f"layers.{i}.", f"blocks.{i}."
        out[dst + "ln_1.weight"] = (src + "input_layernorm.weight",)
        out[dst + "ln_2.weight"] = (src + "post_attention_layernorm.weight",)
        if hc.get("model_type") in QK_NORM_TYPES:
            for n in ("q_norm", "k_norm"):
                out[f"{dst}attn.{n}.weight"] = (f"{src}self_attn.{n}.weight",)
        for kind in _kinds(qkv_bias):
            out[f"{dst}attn.qkv.{kind}"] = tuple(f"{src}self_attn.{n}_proj.{kind}" for n in "qkv")
        for kind in _kinds(bias):
            out[f"{dst}attn.proj.{kind}"] = (f"{src}self_attn.o_proj.{kind}",)
            if not _has_dense(dense_mlp, i):
                continue
            out[f"{dst}mlp.fc.{kind}"] = (f"{src}mlp.gate_proj.{kind}", f"{src}mlp.up_proj.{kind}")
            out[f"{dst}mlp.proj.{kind}"] = (f"{src}mlp.down_proj.{kind}",)
    return out


def param_from_hf(name: str, parts: list[torch.Tensor], hc: dict) -> torch.Tensor:
    """hybrid parameter ``name`` (fp32, contiguous) from its :func:`hf_sources` tensors:
    q, k and v fused per query group, gate and up stacked, the others as they are. Also
    the Adam moments of the sources give the parameter's (elementwise state moves as
    its weight does)."""
    if ".attn.qkv." in name:
        q, k, v = parts
        t = _qkv_from_hf(q, k, v, hc.get("num_key_value_heads") or hc["num_attention_heads"])
    elif ".mlp.fc." in name:
        t = torch.stack(parts)
    else:
        (t,) = parts
    return t.float().contiguous()


def from_hf_llama(hf: dict[str, torch.Tensor], hc: dict,
                  dense_mlp: bool | Collection[int] = True) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` state dict with ``config.json``
    ``hc`` -> hybrid state (unpadded vocabulary, fp32), through :func:`hf_sources` and
    :func:`param_from_hf`. ``dense_mlp``: as :func:`hf_sources`'."""
    get = hf_getter(hf)
    return {n: param_from_hf(n, [get(k) for k in srcs], hc)
            for n, srcs in hf_sources(hc, dense_mlp).items()}


def _rope(hc: dict) -> dict:
    """The RoPE flags of a Llama ``config.json`` (transformers 5 ``rope_parameters``, or
    the older top-level ``rope_theta`` / ``rope_scaling``): the base; position
    interpolation (``rope_type`` linear); Llama-3.1's scaling (``rope_type`` llama3)
    with the low/high factors and original context hybrid implements (those of
    every released Llama 3.x). Other variants are refused."""
    params = dict(hc.get("rope_scaling") or {})
    params.update(hc.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    flags = {"rotary_base": float(params.get("rope_theta", hc.get("rope_theta", 10000.0)))}
    if kind == "default":
        return flags
    if kind == "linear":
        return dict(flags, rotary_seq_len_interpolation_factor=float(params["factor"]))
    if kind != "llama3":
        raise CheckpointError(f"config.json: rope_type {kind!r}; only plain RoPE ('default'), "
                              f"position interpolation ('linear') and Llama-3.1's ('llama3') "
                              f"are implemented here")
    fixed = {"low_freq_factor": LOW_FREQ_FACTOR, "high_freq_factor": HIGH_FREQ_FACTOR,
             "original_max_position_embeddings": ORIGINAL_CONTEXT}
    for key, want in fixed.items():
        if float(params.get(key, want)) != want:
            raise CheckpointError(f"config.json: rope {key} {params[key]}; hybrid's llama3 "
                                  f"scaling (Megatron's --use-rope-scaling) uses {want:g}")
    return dict(flags, use_rope_scaling=True, rope_scaling_factor=float(params["factor"]))


def _rope_parameters(f: dict) -> dict:
    """``rope_parameters`` of ``config.json`` for :func:`architecture_fields` ``f``."""
    theta, factor = f["rotary_base"], f["rope_scaling_factor"]
    interp = f["rotary_seq_len_interpolation_factor"]
    if interp is not None:
        return {"rope_type": "linear", "rope_theta": theta, "factor": interp}
    if factor is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
            "low_freq_factor": LOW_FREQ_FACTOR, "high_freq_factor": HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": ORIGINAL_CONTEXT}


def _llama_shape_flags(hc: dict) -> dict:
    """The flags a Llama, a Qwen2 and a Qwen3 ``config.json`` share (all but the biases
    and the q/k norms); ``head_dim``, when it is not hidden / heads, as --kv-channels."""
    heads, hidden = hc["num_attention_heads"], hc["hidden_size"]
    if hc.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hc['hidden_act']!r}; SwiGLU is silu")
    head_dim = hc.get("head_dim")
    if head_dim is not None and not (isinstance(head_dim, int) and head_dim >= 1):
        raise CheckpointError(f"config.json: head_dim {head_dim!r} is not a positive integer")
    groups = hc.get("num_key_value_heads") or heads
    flags = {"num_layers": hc["num_hidden_layers"], "hidden_size": hidden,
             "num_attention_heads": heads}
    if head_dim is not None and (hidden % heads or head_dim != hidden // heads):
        flags["kv_channels"] = head_dim
    flags |= {"ffn_hidden_size": hc["intermediate_size"],
              "max_position_embeddings": hc["max_position_embeddings"],
              "normalization": "RMSNorm", "norm_epsilon": hc.get("rms_norm_eps", 1e-6),
              "swiglu": True, "position_embedding_type": "rope", **_rope(hc)}
    if groups != heads:
        flags.update(group_query_attention=True, num_query_groups=groups)
    if not _tied(hc):
        flags["untie_embeddings_and_output_weights"] = True
    return flags


def llama_flags(hc: dict) -> dict:
    """hybrid's flags (TrainConfig fields) for a Llama ``config.json``; CheckpointError
    naming the field for what hybrid cannot express."""
    if bool(hc.get("attention_bias", False)) != bool(hc.get("mlp_bias", False)):
        raise CheckpointError("config.json: attention_bias and mlp_bias differ; hybrid's "
                              "--disable-bias-linear covers both")
    flags = _llama_shape_flags(hc)
    if not hc.get("attention_bias", False):
        flags["disable_bias_linear"] = True
    return flags


def qwen2_flags(hc: dict) -> dict:
    """hybrid's flags for a Qwen2 (or Qwen2.5) ``config.json``: a Llama with biases on
    q, k and v only (``--disable-bias-linear --add-qkv-bias``). Sliding-window
    attention is refused: hybrid's attention is full and causal on every layer."""
    check_full_attention(hc)
    return dict(_llama_shape_flags(hc), disable_bias_linear=True, add_qkv_bias=True)


def check_full_attention(hc: dict) -> None:
    """CheckpointError naming the field when a Qwen-family ``config.json`` asks for
    sliding-window attention on some layer."""
    if hc.get("use_sliding_window", False):
        raise CheckpointError("config.json: use_sliding_window is true; hybrid's attention "
                              "is full causal attention on every layer")
    other = sorted(set(hc.get("layer_types") or ()) - {"full_attention"})
    if other:
        raise CheckpointError(f"config.json: layer_types has {', '.join(map(repr, other))}; "
                              f"hybrid implements only 'full_attention' layers")


def llama_shaped(c: dict, family: str) -> dict:
    """:func:`architecture_fields` of saved config ``c``; CheckpointError naming the flags
    a Llama-shaped Hugging Face ``family`` needs when ``c`` lacks them."""
    f = architecture_fields(c)
    missing = is_llama(f)
    if missing:
        raise CheckpointError(f"neither GPT-2 nor Llama-shaped: a Hugging Face {family} "
                              f"needs {', '.join(missing)}")
    return f


def _hf_shape_config(c: dict, vocab_size: int, family: str,
                     qk_norm: bool = False) -> tuple[dict, dict]:
    """(:func:`architecture_fields` of ``c``, the ``config.json`` keys the Llama-shaped
    families share); CheckpointError naming the flags a Llama-shaped model needs, and
    --qk-layernorm unless the ``family`` has q and k norms (``qk_norm``: Qwen3's)."""
    f = llama_shaped(c, family)
    if f["qk_layernorm"] and not qk_norm:
        raise CheckpointError(f"--qk-layernorm: a Hugging Face {family} has no q/k norms "
                              f"(Qwen3 and Qwen3-MoE have them)")
    heads = c["num_attention_heads"]
    rope = _rope_parameters(f)
    return f, {
        "vocab_size": vocab_size, "hidden_size": c["hidden_size"],
        "intermediate_size": c["ffn_hidden_size"],
        "num_hidden_layers": c["num_layers"], "num_attention_heads": heads,
        "head_dim": f["kv_channels"] or c["hidden_size"] // heads,
        "num_key_value_heads": f["num_query_groups"] or heads, "hidden_act": "silu",
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": f["norm_epsilon"],
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],  # what transformers 4.x reads (and rope_scaling)
        **({"rope_scaling": rope} if rope["rope_type"] != "default" else {}),
        "attention_dropout": c.get("attention_dropout", 0.0),
        "initializer_range": c.get("init_method_std", 0.02),
        "tie_word_embeddings": not f["untie_embeddings_and_output_weights"],
        # hybrid does not know the tokenizer's special ids: set them for generation
        "bos_token_id": None, "eos_token_id": None, "use_cache": True}


def llama_hf_config(c: dict, vocab_size: int) -> dict:
    """``config.json`` of ``LlamaForCausalLM`` for a hybrid saved config ``c``."""
    f, shape = _hf_shape_config(c, vocab_size, "Llama")
    if f["add_qkv_bias"] and not f["add_bias_linear"]:
        raise CheckpointError("--add-qkv-bias without the other biases is Qwen2, not Llama")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
            "attention_bias": f["add_bias_linear"], "mlp_bias": f["add_bias_linear"]}


def qwen2_hf_config(c: dict, vocab_size: int) -> dict:
    """``config.json`` of ``Qwen2ForCausalLM`` for a hybrid saved config ``c`` (with
    ``--disable-bias-linear --add-qkv-bias``): full attention on every layer."""
    f, shape = _hf_shape_config(c, vocab_size, "Qwen2")
    if f["add_bias_linear"] or not f["add_qkv_bias"]:
        raise CheckpointError("a Hugging Face Qwen2 needs --disable-bias-linear --add-qkv-bias")
    layers = c["num_layers"]
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **shape,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
            "layer_types": ["full_attention"] * layers}
