"""The mixture-of-experts options (Megatron's ``--num-experts`` and ``--moe-*`` flags) as
one section of the model: :class:`MoEConfig`, held by
:class:`hybrid.config.model.ModelConfig` as ``moe`` (None: a dense model).

The fields are the flags, by Megatron's names. :meth:`MoEConfig.from_flags` reads them
from checked Flags or from the flat ``config`` dict a checkpoint's ``metadata.json``
stores (a checkpoint of a dense model, or one written before these flags, has no
``num_experts`` and reads as dense); :func:`validate_moe` holds the checks that read two
or more options (:func:`hybrid.config.build_config` calls it). No torch here.

[Note: which layers are MoE]
``--moe-layer-freq`` is Megatron's: an int N makes every N-th layer an MoE layer,
counting from layer 0 (1: all of them); a list of 0/1 of one entry per layer names them,
written as a Python expression of lists, ints, ``+`` and ``*`` (``"([0]*1+[1]*3)*2"``:
a dense first layer, then three MoE ones, twice; DeepSeek-V3's dense first layers).
It is evaluated without ``eval``: only those literals and operators are taken.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, fields
from typing import Any

from hybrid.config.options import opt
from hybrid.errors import ConfigError
from hybrid.parallel.layout import check_expert_layout

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("allgather", "alltoall")


@dataclass(frozen=True)
class MoEConfig:
    """The MoE layers of a model: how many experts, how tokens are routed to them, what
    the routing costs in the loss, how much an expert takes (``models.moe``)."""

    num_experts: int | None = opt(
        None, "experts in each MoE layer (default: none, a dense model)", at_least=1)
    moe_router_topk: int = opt(2, "experts each token goes to", at_least=1)
    moe_ffn_hidden_size: int | None = opt(
        None, "each expert's MLP width (default: --ffn-hidden-size)", at_least=1)
    moe_layer_freq: str = opt(
        "1", "which layers are MoE: N, every N-th from layer 0 (1: all), or a list of 0/1 per "
        "layer as a Python expression, e.g. '([0]*1+[1]*3)*2'")
    moe_shared_expert_intermediate_size: int | None = opt(
        None, "width of a shared expert every token also goes through (default: none)",
        at_least=1)
    moe_shared_expert_gate: bool = opt(
        False, "the shared expert's output times a learnt sigmoid gate of the token (one "
        "weight vector, Qwen2-MoE's); needs --moe-shared-expert-intermediate-size")
    moe_router_score_function: str = opt(
        "softmax", "softmax (Mixtral's) or sigmoid (DeepSeek-V3's) router scores",
        choices=SCORE_FUNCTIONS, refused={"sqrtsoftplus": "hybrid's routers are softmax or "
                                                          "sigmoid"})
    moe_router_pre_softmax: bool = opt(
        False, "softmax over all experts, then the top k (the gates sum to less than 1); "
        "default: the top k logits, then a softmax over those k")
    moe_router_topk_scaling_factor: float | None = opt(
        None, "the gates are multiplied by this (DeepSeek's routed scaling factor)", above=0)
    moe_router_num_groups: int | None = opt(
        None, "group-limited routing: the experts in this many equal groups (DeepSeek's "
        "devices or nodes), a token's experts from its best --moe-router-group-topk groups",
        at_least=1)
    moe_router_group_topk: int | None = opt(
        None, "with --moe-router-num-groups: the groups a token's experts come from, each "
        "group scored by the sum of its top (topk / this) router scores", at_least=1)
    moe_router_enable_expert_bias: bool = opt(
        False, "with --moe-router-score-function sigmoid: an expert bias that ranks experts, "
        "moved after each step toward the mean load (aux-loss-free balancing)")
    moe_router_bias_update_rate: float = opt(
        1e-3, "how far the expert bias moves each step", at_least=0)
    moe_router_load_balancing_type: str = opt(
        "aux_loss", "aux_loss (Switch: over each micro-batch's tokens), seq_aux_loss (over each "
        "sequence's, averaged), global_aux_loss (the expert fractions of the step's running "
        "counts over every DP rank: its value depends on the DP size, as Megatron's) or none",
        choices=LOAD_BALANCING_TYPES,
        refused={"sinkhorn": "hybrid has no Sinkhorn routing: use aux_loss"})
    moe_aux_loss_coeff: float = opt(
        0.0, "weight of the load-balancing loss, per MoE layer", at_least=0)
    moe_z_loss_coeff: float | None = opt(
        None, "weight of the router z-loss, per MoE layer (default: none)", at_least=0)
    moe_expert_capacity_factor: float | None = opt(
        None, "each expert takes at most ceil(tokens x topk / experts x this) per micro-batch, "
        "the rest dropped (default: dropless)", above=0)
    moe_token_drop_policy: str = opt(
        "probs", "under a capacity, keep the largest gates (probs) or the earliest tokens "
        "(position)", choices=DROP_POLICIES)
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "with a capacity factor: every expert computes capacity rows (padding rows add "
        "nothing), as Megatron's")
    moe_grouped_gemm: bool = opt(
        False, "no effect: each expert's rows run in one matmul pair (a grouped GEMM written "
        "as a loop over the experts)")
    moe_token_dispatcher_type: str = opt(
        "allgather", "how tokens reach their experts' ranks: allgather or alltoall (the same "
        "numbers)", choices=DISPATCHERS,
        refused={"flex": "hybrid has no DeepEP dispatcher: use alltoall"})

    @classmethod
    def from_flags(cls, f) -> MoEConfig | None:
        """The section of checked Flags, or of a checkpoint's saved config dict; None for a
        dense model (no ``num_experts``)."""
        def get(name: str, default: Any) -> Any:
            value = f.get(name, default) if isinstance(f, dict) else getattr(f, name)
            return default if value is None else value
        if get("num_experts", None) is None:
            return None
        defaults = cls()
        return cls(**{fld.name: get(fld.name, getattr(defaults, fld.name))
                      for fld in fields(cls)})

    def layers(self, num_layers: int) -> tuple[bool, ...]:
        """Which of ``num_layers`` layers are MoE ([Note: which layers are MoE])."""
        return moe_layer_pattern(self.moe_layer_freq, num_layers)

    @property
    def capacity_factor(self) -> float | None:
        return self.moe_expert_capacity_factor

    @property
    def router_groups(self) -> tuple[int, int] | None:
        """(groups, groups a token picks) of group-limited routing; None: over all."""
        if self.moe_router_num_groups is None or self.moe_router_group_topk is None:
            return None
        return self.moe_router_num_groups, self.moe_router_group_topk


def _check_groups(f) -> None:
    """Group-limited routing's flags: both or neither, the experts in equal groups, the
    top k split evenly over the groups picked."""
    n, pick, k, E = (f.moe_router_num_groups, f.moe_router_group_topk, f.moe_router_topk,
                     f.num_experts)
    if (n is None) != (pick is None):
        given = "--moe-router-num-groups" if n is not None else "--moe-router-group-topk"
        other = "--moe-router-group-topk" if n is not None else "--moe-router-num-groups"
        raise ConfigError(f"{given} without {other}: group-limited routing takes both")
    if n is None or pick is None:
        return
    if E % n:
        raise ConfigError(f"--moe-router-num-groups {n} does not divide --num-experts {E}")
    if pick > n:
        raise ConfigError(f"--moe-router-group-topk {pick} is more than "
                          f"--moe-router-num-groups {n}")
    if k % pick or k // pick > E // n:
        raise ConfigError(f"--moe-router-topk {k} must split evenly over "
                          f"--moe-router-group-topk {pick} groups of {E // n} experts each")


def moe_layer_pattern(freq: str, num_layers: int) -> tuple[bool, ...]:
    """``--moe-layer-freq`` as one bool per layer ([Note: which layers are MoE]); a
    ConfigError naming the flag for anything else."""
    try:
        value = _literal(ast.parse(freq.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise ConfigError(f"--moe-layer-freq {freq!r}: give an int N or a list of 0/1 per "
                          f"layer such as '([0]*1+[1]*3)*2' ({e})") from None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"--moe-layer-freq {freq!r}: N must be at least 1")
        return tuple(i % value == 0 for i in range(num_layers))
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise ConfigError(f"--moe-layer-freq {freq!r}: a list must hold 0s and 1s only")
    if len(value) != num_layers:
        raise ConfigError(f"--moe-layer-freq {freq!r} names {len(value)} layers; the model "
                          f"has --num-layers {num_layers}")
    return tuple(bool(v) for v in value)


_OPS = {ast.Add: operator.add, ast.Mult: operator.mul}


def _literal(node: ast.AST) -> Any:
    """An int, a list of ints, or ``+`` / ``*`` of those: nothing else is evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_literal(node.left), _literal(node.right))
    raise ValueError(f"{ast.dump(node)[:40]}... is not an int, a list, + or *")


