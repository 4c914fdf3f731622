"""``deepspeed.moe``: what a dense script imports from it (DeepSpeed's MoE layer itself is
not in hybrid yet; hybrid's own MoE layers are ``models.moe``).

* :mod:`.utils`  the parameter-group helpers a script calls whether or not it builds an
                 MoE layer (``split_params_into_different_moe_groups_for_optimizer``,
                 ``is_moe_param``, ``has_moe_layers``): with no expert parameter they leave
                 the groups as they are, as DeepSpeed's do
* :mod:`.layer`  ``MoE``, refused when built: DeepSpeed's gating is not in hybrid yet

DeepSpeedExamples' CIFAR script imports ``deepspeed.moe.utils`` at the top and builds
``deepspeed.moe.layer.MoE`` only with ``--moe``: without it the script runs, with it the
construction is the one error.
"""

from __future__ import annotations

from typing import NoReturn

from hybrid.deepspeed.missing import refuse
from hybrid.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]


def __getattr__(name: str) -> NoReturn:
    refuse("moe", name, "DeepSpeed's MoE is not in hybrid yet; deepspeed.moe serves utils "
                        "(the parameter-group helpers) and layer.MoE (refused when built)")
