"""``deepspeed.moe.utils``: which parameters are experts, and the optimizer groups that keep
them apart.

An expert parameter is one a :class:`~hybrid.deepspeed.moe.layer.MoE` layer copied from
its ``expert`` (``allreduce = False``, ``group_name = "ep_size_<N>"``, as DeepSpeed marks
them). :func:`split_params_into_different_moe_groups_for_optimizer` returns the groups
given, their expert parameters taken out, followed by one group per (given group, expert
group name) holding them (``"moe": True``, ``"name"`` the expert group's), cut into
groups of at most ``max_group_size`` elements: DeepSpeed's groups, in its order (expert
group names sorted, where DeepSpeed takes a set's order).

:func:`attach_expert_groups` is hybrid's, called by ``deepspeed.initialize``: it gives
each layer the engine's EP group and marks its experts' parameters as the engine's ZeRO
expects (:func:`hybrid.tensor_parallel.sharding.mark_expert_split`).
"""

from __future__ import annotations

from typing import NoReturn

import torch
from torch import nn

from hybrid.deepspeed.missing import refuse
from hybrid.deepspeed.moe.layer import MoE
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel.sharding import mark_expert_split

__all__ = ["attach_expert_groups", "expert_parallel_size", "has_moe_layers", "is_moe_param",
           "is_moe_param_group", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default cut, in elements


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert's (marked ``allreduce = False`` by a MoE layer)."""
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: dict) -> bool:
    """Whether an optimizer group holds expert parameters (its ``"moe"`` key)."""
    return bool(param_group.get("moe", False))


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether ``model`` has MoE layers, the first one's ``num_experts``; 0 without)."""
    for module in model.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]
                                               ) -> tuple[list[nn.Parameter],
                                                          list[nn.Parameter]]:
    """(the shared parameters, the expert ones), each in the order given."""
    return ([p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)])


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict | list | tuple,
        max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE) -> list[dict]:
    """The optimizer groups with the expert parameters in groups of their own (module
    doc). Each given group needs a ``"name"`` when it holds experts, as DeepSpeed's."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups "
                         f"is a {type(param_groups).__name__}; give a dict or a list of dicts")
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    added: list[dict] = []
    for group in groups:
        params = list(group["params"])
        if names and "name" not in group:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer: a group "
                             "without a 'name' key; name each group (DeepSpeed needs it too)")
        for name in names:
            mine = [p for p in params if is_moe_param(p) and p.group_name == name]
            base = {**group, "name": name, "moe": True}
            added.extend({**base, "params": part} for part in _cut(mine, max_group_size))
        group["params"] = [p for p in params if not is_moe_param(p)]
    return groups + added


def _cut(params: list[nn.Parameter], most: int | float | None) -> list[list[nn.Parameter]]:
    """``params`` in runs of at most ``most`` elements (a larger one alone); all in one
    run when ``most`` is None; no run when there is none."""
    if most is None:
        return [params] if params else []
    runs: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if runs and size + p.numel() <= most:
            runs[-1].append(p)
            size += p.numel()
        else:
            runs.append([p])
            size = p.numel()
    return runs


def expert_parallel_size(model: nn.Module) -> int:
    """The EP size of ``model``'s MoE layers (1 without any); layers of different
    ``ep_size`` are refused (hybrid has one EP group per layout)."""
    sizes = {m.ep_size for m in model.modules() if isinstance(m, MoE)}
    if len(sizes) > 1:
        raise ConfigError(f"deepspeed.moe.layer.MoE layers of ep_size {sorted(sizes)}: hybrid "
                          f"lays out one expert-parallel size per job; give every layer the "
                          f"same ep_size")
    return sizes.pop() if sizes else 1


def attach_expert_groups(model: nn.Module, ps: ParallelState) -> None:
    """Give each MoE layer of ``model`` the EP group of ``ps``, and mark its experts'
    parameters as slices, along dim 0, of a tensor stacked over the EP ranks (at EP > 1:
    the engine then reduces and shards them over ``ps.edp_group``)."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        module.set_deepspeed_parallelism(ps.ep_group)
        if module.ep_size == 1:
            continue
        for p in module.deepspeed_moe.experts.parameters():
            if p.ndim == 0:
                raise ConfigError("deepspeed.moe.layer.MoE: an expert with a 0-dim parameter "
                                  "cannot be split over the EP ranks; give it a 1-dim one")
            mark_expert_split(p, (module.ep_size * p.shape[0], *p.shape[1:]),
                              ps.ep_group.rank, module.ep_size)


def __getattr__(name: str) -> NoReturn:
    refuse("moe.utils", name, "it serves the expert and parameter-group helpers")