def validate_moe(f, world_size: int) -> None:
    """The MoE checks that read two or more options of checked Flags (and the expert
    layout of ``world_size`` ranks), each one ConfigError naming the flag to change."""
    given = [fld.name for fld in fields(MoEConfig) if fld.name != "num_experts"
             and (fld.name in f.explicit_flags or getattr(f, fld.name) != fld.default)]
    for size in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        if getattr(f, size) > 1:
            given.append(size)
    if f.num_experts is None:
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise ConfigError(f"{flags}: options of MoE layers, and the model has none: "
                              f"add --num-experts N")
        return
    moe = MoEConfig.from_flags(f)
    assert moe is not None
    if f.moe_router_topk > f.num_experts:
        raise ConfigError(f"--moe-router-topk {f.moe_router_topk} is more than --num-experts "
                          f"{f.num_experts}")
    moe.layers(f.num_layers)  # (raises for a pattern that does not fit)
    if f.moe_router_enable_expert_bias and f.moe_router_score_function != "sigmoid":
        raise ConfigError("--moe-router-enable-expert-bias ranks sigmoid scores: add "
                          "--moe-router-score-function sigmoid")
    if f.moe_router_pre_softmax and f.moe_router_score_function != "softmax":
        raise ConfigError("--moe-router-pre-softmax is a softmax router's: drop it with "
                          "--moe-router-score-function sigmoid")
    _check_groups(f)
    if f.moe_shared_expert_gate and f.moe_shared_expert_intermediate_size is None:
        raise ConfigError("--moe-shared-expert-gate gates the shared expert: add "
                          "--moe-shared-expert-intermediate-size")
    if f.moe_pad_expert_input_to_capacity and f.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity pads to the capacity: add "
                          "--moe-expert-capacity-factor")
    ep = f.expert_model_parallel_size
    if f.num_experts % ep:
        raise ConfigError(f"--num-experts {f.num_experts} is not divisible by "
                          f"--expert-model-parallel-size {ep}")
    etp = f.expert_tensor_parallel_size
    ffn = f.moe_ffn_hidden_size or f.ffn_hidden_size
    if etp > 1 and ffn is not None and ffn % etp:
        raise ConfigError(f"--moe-ffn-hidden-size {ffn} (each expert's hidden units) is not "
                          f"divisible by --expert-tensor-parallel-size {etp}")
    check_expert_layout(world_size, etp, ep, f.pipeline_model_parallel_size)
    # [Note: MoE under TP] the experts are whole on each rank (ETP 1): a TP rank must
    # route tokens of its own, which sequence parallelism gives it (Megatron's rule too)
    if f.tensor_model_parallel_size > 1 and not f.sequence_parallel:
        raise ConfigError(f"--tensor-model-parallel-size {f.tensor_model_parallel_size} with "
                          f"--num-experts: the MoE layers route each TP rank's own tokens; "
                          f"add --sequence-parallel")
