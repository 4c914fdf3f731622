"""``deepspeed.moe.utils``: the parameter-group helpers, over a model with no experts.

hybrid builds no expert parameter yet (:mod:`hybrid.deepspeed.moe.layer`), so every
parameter is a shared one: ``split_params_into_different_moe_groups_for_optimizer``
returns the groups it is given as a list, each group as it was, which is what
DeepSpeed's returns for a model without MoE layers; ``is_moe_param`` is False and
``has_moe_layers`` is ``(False, 0)``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from hybrid.deepspeed.missing import refuse

__all__ = ["has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: Any) -> bool:
    """Whether ``param`` belongs to an expert: never, in hybrid today."""
    return False


def is_moe_param_group(param_group: dict) -> bool:
    """Whether an optimizer group holds expert parameters (its ``"moe"`` key)."""
    return bool(param_group.get("moe", False))


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether ``model`` has MoE layers, their experts): ``(False, 0)``."""
    return False, 0


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict | list | tuple, max_group_size: int | float | None = None
) -> list[dict]:
    """The optimizer groups, expert parameters in groups of their own: with none, the
    groups given, as a list (a dict is one group). ``max_group_size`` cuts expert groups
    only, so it changes nothing here."""
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups "
                     f"is a {type(param_groups).__name__}; give a dict or a list of dicts")


def __getattr__(name: str) -> NoReturn:
    refuse("moe.utils", name, "DeepSpeed's MoE is not in hybrid yet; it serves the "
                              "parameter-group helpers only")
