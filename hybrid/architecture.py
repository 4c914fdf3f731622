"""The model-architecture flags (GPT-2, or the Llama family) as ``GPTConfig`` fields.

Megatron names the flags (``--normalization RMSNorm --swiglu
--position-embedding-type rope --group-query-attention --num-query-groups G
--untie-embeddings-and-output-weights --disable-bias-linear``); the model takes
them as :class:`models.gpt.GPTConfig` fields. :func:`architecture_fields` maps
one to the other, from a validated ``TrainConfig`` or from the ``config`` dict
a checkpoint's ``metadata.json`` stores -- where a checkpoint written before
these flags existed has none of the keys and reads as GPT-2.

No torch here: :mod:`hybrid.config` imports it to validate a command line.
"""

from __future__ import annotations

from typing import Any

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron's default MLP width with ``--swiglu``: 2/3 of 4h (gate and up are two
    matrices, so the parameters stay those of a 4h GELU MLP), rounded down to a
    multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def _get(c, name: str, default: Any) -> Any:
    value = c.get(name, default) if isinstance(c, dict) else getattr(c, name, default)
    return default if value is None else value


def architecture_fields(c) -> dict:
    """``GPTConfig`` keyword arguments of the architecture flags of ``c`` (a
    TrainConfig, or a checkpoint's saved config dict; missing keys: GPT-2)."""
    gqa = _get(c, "group_query_attention", False)
    return {
        "normalization": _get(c, "normalization", "LayerNorm"),
        "norm_epsilon": float(_get(c, "norm_epsilon", 1e-5)),
        "swiglu": bool(_get(c, "swiglu", False)),
        "position_embedding_type": _get(c, "position_embedding_type", "learned_absolute"),
        "rotary_base": float(_get(c, "rotary_base", 10000)),
        "rotary_percent": float(_get(c, "rotary_percent", 1.0)),
        "num_query_groups": _get(c, "num_query_groups", 1) if gqa else None,
        "untie_embeddings_and_output_weights":
            bool(_get(c, "untie_embeddings_and_output_weights", False)),
        "add_bias_linear": not _get(c, "disable_bias_linear", False),
    }


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


def is_gpt2(fields: dict) -> bool:
    """True when the flags describe GPT-2 (every architecture flag at its default)."""
    return (fields["normalization"] == "LayerNorm" and not fields["swiglu"]
            and fields["position_embedding_type"] == "learned_absolute"
            and fields["num_query_groups"] is None
            and not fields["untie_embeddings_and_output_weights"]
            and fields["add_bias_linear"])
