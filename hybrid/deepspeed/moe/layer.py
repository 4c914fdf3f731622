"""``deepspeed.moe.layer.MoE``: refused when built, with what to do instead.

The class exists so that a script naming it (``deepspeed.moe.layer.MoE(...)`` inside
``if args.moe:``) imports and runs its dense path; building one is a
:class:`NotImplementedError` saying hybrid has no mixture of experts yet.
"""

from __future__ import annotations

from typing import Any, NoReturn

from hybrid.deepspeed.missing import refuse

__all__ = ["MoE"]


class MoE:
    """DeepSpeed's MoE layer: not in hybrid yet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        experts = kwargs.get("num_experts", "?")
        raise NotImplementedError(
            f"deepspeed.moe.layer.MoE(num_experts={experts}): hybrid has no mixture of "
            f"experts yet (expert parallelism is planned); run the dense model (without "
            f"the script's MoE switch, e.g. --moe)")


def __getattr__(name: str) -> NoReturn:
    refuse("moe.layer", name, "hybrid serves MoE from it, refused when built")
