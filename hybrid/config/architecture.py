"""The model-architecture flags (GPT-2, or the Llama family) as ``ModelConfig`` fields.

Megatron names the flags (``--normalization RMSNorm --swiglu
--position-embedding-type rope --group-query-attention --num-query-groups G
--untie-embeddings-and-output-weights --disable-bias-linear --add-qkv-bias
--kv-channels --qk-layernorm``); the
model section takes them as :class:`hybrid.config.model.ModelConfig` fields.
:func:`architecture_fields` maps one to the other, from checked Flags or from the flat
``config`` dict
a checkpoint's ``metadata.json`` stores -- where a checkpoint written before
these flags existed has none of the keys and reads as GPT-2.

:func:`validate_architecture` holds their checks (:func:`hybrid.config.build_config`
calls it). No torch here: :mod:`hybrid.config` imports it to validate a
command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid.config.options import opt
from hybrid.errors import ConfigError

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


@dataclass(frozen=True)
class ArchitectureFlags:
    """The model flags ``ModelConfig`` does not take as they are: the widths and lengths
    derived when not given, and the architecture (:func:`architecture_fields` maps them,
    :func:`validate_architecture` checks them)."""

    kv_channels: int | None = opt(
        None, "width of each attention head (default --hidden-size / --num-attention-heads); "
        "QKV is then (heads + 2 x query groups) x this wide and the output projection takes "
        "heads x this (Qwen3's head_dim)", at_least=1)
    ffn_hidden_size: int | None = opt(
        None, "MLP width (default 4 x hidden; see --swiglu)", at_least=1)
    max_position_embeddings: int | None = opt(None, "positions (default: seq length)")
    use_flash_attn: bool = opt(False, "older Megatron name for --attention-backend flash")
    normalization: str = opt("LayerNorm", "LayerNorm or RMSNorm")
    norm_epsilon: float = opt(1e-5, "epsilon of every LayerNorm / RMSNorm", above=0)
    swiglu: bool = opt(
        False, "gated SiLU MLP; --ffn-hidden-size then defaults to int(8 x hidden / 3 / 64) x 64")
    openai_gelu: bool = opt(
        False, "the MLP's GELU is the tanh approximation (OpenAI's GPT-2; Hugging Face's "
        "gelu_new); default: the exact (erf) GELU, as Megatron's")
    position_embedding_type: str = opt("learned_absolute", "learned_absolute, rope or none")
    no_position_embedding: bool = opt(
        False, "Megatron's older spelling: no learned position embedding (--position-embedding-"
        "type none; beside rope, which has none, it changes nothing)")
    rotary_base: float = opt(10000.0, "RoPE frequency base (theta)", above=0)
    rotary_percent: float = opt(
        1.0, "fraction of each head's channels RoPE rotates", above=0, at_most=1)
    use_rope_scaling: bool = opt(
        False, "Llama-3.1's RoPE frequency scaling (low/high frequency factors 1 and 4, original "
        "context 8192)")
    rope_scaling_factor: float = opt(
        8.0, "with --use-rope-scaling: how much longer the low frequencies' wavelengths become")
    rotary_seq_len_interpolation_factor: float | None = opt(
        None, "RoPE position interpolation: positions divided by this (a model trained at length "
        "L then reads L x factor tokens)")
    group_query_attention: bool = opt(False, "grouped-query attention (--num-query-groups)")
    num_query_groups: int | None = opt(
        None, "key/value heads with --group-query-attention (default 1)")
    untie_embeddings_and_output_weights: bool = opt(
        False, "a separate output layer instead of the embedding's transpose")
    disable_bias_linear: bool = opt(False, "no biases in the linear layers")
    add_qkv_bias: bool = opt(
        False, "a bias on the QKV projection even with --disable-bias-linear (Qwen2)")
    qk_layernorm: bool = opt(
        False, "normalize each query and key head (--normalization over its --kv-channels, "
        "one weight per layer for q and one for k) before RoPE (Qwen3)")


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron's default MLP width with ``--swiglu``: 2/3 of 4h (gate and up are two
    matrices, so the parameters stay those of a 4h GELU MLP), rounded down to a
    multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def _get(c, name: str, default: Any) -> Any:
    value = c.get(name, default) if isinstance(c, dict) else getattr(c, name, default)
    return default if value is None else value


def _float_or_none(v) -> float | None:
    return None if v is None else float(v)


def architecture_fields(c) -> dict:
    """``ModelConfig`` keyword arguments of the architecture flags of ``c`` (a
    checked Flags, or a checkpoint's saved config dict; missing keys: GPT-2)."""
    gqa = _get(c, "group_query_attention", False)
    return {
        "normalization": _get(c, "normalization", "LayerNorm"),
        "norm_epsilon": float(_get(c, "norm_epsilon", 1e-5)),
        "swiglu": bool(_get(c, "swiglu", False)),
        # GPT-2's tanh GELU: what every checkpoint saved before the flag existed used
        "openai_gelu": bool(_get(c, "openai_gelu", True)),
        "position_embedding_type": _get(c, "position_embedding_type", "learned_absolute"),
        "rotary_base": float(_get(c, "rotary_base", 10000)),
        "rotary_percent": float(_get(c, "rotary_percent", 1.0)),
        "rope_scaling_factor": (float(_get(c, "rope_scaling_factor", 8.0))
                                if _get(c, "use_rope_scaling", False) else None),
        "rotary_seq_len_interpolation_factor":
            _float_or_none(_get(c, "rotary_seq_len_interpolation_factor", None)),
        "num_query_groups": _get(c, "num_query_groups", 1) if gqa else None,
        "untie_embeddings_and_output_weights":
            bool(_get(c, "untie_embeddings_and_output_weights", False)),
        "add_bias_linear": not _get(c, "disable_bias_linear", False),
        "add_qkv_bias": bool(_get(c, "add_qkv_bias", False)),
        "kv_channels": _get(c, "kv_channels", None),
        "qk_layernorm": bool(_get(c, "qk_layernorm", False)),
    }


# the ModelConfig fields architecture_fields fills, in order
ARCHITECTURE_FIELDS = ("normalization", "norm_epsilon", "swiglu", "openai_gelu",
                       "position_embedding_type",
                       "rotary_base", "rotary_percent", "rope_scaling_factor",
                       "rotary_seq_len_interpolation_factor", "num_query_groups",
                       "untie_embeddings_and_output_weights", "add_bias_linear",
                       "add_qkv_bias", "kv_channels", "qk_layernorm")


def is_llama(fields: dict) -> list[str]:
    """What keeps a model of these :func:`architecture_fields` from being a Hugging
    Face ``LlamaForCausalLM`` (empty when it is one)."""
    missing = []
    if fields["normalization"] != "RMSNorm":
        missing.append("--normalization RMSNorm")
    if not fields["swiglu"]:
        missing.append("--swiglu")
    if fields["position_embedding_type"] != "rope":
        missing.append("--position-embedding-type rope")
    if fields["rotary_percent"] != 1.0:
        missing.append("--rotary-percent 1.0")
    return missing


def is_qwen2(fields: dict) -> bool:
    """True when the biases are Qwen2's (q, k and v only): a Llama-shaped model with
    them is a Hugging Face ``Qwen2ForCausalLM`` rather than a ``LlamaForCausalLM``."""
    return fields["add_qkv_bias"] and not fields["add_bias_linear"]


def is_gpt2(fields: dict) -> bool:
    """True when the flags describe GPT-2 (every architecture flag at its default;
    ``kv_channels`` is checked on export, against the hidden size)."""
    return (fields["normalization"] == "LayerNorm" and not fields["swiglu"]
            and fields["position_embedding_type"] == "learned_absolute"
            and fields["num_query_groups"] is None
            and not fields["untie_embeddings_and_output_weights"]
            and fields["add_bias_linear"] and not fields["qk_layernorm"])


def validate_architecture(cfg) -> None:
    """Check the architecture flags of a :class:`hybrid.config.flags.Flags` (after its
    layout and head checks), raising one ConfigError naming the flag; fill ``num_query_groups`` (1,
    Megatron's default, with --group-query-attention) and, with --swiglu, the
    default ``ffn_hidden_size``."""
    tp = cfg.tensor_model_parallel_size
    if cfg.no_position_embedding and cfg.position_embedding_type == "learned_absolute":
        cfg.position_embedding_type = "none"  # (Megatron's add_position_embedding=False)
    if cfg.normalization not in NORMALIZATIONS:
        raise ConfigError(f"--normalization must be one of {', '.join(NORMALIZATIONS)}, "
                          f"got {cfg.normalization!r}")
    if cfg.openai_gelu and cfg.swiglu:
        raise ConfigError("--openai-gelu picks the GELU of the GPT-2 MLP; --swiglu's MLP has "
                          "no GELU: drop one of them")
    if cfg.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ConfigError(f"--position-embedding-type must be one of "
                          f"{', '.join(POSITION_EMBEDDING_TYPES)}, "
                          f"got {cfg.position_embedding_type!r}")
    if cfg.use_rope_scaling and cfg.position_embedding_type != "rope":
        raise ConfigError("--use-rope-scaling scales RoPE's frequencies: it needs "
                          "--position-embedding-type rope")
    if cfg.use_rope_scaling and not cfg.rope_scaling_factor >= 1:
        raise ConfigError(f"--rope-scaling-factor must be >= 1 (it divides the low "
                          f"frequencies), got {cfg.rope_scaling_factor}")
    interp = cfg.rotary_seq_len_interpolation_factor
    if interp is not None:
        if cfg.position_embedding_type != "rope":
            raise ConfigError("--rotary-seq-len-interpolation-factor divides RoPE's positions: "
                              "it needs --position-embedding-type rope")
        if not interp >= 1:
            raise ConfigError(f"--rotary-seq-len-interpolation-factor must be >= 1 (positions "
                              f"are divided by it), got {interp}")
        if cfg.use_rope_scaling:
            raise ConfigError("--rotary-seq-len-interpolation-factor and --use-rope-scaling "
                              "both stretch RoPE to a longer context: give one")
    head = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    rotary_dim = int(head * cfg.rotary_percent)
    if cfg.position_embedding_type == "rope" and (rotary_dim < 2 or rotary_dim % 2):
        raise ConfigError(f"--rotary-percent {cfg.rotary_percent} of the head size {head} "
                          f"rotates {rotary_dim} channels; RoPE needs an even number >= 2")
    if cfg.num_query_groups is not None and not cfg.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention")
    if cfg.group_query_attention:
        if cfg.num_query_groups is None:
            cfg.num_query_groups = 1  # Megatron's default: one key/value head
        g = cfg.num_query_groups
        if g < 1 or cfg.num_attention_heads % g:
            raise ConfigError(f"--num-attention-heads {cfg.num_attention_heads} is not "
                              f"divisible by --num-query-groups {g}")
        if g % tp:
            raise ConfigError(f"--num-query-groups {g} is not divisible by "
                              f"--tensor-model-parallel-size {tp}: each TP rank needs "
                              f"whole key/value heads")
    if cfg.swiglu and cfg.ffn_hidden_size is None:
        cfg.ffn_hidden_size = swiglu_ffn_hidden_size(cfg.hidden_size)
        if cfg.ffn_hidden_size < 1 or cfg.ffn_hidden_size % tp:
            raise ConfigError(f"--swiglu's default --ffn-hidden-size for --hidden-size "
                              f"{cfg.hidden_size} is {cfg.ffn_hidden_size}, not a "
                              f"positive multiple of --tensor-model-parallel-size {tp}: "
                              f"give --ffn-hidden-size")
