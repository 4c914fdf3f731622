"""The ZeRO stage, decided once as a plan of what is sharded over the DP group."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardingPlan:
    """Which model states each DP rank keeps only 1/N of.

    =======  =========  =====  ======
    stage    optimizer  grads  params
    =======  =========  =====  ======
    0        no         no     no
    1        yes        no     no
    2        yes        yes    no
    3        yes        yes    yes
    =======  =========  =====  ======

    ``optimizer``: fp32 master weights and Adam moments. ``grads``: no full
    gradient buffer; each micro-batch's gradients are reduce-scattered into a
    1/N shard as backward produces them. ``params``: a module's parameters exist
    whole only while it runs.
    """

    optimizer: bool
    grads: bool
    params: bool

    @classmethod
    def for_stage(cls, stage: int) -> ShardingPlan:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        return cls(optimizer=stage >= 1, grads=stage >= 2, params=stage == 3)

    @property
    def stage(self) -> int:
        """The ZeRO stage (0-3) this plan is: the one place the number lives."""
        return int(self.optimizer) + int(self.grads) + int(self.params)
