"""Megatron-LM's ``args`` (the Namespace in ``common.pt`` or a legacy file) read against
the run: the architecture flags it records (:func:`megatron_flags`), the tokenizer's
vocabulary (:func:`tokenizer_vocab`), and the numbers and switches hybrid takes from the
run's own flags, checked equal (:func:`check_run_numbers`).
"""

from __future__ import annotations

from typing import Any

from hybrid.errors import CheckpointError


def arg(args: Any, name: str, default=None):
    """``args.name`` of Megatron-LM's Namespace (``default`` without it or without args)."""
    return getattr(args, name, default) if args is not None else default


# the architecture flags Megatron-LM's args and hybrid's config name alike
_SAME_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "normalization", "swiglu", "position_embedding_type",
               "untie_embeddings_and_output_weights", "qk_layernorm", "num_experts")
# a mixture of experts' shape and routing (with args.num_experts only: Megatron-LM's args
# carry its MoE defaults for a dense model too)
_MOE_FLAGS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
              "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
              "moe_shared_expert_intermediate_size")


def megatron_flags(args: Any) -> dict:
    """hybrid's architecture flags for Megatron-LM's ``args`` (the ones it records)."""
    if args is None:
        return {}
    out: dict[str, Any] = {}
    for name in _SAME_FLAGS + (_MOE_FLAGS if arg(args, "num_experts") else ()):
        v = arg(args, name)
        if v is not None:
            out[name] = v
    if arg(args, "add_bias_linear") is not None:
        out["disable_bias_linear"] = not args.add_bias_linear
        # (biases on q, k and v alone: with every linear's, Megatron's qkv has one anyway)
        out["add_qkv_bias"] = bool(arg(args, "add_qkv_bias")) and not args.add_bias_linear
    if arg(args, "group_query_attention"):
        out["group_query_attention"] = True
        out["num_query_groups"] = args.num_query_groups
    return out


# the tokenizers Megatron-LM builds from --vocab-size alone, adding their EOD token
_NULL_TOKENIZERS = ("NullTokenizer", "NullMultimodalTokenizer")


def tokenizer_vocab(args: Any) -> int | None:
    """The tokenizer's vocabulary Megatron-LM's ``args`` record: ``vocab_size`` is the size
    before the EOD token the Null tokenizers add, the whole vocabulary for TikTokenizer's,
    and unused by the other tokenizers (their files say: None, not recorded); without
    ``tokenizer_type`` (not Megatron-LM's own save) ``vocab_size`` as it is."""
    size, kind = arg(args, "vocab_size"), arg(args, "tokenizer_type")
    if size is None or kind in (None, "TikTokenizer"):
        return size
    return int(size) + 1 if kind in _NULL_TOKENIZERS else None


# the model's numbers hybrid takes from the run's flags (as Megatron-LM's own load does):
# (hybrid's flag, Megatron-LM's args names, newest first; whether only with RoPE)
_RUN_NUMBERS = (("norm_epsilon", ("layernorm_epsilon", "norm_epsilon"), False),
                ("rotary_base", ("rotary_base",), True),
                ("rotary_percent", ("rotary_percent",), True))


# Megatron-LM's switches of the same shapes' computation hybrid's GPT does not have
_NO_SUCH_SWITCH = ("rotary_interleaved", "apply_layernorm_1p", "squared_relu")


def check_run_numbers(args: Any, config: dict, where: str) -> None:
    """One error naming the flag where Megatron-LM's ``args`` record a norm epsilon (its
    ``layernorm_epsilon``, ``norm_epsilon`` before), or with RoPE a rotary base or
    percent, other than the run's ``config``: continued at another, the model would
    compute other numbers from the same weights; and one naming a switch of that kind
    hybrid does not have (:data:`_NO_SUCH_SWITCH`) the save turned on."""
    rope = arg(args, "position_embedding_type") == "rope"
    for switch in _NO_SUCH_SWITCH:
        if arg(args, switch) and (rope or switch != "rotary_interleaved"):
            raise CheckpointError(f"{where}: its args.{switch} is on (Megatron-LM's "
                                  f"--{switch.replace('_', '-')}), which hybrid's GPT does "
                                  f"not compute")
    for flag, saved_as, rope_only in _RUN_NUMBERS:
        if rope_only and not rope:
            continue
        name = next((n for n in saved_as if arg(args, n) is not None), None)
        if name is None or flag not in config:
            continue
        saved, mine = float(getattr(args, name)), float(config[flag])
        if saved != mine:
            raise CheckpointError(
                f"{where}: its args.{name} is {saved:g}, this run's --{flag.replace('_', '-')}"
                f" {mine:g}: give --{flag.replace('_', '-')} {saved:g} (Megatron's model)")
