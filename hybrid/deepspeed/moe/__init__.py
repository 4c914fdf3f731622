"""``deepspeed.moe``: DeepSpeed's mixture-of-experts layer and its helpers.

* :mod:`.layer`   ``MoE``: DeepSpeed's layer (its gating, capacity, random token
                  selection, residual MoE), experts split over an expert-parallel group
* :mod:`.gating`  the top-1, top-2 and top-k gatings (``deepspeed.moe.sharded_moe``'s)
* :mod:`.utils`   which parameters are experts, the optimizer groups that keep them apart
                  (``split_params_into_different_moe_groups_for_optimizer``), and the EP
                  group ``deepspeed.initialize`` gives each layer

DeepSpeedExamples' CIFAR script (``training/cifar/cifar10_deepspeed.py --moe``) runs
unchanged; docs/moe.md says what is there and how it is checked against DeepSpeed.
"""

from __future__ import annotations

from typing import NoReturn

from hybrid.deepspeed.missing import refuse
from hybrid.deepspeed.moe import gating, layer, utils

__all__ = ["gating", "layer", "utils"]


def __getattr__(name: str) -> NoReturn:
    refuse("moe", name, "deepspeed.moe serves layer (MoE), sharded_moe's gating as "
                        "moe.gating, and utils")
