"""A mixture of experts in hybrid's Megatron export (``export --to megatron`` of an MoE
checkpoint): what megatron-core 0.16.1's MoE GPT (local spec: ``TopKRouter``,
``SequentialMLP``) at EP ``ep`` loads and continues from.

* The model: the router ``decoder.layers.mlp.router.weight`` ``(layers, E, C)`` and the
  experts ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``(layers, E, 2F, C)``
  / ``linear_fc2.weight`` ``(layers, E, C, F)`` at their global expert indices (the name
  table, :mod:`.megatron_names`), which load at any EP; each expert linear's (empty)
  extra state, ``..._extra_state/shard_<layer>.<expert>_<layers>.<E>``.
* The optimizer: megatron-core's two chained optimizers, the dense parameters' (the router
  among them) ``chained_0.`` and the experts' ``chained_1.`` -- without the distributed
  optimizer their ``optimizer.state.exp_avg.*`` keys and ``common.pt``'s ``optimizer``
  ``{0: dense, 1: experts}`` (each its torch AdamW's param groups and ``common_step``; the
  experts' one group, ``is_expert_parallel``); with ``--megatron-dist-opt
  dp_reshardable`` the dense buffer as a dense GPT's and the experts' buffer per EP rank
  (:class:`~.megatron_distopt_export.ExpertDpReshardable`).
* ``args``: the MoE flags (:func:`moe_args`).

What it cannot write is one CheckpointError naming the flag (:func:`check`)."""

from __future__ import annotations

from typing import Any

import torch

from hybrid.checkpoint.peers import megatron_names as names
from hybrid.errors import CheckpointError

DENSE_CHAIN, EXPERT_CHAIN = "chained_0.", "chained_1."

# hybrid's MoE flags written into args as they are (megatron-core's names)
_SAME = ("moe_router_topk", "moe_aux_loss_coeff", "moe_z_loss_coeff",
         "moe_router_load_balancing_type", "moe_router_score_function",
         "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
         "moe_router_group_topk", "moe_expert_capacity_factor", "moe_token_drop_policy",
         "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type")


def is_moe(cfg: dict) -> bool:
    return bool(cfg.get("num_experts"))


def check(ckpt: str, cfg: dict, shapes: dict[str, list[int]], tp: int, pp: int, ep: int,
          dp: int, dist_opt: str | None, spec: str, bf16: bool) -> None:
    """One CheckpointError naming the flag for an MoE export hybrid does not write: a
    shared expert, an expert bias, grouped GEMM, dense layers among the MoE ones, TP or
    PP > 1, an EP that does not split the experts (or, dp_reshardable, the DP ranks),
    fully_reshardable, the Transformer Engine spec, a bf16 run."""
    E = int(cfg["num_experts"])
    refused = {
        "--moe-shared-expert-intermediate-size": cfg.get("moe_shared_expert_intermediate_size"),
        "--moe-router-enable-expert-bias": cfg.get("moe_router_enable_expert_bias"),
        "--moe-grouped-gemm": cfg.get("moe_grouped_gemm")}
    for flag, value in refused.items():
        if value:
            raise CheckpointError(f"{ckpt}: {flag} {value}: export --to megatron writes "
                                  f"megatron-core's local spec's routed SequentialMLP experts "
                                  f"only (no shared expert, expert bias or grouped GEMM)")
    layers = int(cfg["num_layers"])
    dense = [i for i in range(layers) if f"blocks.{i}.{names.EXPERTS[0]}" not in shapes]
    if dense:
        raise CheckpointError(f"{ckpt}: --moe-layer-freq {cfg.get('moe_layer_freq')!r}: "
                              f"layers {dense} are dense; export --to megatron writes an MoE "
                              f"GPT with experts in every layer")
    for flag, size in (("--tensor-model-parallel-size", tp),
                       ("--pipeline-model-parallel-size", pp)):
        if size != 1:
            raise CheckpointError(f"{flag} {size}: hybrid writes an MoE checkpoint for TP 1 "
                                  f"and PP 1 (expert TP 1)")
    if ep < 1 or E % ep or (dist_opt and dp % ep):
        raise CheckpointError(f"--expert-model-parallel-size {ep}: must divide the {E} "
                              f"experts" + (f" and --data-parallel-size {dp}" if dist_opt
                                            else ""))
    if dist_opt not in (None, "dp_reshardable"):
        raise CheckpointError(f"--megatron-dist-opt {dist_opt}: an MoE checkpoint is written "
                              f"for the non-distributed optimizer or dp_reshardable")
    if dist_opt and spec != "local":
        raise CheckpointError(f"--megatron-layer-spec {spec}: an MoE checkpoint's buckets "
                              f"are written for the local spec")
    if bf16:
        raise CheckpointError(f"{ckpt}: a bf16 run: an MoE checkpoint is written for an "
                              f"fp32 run (--dtype fp32)")


def chain(name: str) -> str:
    """The chained optimizer holding ``name``'s state (hybrid's name)."""
    return EXPERT_CHAIN if name.endswith(names.EXPERTS) else DENSE_CHAIN


def expert_groups(groups: list[dict]) -> list[dict]:
    """The expert optimizer's param groups for the dense one's ``groups``
    (:func:`~.megatron_distopt_export.param_groups`): the decayed one, expert-parallel
    (the experts have no biases or norms)."""
    return [{**groups[0], "is_expert_parallel": True}]


def moe_args(cfg: dict, shapes: dict[str, list[int]], ep: int) -> dict[str, Any]:
    """``args``' MoE fields for hybrid's flat config ``cfg`` at EP ``ep``."""
    proj = next(s for n, s in shapes.items() if n.endswith(names.EXPERTS[1]))
    out: dict[str, Any] = {k: cfg.get(k) for k in _SAME if k in cfg}
    out.update(num_experts=int(cfg["num_experts"]),
               moe_ffn_hidden_size=cfg.get("moe_ffn_hidden_size") or proj[-1],
               moe_layer_freq=1, moe_grouped_gemm=False,
               moe_shared_expert_intermediate_size=None, moe_router_enable_expert_bias=False,
               expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    return out


def extra_state(num_layers: int, E: int) -> list[str]:
    """The expert linears' extra state keys megatron-core's SequentialMLP saves."""
    return [f"{names.LAYERS_PREFIX}mlp.experts.experts.{lin}._extra_state/"
            f"shard_{i}.{e}_{num_layers}.{E}"
            for lin in ("linear_fc1", "linear_fc2") for i in range(num_layers)
            for e in range(E)]


def plain_common(dense: dict, experts_groups: list[dict], moments: bool,
                 step: int) -> dict:
    """``common.pt``'s ``optimizer`` of the chained non-distributed optimizers:
    ``{0: dense, 1: experts}`` (``dense``: the dense one's, an fp32 run's FP32Optimizer
    state)."""
    state = {"common_step": torch.tensor(float(step))} if moments else {}
    return {0: dense, 1: {"state": state, "param_groups": [
        {k: v for k, v in g.items() if k != "step"} for g in experts_groups]}}


__all__ = ["DENSE_CHAIN", "EXPERT_CHAIN", "check", "chain", "expert_groups", "extra_state",
           "is_moe", "moe_args", "plain_common"]
