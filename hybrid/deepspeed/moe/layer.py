"""``deepspeed.moe.layer.MoE``: refused when built, with what to do instead.

The class exists so that a script naming it (``deepspeed.moe.layer.MoE(...)`` inside
``if args.moe:``) imports and runs its dense path; building one is a
:class:`NotImplementedError` saying DeepSpeed's layer is not there yet, and where
hybrid's own MoE layers are (``pretrain_gpt.py``'s ``--num-experts``, docs/moe.md).
"""

from __future__ import annotations

from typing import Any, NoReturn

from hybrid.deepspeed.missing import refuse

__all__ = ["MoE"]


class MoE:
    """DeepSpeed's MoE layer: not in hybrid yet (hybrid's own: models.moe)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        experts = kwargs.get("num_experts", "?")
        raise NotImplementedError(
            f"deepspeed.moe.layer.MoE(num_experts={experts}): DeepSpeed's MoE layer (its "
            f"gating, capacity and random token selection) is not in hybrid yet; run the "
            f"dense model (without the script's MoE switch, e.g. --moe), or hybrid's own "
            f"MoE layers through pretrain_gpt.py (--num-experts, docs/moe.md)")


def __getattr__(name: str) -> NoReturn:
    refuse("moe.layer", name, "hybrid serves MoE from it, refused when built")
